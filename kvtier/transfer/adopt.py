"""Adopt tensors an engine already allocated into sealed shared memory, in place.

Engines such as vLLM and Hugging Face allocate their CPU KV cache themselves
(one big ``torch.zeros``), long before any kvtier code runs, and their
kernels and views keep raw pointers. The daemon can only copy from memory
it is handed. Instead of a staging buffer (an extra copy per transfer), this
module moves the *pages* under the existing tensors into a sealed ``memfd``
(the same kind of memory ``ShmKVCache`` allocates, handed to the daemon as a
descriptor):

1. create a memfd as large as the page-rounded byte ranges of the storages;
2. piece by piece, reserve it, copy the range's current contents into it and
   ``mmap(MAP_FIXED | MAP_SHARED)`` it over the very same virtual addresses
   (which frees the old pages);
3. seal it against shrinking and growing (no SIGBUS in the daemon, ever).

Every tensor, view and kernel pointer stays valid and unchanged
(``data_ptr()`` is the same), including views the engine built earlier. The
first and last page may also hold a few bytes of the allocator's
bookkeeping; they are copied along and stay valid memory.

Assumption: nothing writes the adopted range while ``adopt_tensors`` runs (it
is called once, when the engine registers its KV cache, before any request).
The allocation must outlive the daemon's use of it; engines keep their KV
cache for their whole life.

Primitive: ``adopt_tensors(tensors) -> ShmKVCache`` (its ``tensors`` are the
given ones, its specs refer to the memfd it hands over).
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
from typing import Sequence

import torch

from .shm import KV_PREFIX, SEALS, ShmKVCache
from .specs import dtype_name

_PAGE = mmap.PAGESIZE
_PIECE = 64 << 20
_counter = itertools.count()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FIXED = 0x10
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # page tables now, not a fault per page in attention
_FAILED = ctypes.c_void_p(-1).value


class AdoptError(ValueError):
    """The tensors' memory could not be moved into shared memory."""


class _AdoptedMemory:
    """The memfd under adopted tensors (the tensors map it; we keep the fd to hand over)."""

    def __init__(self, fd: int, name: str, size: int):
        self.fd, self.name, self.size = fd, name, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def adopt_tensors(tensors: Sequence[torch.Tensor]) -> ShmKVCache:
    """Move the CPU storage under ``tensors`` into one new sealed memfd, in place.

    Tensors may share storage (views of one allocation); each distinct storage
    is adopted once. Memory moves piece by piece (``_PIECE``), so the extra
    memory needed while adopting is one piece, not a second copy of the cache."""
    tensors = list(tensors)
    if not tensors:
        raise AdoptError("adopt_tensors needs at least one tensor")
    spans = []  # page-rounded byte range of every storage
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise AdoptError(f"tensor {i}: adopt_tensors takes CPU tensors (GPU caches: CudaKVCache)")
        if any(s < 0 for s in t.stride()):
            raise AdoptError(f"tensor {i}: negative strides are not supported")
        dtype_name(t.dtype)  # raises ValueError for dtypes the daemon cannot map
        st = t.untyped_storage()
        spans.append((st.data_ptr() & ~(_PAGE - 1), -(-(st.data_ptr() + max(st.nbytes(), 1)) // _PAGE) * _PAGE))
    # Separate allocations may share a page: overlapping spans become one range
    # (moving a page moves every byte on it, whoever owns them).
    ranges: list[list[int]] = []  # [start, end, memfd offset], ascending, disjoint
    for lo, hi in sorted(spans):
        if ranges and lo <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], hi)
        else:
            ranges.append([lo, hi, 0])
    total = 0
    for r in ranges:
        r[2] = total
        total += r[1] - r[0]
    label = f"{KV_PREFIX}{os.getpid()}.a{next(_counter)}"
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        for lo, hi, off in ranges:
            for a in range(lo, hi, _PIECE):
                _move(fd, a, min(hi, a + _PIECE) - a, off + a - lo)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    offsets = []
    for t in tensors:
        lo, _, off = next(r for r in ranges if r[0] <= t.data_ptr() < r[1] or r[0] == t.data_ptr())
        offsets.append(off + t.data_ptr() - lo)
    return ShmKVCache._adopted(_AdoptedMemory(fd, f"memfd:{label}", total), tensors, offsets)


def _move(fd: int, addr: int, length: int, offset: int) -> None:
    """Give the pages at ``addr`` to the segment at ``offset``: reserve, copy, map over."""
    try:
        os.posix_fallocate(fd, offset, length)  # fail now (ENOSPC), not with SIGBUS later
    except OSError as exc:
        raise AdoptError(f"cannot reserve {length} bytes of shared memory: {exc.strerror}") from None
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
