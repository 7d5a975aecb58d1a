"""Adopt tensors an engine already allocated into named shared memory, in place.

Engines such as vLLM allocate their CPU KV cache themselves (one big
``torch.zeros``), long before any kvtier code runs, and their attention
kernels keep the raw pointers. The daemon can only copy from memory it can
map. Instead of a staging buffer (an extra copy per transfer), this module
moves the *pages* under the existing tensors into a shared-memory segment:

1. create a segment as large as the page-rounded byte range of the storage;
2. piece by piece, copy the range's current contents into it and
   ``mmap(MAP_FIXED | MAP_SHARED)`` the segment over the very same virtual
   addresses (which frees the old pages).

Every tensor, view and kernel pointer stays valid and unchanged
(``data_ptr()`` is the same), but the bytes now live in a segment the daemon
maps by name. The first and last page may also hold a few bytes of the
allocator's bookkeeping; they are copied along and stay valid memory.

Assumption: nothing writes the adopted range while ``adopt_into_shm`` runs
(it is called once, when the engine registers its KV cache, before any
request). The allocation must outlive the segment's use; engines keep their
KV cache for their whole life.

One function is the interface (``adopt_into_shm``); when registration moves
to passing memfds over SCM_RIGHTS only its segment creation changes.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import secrets

import posix_ipc
import torch

from ..pool.segment import cleanup_stale, unlink_segment
from .shm import KV_PREFIX, tensor_spec

_PAGE = mmap.PAGESIZE
_PIECE = 64 << 20
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FIXED = 0x10
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page tables now, not a fault per page in attention
_FAILED = ctypes.c_void_p(-1).value


class AdoptError(RuntimeError):
    """The tensors' memory could not be moved into shared memory."""


class AdoptedKV:
    """Engine tensors whose memory now lives in one named segment.

    Quacks like ``ShmKVCache`` for ``Client.register_kv_cache``: ``specs``
    describes ``tensors`` (the caller's views, untouched) by segment offset."""

    def __init__(self, name: str, tensors: list[torch.Tensor], offsets: list[int]):
        self.name, self.tensors, self.offsets = name, tensors, offsets

    def specs(self, block_dims: list[int]) -> list[dict]:
        return [tensor_spec(self.name, o, t, d) for o, t, d in zip(self.offsets, self.tensors, block_dims)]

    def close(self) -> None:
        """Unlink the name; the pages stay mapped under the engine's tensors."""
        self.tensors = []
        unlink_segment(self.name)


def adopt_into_shm(tensors: list[torch.Tensor], mode: int = 0o600,
                   group: int | None = None) -> AdoptedKV:
    """Move the CPU storage under ``tensors`` into one new named segment, in place.

    Tensors may share storage (views of one allocation); each distinct storage
    is adopted once. Memory moves piece by piece (``_PIECE``), so the extra
    memory needed while adopting is one piece, not a second copy of the cache."""
    ranges: dict[int, tuple[int, int]] = {}  # page-aligned start -> (end, segment offset)
    for t in tensors:
        if t.device.type != "cpu":
            raise AdoptError(f"only CPU tensors can be adopted, got {t.device}")
        st = t.untyped_storage()
        lo = st.data_ptr() & ~(_PAGE - 1)
        hi = -(-(st.data_ptr() + st.nbytes()) // _PAGE) * _PAGE
        if lo in ranges:
            continue
        if any(lo < e and s < hi for s, (e, _) in ranges.items()):
            raise AdoptError("tensors' storages overlap without being the same")
        ranges[lo] = (hi, 0)
    total = 0
    for lo in sorted(ranges):
        hi = ranges[lo][0]
        ranges[lo] = (hi, total)
        total += hi - lo
    cleanup_stale(KV_PREFIX)  # this user's dead engines' segments (see ShmKVCache)
    name = f"/{KV_PREFIX}{os.getpid()}.a{next(_counter)}.{secrets.token_hex(3)}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=0)
    try:
        os.fchmod(shm.fd, mode)
        if group is not None:
            os.fchown(shm.fd, -1, group)
        os.ftruncate(shm.fd, total)
        for lo, (hi, off) in sorted(ranges.items()):
            for a in range(lo, hi, _PIECE):
                _move(shm.fd, a, min(hi, a + _PIECE) - a, off + a - lo)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()
    offsets = []
    for t in tensors:
        lo = t.untyped_storage().data_ptr() & ~(_PAGE - 1)
        offsets.append(ranges[lo][1] + t.data_ptr() - lo)
    return AdoptedKV(name, list(tensors), offsets)


def _move(fd: int, addr: int, length: int, offset: int) -> None:
    """Give the pages at ``addr`` to the segment at ``offset``: reserve, copy, map over."""
    try:
        os.posix_fallocate(fd, offset, length)  # fail now (ENOSPC), not with SIGBUS later
    except OSError as exc:
        raise AdoptError(f"cannot reserve {length} bytes in /dev/shm: {exc.strerror}") from None
    window = mmap.mmap(fd, length, offset=offset)
    try:
        view = (ctypes.c_char * length).from_buffer(window)
        ctypes.memmove(ctypes.addressof(view), addr, length)
        del view
    finally:
        window.close()
    got = _libc.mmap(addr, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED | _POPULATE, fd, offset)
    if got in (None, _FAILED) or got != addr:
        raise AdoptError(f"mmap over {addr:#x} failed: {os.strerror(ctypes.get_errno())}")
