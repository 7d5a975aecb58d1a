"""Block pool: shared-memory segment, slab allocator, eviction policy, index."""

from .allocator import IntegrityError, SlabAllocator
from .entry import READY, WRITING
from .index import BlockIndex, LoadPlan, Bucket, StorePlan
from .policy import POLICIES, FIFOPolicy, LRUPolicy
from .segment import SegmentError, ShmSegment, cleanup_stale, unlink_segment
from .sizes import format_size, parse_size
from .swap import SwapRecord, SwapTable

__all__ = [
    "POLICIES", "READY", "WRITING", "BlockIndex", "FIFOPolicy", "IntegrityError", "LRUPolicy",
    "LoadPlan", "Bucket", "SegmentError", "ShmSegment", "SlabAllocator", "StorePlan", "SwapRecord", "SwapTable",
    "cleanup_stale", "format_size", "parse_size", "unlink_segment",
]
