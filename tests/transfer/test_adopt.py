"""Engine-allocated CPU tensors move into sealed shared memory.

Integrations (vLLM, transformers) register memory the engine allocated:
``adopt_tensors`` copies each storage under the tensors into a sealed memfd
the daemon can be handed and points the storage at it, so each tensor
object, every view taken before (the engine's layers), its dtype, shape,
strides and contents stay valid. Only the storages' own bytes move: an
object sharing a page with the cache is never shared with the daemon or
with a forked child.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
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


def test_every_view_of_an_adopted_storage_reads_and_writes_the_handed_over_memory():
    """The storage moves, not just the tensors passed in: ``buf`` itself (not
    passed) and views taken before adoption hold what they held, and every
    write is seen through a second mapping of the descriptor (the daemon's)
    and back."""
    buf = torch.arange(3 * (64 << 20) + 12345, dtype=torch.int64).to(torch.int8)  # 3+ pieces, odd size
    before = buf.clone()
    views = [buf[64:64 + 1000 * 512].view(1000, 512), buf[4096:].as_strided((10, 1000), (100000, 1))]
    kv = adopt_tensors(views)
    try:
        assert views[0].data_ptr() == buf.data_ptr() + 64 and views[1].data_ptr() == buf.data_ptr() + 4096
        assert torch.equal(buf, before)
        mapped = _mapping(kv).view(torch.int8)
        base = kv.offsets[0] - 64  # memfd offset of buf[0]
        buf[150_000_000] = 42
        assert int(mapped[base + 150_000_000]) == 42
        mapped[base + 7] = -5
        mapped[base + 64] = -6
        assert int(buf[7]) == -5 and int(views[0][0, 0]) == -6
        spec = kv.specs([0, 0])[1]
        assert (spec["kind"], spec["fd"], spec["offset"], spec["shape"]) == ("fd", 0, base + 4096, [10, 1000])
        del mapped
    finally:
        kv.close()
    buf.add_(1)  # still the engine's memory after the descriptor is gone
    assert int(buf[7]) == -4


def test_adopted_tensors_keep_identity_contents_and_geometry_and_cannot_be_truncated():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 2, 4, 16, generator=g).half()
    b = torch.randn(2, 8, 4, 16, generator=g).to(torch.bfloat16)
    c = torch.randn(16, 8, generator=g).t()  # non-contiguous strides
    before = [t.clone() for t in (a, b, c)]
    geometry = [(t.dtype, t.shape, t.stride()) for t in (a, b, c)]
    kv = adopt_tensors([a, b, c])
    assert kv.tensors[0] is a and kv.tensors[1] is b and kv.tensors[2] is c
    assert [(t.dtype, t.shape, t.stride()) for t in (a, b, c)] == geometry
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


def test_an_object_sharing_a_page_with_the_cache_is_never_shared():
    """The cache's storage starts 100 bytes into a page and ends mid-page; the
    bytes around it belong to someone else (as the allocator's bookkeeping and
    small objects do on the heap). After adoption the handed-over memory holds
    only the cache's bytes, the neighbours keep their contents, and after a
    fork() the child's writes to the neighbours stay in the child while its
    writes to the cache reach the parent (that memory is shared, by design)."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 3 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # like the heap
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    lo, hi = 100, 2 * page + 808
    region[:] = b"\xab" * (3 * page)  # the neighbours' bytes
    kv_tensor = torch.frombuffer(region, dtype=torch.uint8, count=hi - lo, offset=lo)
    kv_tensor.copy_(torch.arange(hi - lo, dtype=torch.int64).remainder(251).to(torch.uint8))
    kv = adopt_tensors([kv_tensor])
    try:
        shared = bytes(_mapping(kv).numpy())
        assert len(shared) == -(-(hi - lo) // page) * page
        assert shared[:hi - lo] == bytes(kv_tensor.numpy()) and shared[hi - lo:] == bytes(len(shared) - (hi - lo))
        assert region[:lo] == b"\xab" * lo and region[hi:] == b"\xab" * (3 * page - hi)
        pid = os.fork()
        if pid == 0:  # the child: scribble over the neighbours and the cache, then leave
            ctypes.memset(base, 0x11, lo)
            ctypes.memset(base + hi, 0x22, 3 * page - hi)
            ctypes.memset(kv_tensor.data_ptr(), 0x33, 8)
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert region[:lo] == b"\xab" * lo and region[hi:] == b"\xab" * (3 * page - hi)
        assert bytes(kv_tensor[:8].numpy()) == b"\x33" * 8
        assert bytes(_mapping(kv)[:8].numpy()) == b"\x33" * 8
    finally:
        kv.close()


def test_freeing_an_adopted_cache_unmaps_its_shared_memory():
    """The memfd mapping belongs to the storage: when the engine drops its
    cache (and the descriptor is closed) nothing of it stays mapped."""
    cache = torch.zeros(1 << 20)
    kv = adopt_tensors([cache[:1000], cache[1000:]])
    label = kv.name.removeprefix("memfd:")
    maps = lambda: open("/proc/self/maps").read()  # noqa: E731
    assert label in maps()
    kv.close()
    assert label in maps()  # the engine still uses it
    del cache, kv
    gc.collect()
    assert label not in maps()


@pytest.mark.gpu
def test_pinned_tensors_are_refused():
    """Page-locked memory is registered with the GPU driver for DMA, which
    would keep using the old pages after a move."""
    pinned = torch.zeros(4096).pin_memory()
    with pytest.raises(ValueError, match="pinned"):
        adopt_tensors([pinned])


def test_adopt_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="at least one"):
        adopt_tensors([])
    with pytest.raises(ValueError, match="CPU tensors"):
        adopt_tensors([torch.zeros(2, device="meta")])
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        adopt_tensors([torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="empty storage"):
        adopt_tensors([torch.zeros(0)])
    big = torch.zeros(100)
    with pytest.raises(ValueError, match="overlap"):  # two storages on one memory
        adopt_tensors([big, torch.frombuffer(big.numpy(), dtype=torch.float32, count=10)])


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
