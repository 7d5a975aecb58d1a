"""Engine-allocated CPU tensors move into sealed shared memory in place.

Integrations (vLLM, transformers) register memory the engine allocated:
``adopt_tensors`` moves the pages under the tensors into a sealed memfd the
daemon can be handed, at the same addresses: each tensor object, its dtype,
shape, strides, contents and every view taken before stay valid.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import pytest
import torch

from kvtier.client import adopt_tensors
from kvtier.transfer.shm import SEALS


def _mapping(kv) -> torch.Tensor:
    """The handed-over memory as the daemon maps it (a second mapping of the fd)."""
    window = mmap.mmap(kv.fds()[0], 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(window, dtype=torch.uint8)


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
        mapped = _mapping(kv).view(torch.int8)
        base = kv.offsets[0] - 64  # memfd offset of buf[0]
        buf[150_000_000] = 42
        assert int(mapped[base + 150_000_000]) == 42
        mapped[base + 7] = -5
        assert int(buf[7]) == -5
        spec = kv.specs([0, 0])[1]
        assert (spec["kind"], spec["fd"], spec["offset"], spec["shape"]) == ("fd", 0, base + 4096, [10, 1000])
        del mapped
    finally:
        kv.close()
    buf.add_(1)  # still ordinary memory of the engine after the descriptor is gone
    assert int(buf[7]) == -4


def test_adopted_tensors_keep_identity_contents_and_geometry_and_cannot_be_truncated():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 2, 4, 16, generator=g).half()
    b = torch.randn(2, 8, 4, 16, generator=g).to(torch.bfloat16)
    c = torch.randn(16, 8, generator=g).t()  # non-contiguous strides
    before = [t.clone() for t in (a, b, c)]
    geometry = [(t.dtype, t.shape, t.stride(), t.data_ptr()) for t in (a, b, c)]
    kv = adopt_tensors([a, b, c])
    assert kv.tensors[0] is a and kv.tensors[1] is b and kv.tensors[2] is c
    assert [(t.dtype, t.shape, t.stride(), t.data_ptr()) for t in (a, b, c)] == geometry
    assert all(x.equal(y) for x, y in zip((a, b, c), before))
    fd = kv.fds()[0]
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
    a[3].fill_(7)  # the engine's own tensor now writes the memory the daemon maps
    mapped = _mapping(kv)
    assert mapped[kv.offsets[0]:kv.offsets[0] + a.numel() * 2].view(torch.float16).view(a.shape)[3].eq(7).all()
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    del mapped
    kv.close()
    assert a[3].eq(7).all()  # the tensors outlive the descriptor


def test_adopt_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="at least one"):
        adopt_tensors([])
    with pytest.raises(ValueError, match="CPU tensors"):
        adopt_tensors([torch.zeros(2, device="meta")])
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        adopt_tensors([torch.zeros(2, dtype=torch.complex64)])


def test_adopted_tensors_round_trip_through_the_daemon(daemon):
    from kvtier.client import Client
    from tests.helpers import NS
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(32, 2, 16, 2, 32, generator=g).half() for _ in range(4)]  # engine-allocated
    kv = adopt_tensors(layers)
    hashes = [bytes([0x77, i]) * 8 for i in range(4)]
    with Client(daemon.socket) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, [0, 1, 2, 3]).wait().ok
        want = [t[:4].clone() for t in layers]
        for t in layers:
            t[8:12].zero_()
        assert c.load(hashes, [8, 9, 10, 11]).wait().ok
    assert all(w.equal(t[8:12]) for w, t in zip(want, layers))
