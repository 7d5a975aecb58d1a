"""Named POSIX shared-memory segments.

The daemon's pool is one segment; on CPU, engine workers also place their KV
tensors in segments that the daemon opens by name (the CPU twin of CUDA IPC).

Design notes (measured on the dev machine):
  * ``ftruncate`` is sparse, so an oversize pool would only fail later with
    SIGBUS; ``posix_fallocate`` reserves tmpfs pages now and fails fast.
  * mapping with MAP_POPULATE prefaults page tables so first copies run at
    full speed; a segment of ``prefault.PARALLEL_MIN`` or more (the pool) is
    faulted in by ``MADV_POPULATE_WRITE`` on several threads instead; with
    ``serve_after`` only its first part now, the rest in the background
    (``self.background``, prefault.Background) while the daemon serves.
  * the mapping's lifetime is owned here: tensors over it must be dropped
    before ``close()``; closing under a live tensor would segfault the next
    write, so ``close`` refuses (BufferError) instead.
  * crashed processes leak named segments; names embed the creator pid so a
    new daemon can unlink the ones whose creator is dead, and a random part
    (``unique_name``) so that nobody can plant a file at a name before we make
    it: pids are predictable (``ns_last_pid`` is world-readable) and /dev/shm
    is writable by every user.
  * every failure to open a name (a planted symlink gives ELOOP, shm_open
    never follows one) is a ``SegmentError``: callers decide to start cold,
    never crash on an OSError they did not expect.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets

import posix_ipc
import psutil

from ..ownership import distrust, ours
from .prefault import PARALLEL_MIN, Background, NoRoom, no_room, populate

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PID_RE = re.compile(r"\.(\d+)(?:\.|$)")


class SegmentError(RuntimeError):
    """A segment could not be created or opened."""


class ShmSegment:
    """A mapped shared-memory segment; ``create=True`` makes and reserves it.
    ``check(stat) -> why`` vets an opened segment before it is mapped ("" = fine)."""

    def __init__(self, name: str, size: int = 0, *, create: bool = False, mode: int = 0o600,
                 populate: bool = True, group: int | None = None, check=None, serve_after: int | None = None):
        """``serve_after``: a new segment of ``PARALLEL_MIN`` or more has only its first
        ``serve_after`` bytes faulted in when this returns; ``background`` faults in the rest."""
        self.name = _checked(name)
        self.owner = create
        self._mmap: mmap.mmap | None = None
        self.background: Background | None = None
        try:
            if create:
                if size <= 0:
                    raise SegmentError(f"segment size must be positive, got {size}")
                shm = posix_ipc.SharedMemory(self.name, posix_ipc.O_CREX, mode=mode, size=0)
            else:
                shm = posix_ipc.SharedMemory(self.name)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError, OSError) as exc:
            # OSError: ELOOP for a symlink at the name (shm_open opens with O_NOFOLLOW), ...
            raise SegmentError(f"shared memory {self.name}: {exc}") from None
        try:
            # A big new segment (the pool) is faulted in on several threads (prefault.py).
            parallel = create and populate and size >= PARALLEL_MIN
            if create:
                os.fchmod(shm.fd, mode)  # umask must not widen or narrow the mode
                if group is not None:  # e.g. the kvtier group, so the daemon's user can map it
                    os.fchown(shm.fd, -1, group)
                if parallel:
                    # posix_fallocate refused a size over the free space at once; populate() would
                    # first fill /dev/shm to the brim, so the same check comes first.
                    free = os.fstatvfs(shm.fd)
                    if free.f_bavail * free.f_frsize < size:
                        raise SegmentError(no_room(size, self.name, errno.ENOSPC))
                    os.ftruncate(shm.fd, size)  # sparse until populate() faults every page in
                else:
                    _reserve(shm.fd, size, self.name)
            st = os.fstat(shm.fd)
            why = check(st) if check is not None else ""
            if why:  # on the descriptor we map: no window for a swap of the name
                raise SegmentError(f"shared memory {self.name}: {why}")
            self.size = st.st_size
            if self.size == 0:
                raise SegmentError(f"shared memory {self.name} is empty")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate and not parallel else 0)
            self._mmap = mmap.mmap(shm.fd, self.size, flags=flags)
            first = serve_after if parallel and serve_after is not None and serve_after < size else None
            if parallel and not self._populate(first):  # a kernel before 5.14: the one-thread way
                self._mmap.close()
                _reserve(shm.fd, size, self.name)
                self._mmap = mmap.mmap(shm.fd, self.size, flags=flags | getattr(mmap, "MAP_POPULATE", 0))
            elif first is not None:
                self.background = Background(self._mmap, self.size, self.name, start=first)
        except BaseException:
            if self._mmap is not None:
                self._mmap.close()
                self._mmap = None
            if create:
                shm.unlink()
            raise
        finally:
            shm.close_fd()

    def _populate(self, upto: int | None = None) -> bool:
        try:
            return populate(self._mmap, self.size, self.name, upto=upto)
        except NoRoom as exc:
            raise SegmentError(str(exc.strerror)) from None

    @property
    def buffer(self) -> memoryview:
        """A view of the whole mapping. Objects built on it (torch.frombuffer,
        numpy) keep the view alive, which is what makes ``close`` refuse: torch
        handed the bare mmap keeps only the pointer, and close would unmap under it."""
        if self._mmap is None:
            raise SegmentError(f"segment {self.name} is closed")
        return memoryview(self._mmap)

    def close(self, unlink: bool | None = None) -> None:
        """Unmap (and unlink if owner). Raises BufferError while views are alive."""
        if self.background is not None:  # its threads write into the mapping: they stop first
            self.background.stop()
            self.background = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self.owner if unlink is None else unlink:
            unlink_segment(self.name)
            self.owner = False

    def release(self, unlink: bool | None = None) -> bool:
        """Like ``close`` but never refuses: while views are alive the mapping is
        left to them (unmapped when the last one dies). True if unmapped now."""
        try:
            self.close(unlink)
            return True
        except BufferError:
            self._mmap = None  # the live views keep the mmap object, and so the mapping
            self.close(unlink)
            return False

    @property
    def closed(self) -> bool:
        return self._mmap is None


def _reserve(fd: int, size: int, name: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise SegmentError(no_room(size, name, exc.errno)) from None
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            os.ftruncate(fd, size)  # filesystem without fallocate: sparse fallback
        else:
            raise


def _checked(name: str) -> str:
    # posix_ipc 1.x segfaults on a name with a NUL byte; names come from clients.
    if "\x00" in name:
        raise SegmentError(f"shared memory name {name!r} contains a NUL byte")
    return name if name.startswith("/") else "/" + name


def unique_name(prefix: str) -> str:
    """``/<prefix><pid>.<64 random bits>``: the pid for ``cleanup_stale``, the
    random part so that the name cannot be guessed (and squatted) in advance."""
    return f"/{prefix}{os.getpid()}.{secrets.token_hex(8)}"


def unlink_segment(name: str) -> bool:
    """True if removed; False if already gone or not ours to remove (/dev/shm
    is sticky: a daemon running as ``kvtier`` cannot unlink an engine's segment)."""
    try:
        posix_ipc.unlink_shared_memory(_checked(name))
        return True
    except (posix_ipc.ExistentialError, SegmentError):  # no segment can have that name
        return False
    except posix_ipc.PermissionsError as exc:  # posix_ipc's own class, not PermissionError
        log.warning("cannot remove shared memory segment %s: %s", name, exc)
        return False


def pid_of(name: str) -> int | None:
    m = _PID_RE.search(name)
    return int(m.group(1)) if m else None


def cleanup_stale(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments named ``<prefix>...<pid>...`` whose pid is no longer alive."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    owners = ours()
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = pid_of(name[len(prefix) - 1:])
        try:
            owned = not distrust(os.lstat(os.path.join(shm_dir, name)), "regular file", owners, deny=0)
        except OSError:
            continue
        if pid is not None and owned and not psutil.pid_exists(pid) and unlink_segment(name):
            log.warning("removed stale shared memory segment /%s (pid %d is gone)", name, pid)
            removed.append(name)
    return removed
