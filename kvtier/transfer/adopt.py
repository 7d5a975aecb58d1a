"""Adopt tensors an engine already allocated into sealed shared memory.

Engines such as vLLM and Hugging Face allocate their CPU KV cache themselves
(one big ``torch.zeros``), long before any kvtier code runs, and keep views
of it in every attention layer. The daemon can only copy from memory it is
handed, so the storage under those tensors moves into a sealed ``memfd``
(the same kind of memory ``ShmKVCache`` allocates, handed to the daemon as a
descriptor):

1. one memfd with a page-aligned region per storage, every page reserved now
   (a full tmpfs fails here, not as SIGBUS later);
2. each storage's bytes are copied into a fresh mapping of its region, and the
   storage's data pointer is swapped for that mapping: every tensor and view
   on the storage (the engine's layers included) now reads and writes the
   memfd. Only the storage's own bytes move; the rest of the last page is
   zeros of the memfd, never another object of the process;
3. the memfd is sealed against shrinking and growing (no SIGBUS in the daemon).

The mapping belongs to the storage: when the engine frees its cache, it is
unmapped with it, and the heap memory the storage had is freed as usual.

Why not remap the engine's pages in place (same addresses, no copy)? A page
is the unit of sharing, and torch's allocator starts a storage 64 bytes into
its allocation: the first and last page hold the allocator's bookkeeping and
other objects, which would become readable to the daemon and shared with
``fork()``ed children; and heap pages remapped in place stay shared after the
allocator hands them to someone else. Data pointers therefore change (the
tensor objects do not): callers must not keep raw pointers from before.

While copying, the old storage's whole pages are released as soon as they
are copied, so adoption needs one piece (``_PIECE``) of extra memory, not a
second cache. Assumption: nothing reads or writes the tensors while
``adopt_tensors`` runs (it is called once, when the engine registers its KV
cache, before any request).

Pinned (page-locked, CUDA host) tensors are refused: their pages are
registered with the GPU driver for DMA, which would keep using the old ones.

Primitive: ``adopt_tensors(tensors) -> ShmKVCache`` (its ``tensors`` are the
given tensor objects, its specs refer to the memfd it hands over).
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
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = 4


class AdoptError(ValueError):
    """The tensors' memory could not be moved into shared memory."""


class _AdoptedMemory:
    """The memfd under adopted tensors (the storages map it; we keep the fd to hand over)."""

    def __init__(self, fd: int, name: str, size: int):
        self.fd, self.name, self.size = fd, name, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def adopt_tensors(tensors: Sequence[torch.Tensor]) -> ShmKVCache:
    """Move the CPU storages under ``tensors`` into one new sealed memfd.

    Tensors may share storage (views of one allocation); each distinct storage
    moves once, and every tensor on it follows (same objects, new data pointers)."""
    tensors = list(tensors)
    if not tensors:
        raise AdoptError("adopt_tensors needs at least one tensor")
    storages: dict[int, torch.UntypedStorage] = {}  # the storage's own address -> storage
    for i, t in enumerate(tensors):
        _check(i, t)
        st = t.untyped_storage()
        storages.setdefault(st._cdata, st)
    ordered = sorted(((st.data_ptr(), st) for st in storages.values()), key=lambda p: p[0])
    for (lo, a), (hi, _) in zip(ordered, ordered[1:]):
        if lo + a.nbytes() > hi:
            raise AdoptError("two of the tensors' storages overlap without being one storage")
    regions, total = [], 0  # (storage, memfd offset)
    for _, st in ordered:
        regions.append((st, total))
        total += _round_up(st.nbytes())
    label = f"{KV_PREFIX}{os.getpid()}.a{next(_counter)}"
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        try:
            os.posix_fallocate(fd, 0, total)  # fail now (ENOSPC), not with SIGBUS later
        except OSError as exc:
            raise AdoptError(f"cannot reserve {total} bytes of shared memory: {exc.strerror}") from None
        # Every window first: after the first copy starts, nothing may fail (the
        # old pages are released as they are copied).
        fresh = [_window(fd, st.nbytes(), off) for st, off in regions]
        bases = {}
        for (st, off), new in zip(regions, fresh):
            bases[st.data_ptr()] = off
            _copy_releasing(st.data_ptr(), new.data_ptr(), st.nbytes())
        offsets = [bases[t.untyped_storage().data_ptr()] for t in tensors]
        offsets = [o + t.data_ptr() - t.untyped_storage().data_ptr() for o, t in zip(offsets, tensors)]
        for (st, _), new in zip(regions, fresh):
            st._swap_data_ptr_(new)  # every tensor on st now uses the memfd; new holds the old memory
        del fresh, new  # frees the engine's old memory
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return ShmKVCache._adopted(_AdoptedMemory(fd, f"memfd:{label}", total), tensors, offsets)


def _check(i: int, t) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise AdoptError(f"tensor {i}: adopt_tensors takes CPU tensors (GPU caches: CudaKVCache)")
    if t.is_pinned():
        raise AdoptError(f"tensor {i}: pinned (page-locked) memory cannot be moved into shared memory: "
                         "the GPU driver would keep using the old pages; allocate the KV cache unpinned "
                         "(or in ShmKVCache) to share it")
    if any(s < 0 for s in t.stride()):
        raise AdoptError(f"tensor {i}: negative strides are not supported")
    dtype_name(t.dtype)  # raises ValueError for dtypes the daemon cannot map
    if t.untyped_storage().nbytes() == 0:
        raise AdoptError(f"tensor {i}: an empty storage holds no KV")
    if not hasattr(t.untyped_storage(), "_swap_data_ptr_"):
        raise AdoptError(f"torch {torch.__version__} cannot swap a storage's memory; kvtier needs a newer torch")


def _window(fd: int, nbytes: int, offset: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` of the memfd at ``offset``, owning its mapping
    (unmapped when the last tensor on it is gone)."""
    window = mmap.mmap(fd, _round_up(nbytes), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    return torch.frombuffer(window, dtype=torch.uint8, count=nbytes).untyped_storage()


def _copy_releasing(src: int, dst: int, nbytes: int) -> None:
    """Copy piece by piece, giving the whole pages of ``src`` copied so far
    back to the kernel (they read as zeros until ``src`` is freed). The pages
    holding ``src``'s first and last byte also hold bytes that are not ours: kept."""
    released = _round_up(src)
    for start in range(0, nbytes, _PIECE):
        n = min(_PIECE, nbytes - start)
        ctypes.memmove(dst + start, src + start, n)
        copied = (src + start + n) & ~(_PAGE - 1)
        if copied > released:
            _libc.madvise(released, copied - released, _MADV_DONTNEED)  # advisory: failing costs memory only
            released = copied


def _round_up(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
