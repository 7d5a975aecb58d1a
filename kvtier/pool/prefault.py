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

Primitives: ``populate(mm, size, name, threads=None, upto=None) -> bool`` (False: the kernel
lacks it; ``NoRoom`` without the memory), ``Background(mm, size, name, start)`` (the rest while
the daemon serves: ``.fd``, ``.take() -> bytes in``, ``.finished``, ``.error``, ``.join()``, ``.stop()``),
``no_room(size, name, errno)`` (the message), ``PARALLEL_MIN`` (smaller segments keep the old
way: one thread is enough), ``FIRST`` (what a pool serving while it faults has in at start).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

from ..waker import Inbox

MADV_POPULATE_WRITE = 23
PARALLEL_MIN = 1 << 30   # bytes: below it the old way (a mirror table, a journal, an engine's segment)
CHUNK = 256 << 20        # a thread's share at a time: threads that finish early take more
MAX_THREADS = 16
FIRST = 1 << 30          # a pool that serves while it faults in has this much in before it serves

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


def populate(mm, size: int, name: str, threads: int | None = None, upto: int | None = None) -> bool:
    """Fault in every page of the shared mapping ``mm`` (``size`` bytes; ``upto``: only its
    first ``upto``) for writing. False when this kernel has no ``MADV_POPULATE_WRITE`` (nothing
    was done); ``NoRoom`` when the memory is not there (some pages may be in: the caller unlinks)."""
    end = size if upto is None else min(size, upto)
    first = min(CHUNK, end)
    anchor = ctypes.c_char.from_buffer(mm)  # an export of the mapping: mm cannot close under us
    try:
        # The first chunk on this thread: an old kernel says EINVAL before any thread starts.
        err = _advise(ctypes.addressof(anchor), 0, first)
    finally:
        del anchor
    if err in (errno.EINVAL, errno.ENOSYS):
        return False
    if err:
        raise NoRoom(err, no_room(size, name, err))
    rest = Background(mm, end, name, start=first, threads=threads if threads is not None else threads_for(end))
    rest.join()
    rest.stop()
    if rest.error:
        raise NoRoom(rest.errno, rest.error)
    return True


class Background:
    """The rest of a mapping, from ``start``, faulted in on threads while the daemon serves
    from the part that is in: a 2 TB pool takes minutes to fault in, and the first request
    need not wait for it. Chunks go out in order; ``done`` is the prefix faulted in whole (a
    chunk finishing before an earlier one counts once that one has), so the allocator hands
    out a slab only once its every page is in: no copy ever faults on a full tmpfs (SIGBUS).
    The loop wakes on ``fd`` and reads ``take()``; ``error`` says why it stopped short (the
    pool then serves with what is in). ``stop()`` ends it (before the mapping is closed)."""

    def __init__(self, mm, size: int, name: str, start: int, threads: int | None = None,
                 chunk: int = CHUNK):
        self.size, self.name, self.chunk = size, name, chunk
        self.start = self.done = min(start, size)
        self.error = ""
        self.errno = 0                  # with ``error``: the errno of the chunk that failed
        self.started = time.monotonic()
        self.seconds = 0.0              # how long the rest took, once ``finished``
        self._next = self.done          # the next chunk handed out
        self._ahead: dict[int, int] = {}  # chunks done past ``done``: offset -> bytes
        self._lock = threading.Lock()
        self._stopping = False
        self._inbox = Inbox()
        self._anchor = ctypes.c_char.from_buffer(mm)  # the mapping cannot close under the threads
        self._base = ctypes.addressof(self._anchor)
        n = threads if threads is not None else threads_for(size - self.done)
        self._threads = [threading.Thread(target=self._work, name=f"kvtier-prefault-{i}", daemon=True)
                         for i in range(n if self.done < size else 0)]
        self._live = len(self._threads)
        for t in self._threads:
            t.start()

    @property
    def fd(self) -> int:
        return self._inbox.fd

    @property
    def finished(self) -> bool:
        return self.done >= self.size

    @property
    def running(self) -> bool:
        """A thread is still at work (its last wake-up comes after it stopped counting)."""
        with self._lock:
            return self._live > 0

    def take(self) -> int:
        """The loop was woken: the bytes faulted in so far, from the mapping's start."""
        self._inbox.take_all()
        return self.done

    def _chunk(self):
        with self._lock:
            if self._stopping or self.error or self._next >= self.size:
                return None
            off = self._next
            self._next += self.chunk
            return off, min(self.chunk, self.size - off)

    def _work(self) -> None:
        while (got := self._chunk()) is not None:
            off, n = got
            err = _advise(self._base, off, n)
            with self._lock:
                if err:
                    if not self.error:
                        self.error, self.errno = no_room(self.size, self.name, err), err
                else:
                    self._ahead[off] = n
                    while self.done in self._ahead:
                        self.done += self._ahead.pop(self.done)
                    if self.finished:
                        self.seconds = time.monotonic() - self.started
            self._inbox.put(None)
        with self._lock:
            self._live -= 1
        self._inbox.put(None)  # the loop sees ``running`` false after this one

    def join(self) -> None:
        """Wait until every chunk is in, or the threads stopped at an error."""
        for t in self._threads:
            t.join()

    def stop(self) -> None:
        """No more chunks; waits for the ones in progress (each at most ``chunk`` bytes)."""
        with self._lock:
            self._stopping = True
        for t in self._threads:
            t.join()
        self._threads = []
        self._anchor = None
        self._inbox.close()
