"""Faulting a new pool in on several threads at once.

The daemon faults its whole pool in before it serves, so that no copy takes a
page fault and a /dev/shm too small fails the start instead of a later copy
(SIGBUS). It did so with ``posix_fallocate`` (the kernel allocates and zeroes
every page) and then ``MAP_POPULATE`` (page tables), each on one thread:
about a second per GiB here, ~35 minutes for a 2 TB pool (docs/SCALE.md).
``MADV_POPULATE_WRITE`` (Linux 5.14) does both for a range of the mapping,
and ranges on separate threads fault in at once (ctypes calls release the
GIL). A tmpfs without room fails it with EFAULT or ENOMEM, never SIGBUS: the
same fail-fast as ``posix_fallocate``. On an older kernel (EINVAL) the caller
falls back to the old way.

Primitives: ``populate(mm, size, name, threads=None) -> bool`` (False: the kernel lacks it;
``NoRoom`` without the memory), ``no_room(size, name, errno)`` (the message),
``PARALLEL_MIN`` (smaller segments keep the old way: one thread is enough).
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading

MADV_POPULATE_WRITE = 23
PARALLEL_MIN = 1 << 30   # bytes: below it the old way (a mirror table, a journal, an engine's segment)
CHUNK = 256 << 20        # a thread's share at a time: threads that finish early take more
MAX_THREADS = 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class NoRoom(OSError):
    """The segment's memory could not be allocated (tmpfs full, or no memory)."""


def no_room(size: int, name: str, err: int) -> str:
    """What a segment that cannot be reserved says (here, and ``segment``'s other two ways)."""
    return f"cannot reserve {size} bytes for {name}: {os.strerror(err)} (is /dev/shm large enough?)"


def _advise(base: int, off: int, n: int) -> int:
    """``MADV_POPULATE_WRITE`` over ``n`` bytes at ``base + off``: 0, or the errno."""
    return 0 if _libc.madvise(base + off, n, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def threads_for(size: int) -> int:
    return max(1, min(MAX_THREADS, os.cpu_count() or 1, size // CHUNK))


def populate(mm, size: int, name: str, threads: int | None = None) -> bool:
    """Fault in every page of the shared mapping ``mm`` (``size`` bytes) for writing.
    False when this kernel has no ``MADV_POPULATE_WRITE`` (nothing was done);
    ``NoRoom`` when the memory is not there (some pages may be in: the caller unlinks)."""
    anchor = ctypes.c_char.from_buffer(mm)  # an export of the mapping: mm cannot close under us
    try:
        base = ctypes.addressof(anchor)
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        for off in range(0, size, CHUNK):
            chunks.put((off, min(CHUNK, size - off)))
        failed: list[int] = []

        def work() -> None:
            while not failed:
                try:
                    err = _advise(base, *chunks.get_nowait())
                except queue.Empty:
                    return
                if err:
                    failed.append(err)

        # The first chunk on this thread: an old kernel says EINVAL before any thread starts.
        err = _advise(base, *chunks.get_nowait())
        if err in (errno.EINVAL, errno.ENOSYS):
            return False
        if err:
            failed.append(err)
        pool = [threading.Thread(target=work, name=f"kvtier-prefault-{i}", daemon=True)
                for i in range(threads if threads is not None else threads_for(size))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if failed:
            raise NoRoom(failed[0], no_room(size, name, failed[0]))
        return True
    finally:
        del anchor
