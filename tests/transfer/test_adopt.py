"""Adopting engine-allocated tensors into shared memory, in place."""

from __future__ import annotations

import torch

from kvtier.pool.segment import ShmSegment
from kvtier.transfer.adopt import adopt_into_shm


def test_adopted_tensors_keep_their_addresses_and_contents_and_share_bytes_with_the_segment():
    """After adoption the engine's views point where they did, hold what they
    held, and every write is seen through the daemon's mapping and back."""
    buf = torch.arange(3 * (64 << 20) + 12345, dtype=torch.int64).to(torch.int8)  # 3+ pieces, odd size
    before = buf.clone()
    views = [buf[64:64 + 1000 * 512].view(1000, 512), buf[4096:].as_strided((10, 1000), (100000, 1))]
    ptrs = [v.data_ptr() for v in views]
    kv = adopt_into_shm(views)
    try:
        assert [v.data_ptr() for v in views] == ptrs
        assert torch.equal(buf, before)
        seg = ShmSegment(kv.name, populate=False)
        mapped = torch.frombuffer(seg.buffer, dtype=torch.int8)
        base = kv.offsets[0] - 64  # segment offset of buf[0]
        buf[150_000_000] = 42
        assert int(mapped[base + 150_000_000]) == 42
        mapped[base + 7] = -5
        assert int(buf[7]) == -5
        spec = kv.specs([0, 0])[1]
        assert (spec["seg"], spec["offset"], spec["shape"]) == (kv.name, base + 4096, [10, 1000])
        del mapped
        seg.close()
    finally:
        kv.close()
    buf.add_(1)  # still ordinary memory of the engine after the name is gone
    assert int(buf[7]) == -4
