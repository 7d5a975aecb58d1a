"""The number of namespaces is capped: a client minting fingerprints cannot grow the daemon."""

import pytest

from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.index import MAX_NAMESPACES


def test_namespace_cap():
    ix = BlockIndex(SlabAllocator(1 << 20, 1 << 20))
    for i in range(MAX_NAMESPACES):
        ix.namespace(f"model-{i}", 4096)
    with pytest.raises(ValueError, match="too many namespaces"):
        ix.namespace("one-more", 4096)
    assert ix.namespace("model-7", 4096).key == "model-7"  # existing ones still resolve
