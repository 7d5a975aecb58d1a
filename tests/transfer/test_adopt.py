"""Adopting engine-allocated tensors into shared memory, in place."""

from __future__ import annotations

import torch

import mmap

from kvtier.transfer.adopt import adopt_tensors


def test_adopted_tensors_keep_their_addresses_and_contents_and_share_bytes_with_the_memfd():
    """After adoption the engine's views point where they did (views taken
    before it too), hold what they held, and every write is seen through a
    second mapping of the handed-over descriptor (the daemon's) and back."""
    buf = torch.arange(3 * (64 << 20) + 12345, dtype=torch.int64).to(torch.int8)  # 3+ pieces, odd size
    before = buf.clone()
    views = [buf[64:64 + 1000 * 512].view(1000, 512), buf[4096:].as_strided((10, 1000), (100000, 1))]
    ptrs = [v.data_ptr() for v in views]
    kv = adopt_tensors(views)
    try:
        assert [v.data_ptr() for v in views] == ptrs
        assert torch.equal(buf, before)
        [fd] = kv.fds()
        window = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mapped = torch.frombuffer(window, dtype=torch.int8)
        base = kv.offsets[0] - 64  # segment offset of buf[0]
        buf[150_000_000] = 42
        assert int(mapped[base + 150_000_000]) == 42
        mapped[base + 7] = -5
        assert int(buf[7]) == -5
        spec = kv.specs([0, 0])[1]
        assert (spec["kind"], spec["fd"], spec["offset"], spec["shape"]) == ("fd", 0, base + 4096, [10, 1000])
        del mapped
        window.close()
    finally:
        kv.close()
    buf.add_(1)  # still ordinary memory of the engine after the name is gone
    assert int(buf[7]) == -4
