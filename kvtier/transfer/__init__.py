"""Data path: KV layouts, shared-memory KV export/import, the copy worker."""

from .layout import DTYPES, KVLayout, dtype_name
from .shm import KV_PREFIX, ShmKVCache, SpecError, open_specs, tensor_spec
from .worker import CopyWorker

__all__ = ["DTYPES", "KV_PREFIX", "CopyWorker", "KVLayout", "ShmKVCache", "SpecError",
           "dtype_name", "open_specs", "tensor_spec"]
