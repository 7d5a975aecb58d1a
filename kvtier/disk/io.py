"""The disk tier's I/O: worker threads that write, read and unlink block files,
a scanner that rebuilds the index from the files at start, and a deadline
clock. Results go back to the daemon's loop through a wakeup pipe; the loop
never waits on the disk.

Every verb queues and returns at once. Reads and writes have their own
threads (``schedule.IOQueues``): ``threads`` readers at the daemon's CPU
priority (a load waits for them), ``WRITERS`` writers niced by
``WRITE_NICE`` (a write-behind waits for nobody), which also unlink. The
items of one job are shared by its lane's threads, so one large load reads
with every reader. A read job not done by
its deadline is reported ``expired`` by the clock thread (the loop answers
the load without those blocks) and reported again, ``done``, when its reads
returned: only then may the pool bytes it names be reused.

Files are read with ``os.preadv`` straight into the pool (``O_DIRECT`` where
the filesystem takes it, else buffered and then dropped from the page
cache), checked against the header the index expects and the payload's checksum
(``pool/checksum.py``).
Writes go to ``tmp/`` and are renamed into place (a file evicted to make room
for a write is moved to ``tmp/`` by that write and overwritten, not unlinked
and created anew), with ``O_DIRECT`` from the
pool slot where reads use it (no page-cache copy, no writeback work for the
kernel's flusher threads on the cores the stores need); see BENCHMARKS.md
for why no fsync.

Primitives: ``DiskIO(root, pool, threads, writers=WRITERS)``, ``.write(items, size, token, evicted, ns_keys)``,
``.read(items, size, token, deadline)``, ``.unlink(paths)``, ``.scan()``,
``.remind(what)``, ``.completed() -> [(what, job)]``, ``.stalled(timeout)``, ``.wakeup_fd``,
``.counters``, ``.close()``.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import logging
import mmap
import os
import threading
import time
from collections import Counter

from ..pool import checksum
from ..pool.keys import owner_of
from ..waker import Inbox
from .files import (ALIGN, OPEN_READ, buffer_address, check_file, direct_io_works, lower_priority, quiet_unlink,
                    read_all, scan, write_all)
from .format import HEADER_BYTES, TMP_DIR, block_name, decode_header, encode_header, ns_dir
from .schedule import DiskJob, IOQueues

log = logging.getLogger("kvtier.disk")
OPEN_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
OPEN_REWRITE = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC  # an evicted file of ours, just moved to tmp/
ERRNO_COUNTER = {errno.ENOSPC: "enospc", errno.EDQUOT: "enospc", errno.EIO: "eio", errno.EROFS: "eio"}
WRITERS = 2       # write threads: niced, they take the cores the foreground leaves (docs/DISK_TIER.md)
WRITE_NICE = 10   # their nice above the daemon's: CFS weight 110 vs 1024, about a tenth of a busy core each
MAX_TENANT_ERRORS = 256  # (tenant, counter) messages kept: a tenant per uid at most, a few counters each


class DiskIO:
    def __init__(self, root: str, pool, threads: int, fsync: bool = False, direct: bool | None = None,
                 writers: int = WRITERS, pool_name: str | None = None, on_note=None, writer_argv=None):
        """``pool_name``: the pool's shared memory, which a writer process maps (writer_link.py);
        None: the writes run on this process's threads. ``on_note``: errors go there instead of the
        log and the counters' messages (the writer process hands them to the daemon)."""
        self.root, self.fsync = root, fsync
        self._on_note = on_note
        self.pool = memoryview(pool).cast("B")
        self.base = buffer_address(self.pool)
        # Reads by O_DIRECT (DMA into the pool, no page cache) where the filesystem takes it
        # and the slot is aligned; buffered otherwise. BENCHMARKS.md, disk tier, has why.
        self.direct = direct_io_works(os.path.join(root, TMP_DIR)) if direct is None else direct
        self._local = threading.local()
        self.uid = os.geteuid()
        self.lock = threading.Lock()
        self.counters: Counter = Counter()   # guarded by the lock
        self.errors: dict[str, str] = {}     # counter -> last message (guarded by the lock)
        # (tenant, counter) -> that tenant's last message: a message names a file, which names a
        # tenant's namespace and block hash, so a tenant is shown its own only (guarded by the lock)
        self.tenant_errors: dict[tuple[str, str], str] = {}
        self._cv = threading.Condition(self.lock)  # the clock's
        write = threading.Condition(self.lock)  # the urgent writer waits with the others
        self._lanes = {"read": threading.Condition(self.lock), "write": write, "urgent": write}
        self._queues = IOQueues()            # guarded by the lock
        self._running: set = set()           # read jobs with an item being read
        self._done = Inbox()
        self._closing = False
        self._seq = itertools.count(time.time_ns())
        self.tmp_prefix = f"{os.getpid()}-{time.time_ns():x}-"  # what this process's files in tmp/ start with
        self._dirs: set[str] = set()
        self._unlinking: Counter = Counter()  # directory -> its files queued to be unlinked (the lock's)
        self._rmdir_wanted: set[str] = set()  # directories to remove when their count reaches 0 (the lock's)
        self._heap: list = []                # (deadline, n, job): the clock's
        self._threads = [threading.Thread(target=self._serve, args=(lane,), name=f"kvtier-disk-{lane}-{i}",
                                          daemon=True)
                         for lane, n in (("read", threads), ("write", writers), ("urgent", 1)) for i in range(n)]
        self._threads.append(threading.Thread(target=self._clock, name="kvtier-disk-clock", daemon=True))
        for t in self._threads:
            t.start()
        self._writer = None                  # the writer process, when writes run there
        self._writer_counters: dict = {}     # its counters, as it last said (the lock's)
        self.writer_lost = ""                # why writes run on these threads
        if pool_name:  # started beside the daemon's own start: writes run here until it is ready
            self.writer_lost = "the writer process is starting"
            threading.Thread(target=self._start_writer, args=(pool_name, writer_argv),
                             name="kvtier-disk-writer-start", daemon=True).start()

    # ---- loop-thread API -----------------------------------------------------------------
    @property
    def wakeup_fd(self) -> int:
        return self._done.fd

    def next_seqs(self, n: int) -> list[int]:
        """File sequence numbers for ``n`` new files (time-based: a later daemon's are newer)."""
        return list(itertools.islice(self._seq, n))

    def path_of(self, ns_key: str, key: bytes, seq: int) -> str:
        return os.path.join(self.root, ns_dir(ns_key), block_name(key, seq))

    def write(self, items: list, size: int, token, evicted: list[str] = (), ns_keys: list[str] = ()) -> DiskJob:
        """Write ``items``. ``evicted``: files of ``size``-byte blocks evicted to make room for
        them: the write of item ``i`` moves ``evicted[i]`` out of its namespace's directory into
        ``tmp/`` and overwrites it, which saves the write a create and the eviction an unlink
        (BENCHMARKS.md 13.10); those beyond the items are unlinked. ``ns_keys``: directories to
        remove once emptied, as for ``unlink``."""
        reused, extra = list(evicted[:len(items)]), list(evicted[len(items):])
        self.unlink(extra, ns_keys)
        self._leaving(reused, ns_keys)
        job = DiskJob("write", token, items, size, evicted=reused)
        if self._writer is not None and self._writer.submit(job):
            return job
        return self._queue(job)

    # ---- the writer process (writer_link.py) ---------------------------------------------------
    def _start_writer(self, pool_name: str, argv) -> None:
        from .writer_link import WriterError, WriterProcess
        w = WriterProcess(self.root, pool_name, self.direct, self.fsync, self._writer_done, self._writer_lost,
                          self._note, argv)
        try:
            w.start()
        except WriterError as exc:
            self.writer_lost = str(exc)
            log.error("%s; the daemon's threads write the disk tier's blocks", exc)
            return
        with self.lock:
            closing = self._closing
            if not closing:
                self._writer, self.writer_lost = w, ""
        if closing:  # the tier closed while it started
            w.close()
        else:
            log.info("disk tier: writer process %d ready; block files are written there", w.pid)

    def _writer_done(self, job: DiskJob, ok: list, failed: list, counters: dict) -> None:
        """The writer process answered ``job`` (its reader thread): as if these threads had written it."""
        items = job.items
        with self.lock:
            self._writer_counters = counters
            job.ok = [(i, crc, self.path_of(items[i][0], items[i][1], items[i][2])) for i, crc in ok]
            job.failed = failed
            job.next = job.finished = len(items)
            # the evicted files it overwrote have left their directories: those wanted gone may go
            emptied = [d for d in (self._unlinked_in(os.path.dirname(p)) for p in job.evicted) if d]
        for d in emptied:
            self._remove_dir(d)
        self._done.put(("done", job))

    def _writer_lost(self, reason: str, jobs: list) -> None:
        """The writer process ended: what it had not answered is written here, from the pool (pinned
        still), after its half-written files in tmp/ are gone."""
        prefix = self._writer.tmp_prefix
        with self.lock:
            self.counters.update(self._writer_counters)
            self._writer_counters = {}
            self.writer_lost = reason
        tmp = os.path.join(self.root, TMP_DIR)
        try:
            names = [n for n in os.listdir(tmp) if prefix and n.startswith(prefix)]
        except OSError:
            names = []
        for n in names:
            quiet_unlink(os.path.join(tmp, n))
        for job in jobs:
            job.ok, job.failed, job.next, job.finished = [], [], 0, 0
            self._queue(job)

    def read(self, items: list, size: int, token, deadline: float) -> DiskJob:
        job = self._queue(DiskJob("read", token, items, size, deadline))
        with self._cv:
            heapq.heappush(self._heap, (deadline, id(job), job))
            self._cv.notify_all()  # the clock sleeps while no read is pending
        return job

    def unlink(self, paths: list[str], ns_keys: list[str] = ()) -> None:
        """Delete ``paths``; then the directories of ``ns_keys``, once no file queued to be
        unlinked in them is left, from this job or an earlier one (a flush's slices are jobs
        of their own, and the writers finish them in any order)."""
        if paths:
            self._leaving(paths, ns_keys)
            self._queue(DiskJob("unlink", None, list(paths)))

    def _leaving(self, paths: list[str], ns_keys) -> None:
        """``paths`` will leave their directories: those of ``ns_keys`` go when the last has."""
        with self.lock:
            for p in paths:
                self._unlinking[os.path.dirname(p)] += 1
            self._rmdir_wanted.update(d for d in (os.path.join(self.root, ns_dir(k)) for k in ns_keys)
                                      if self._unlinking[d])

    @property
    def urgent(self) -> bool:
        return self._queues.urgent

    def hurry(self, urgent: bool) -> None:
        """The write backlog is filling (or no longer): one more writer, at the daemon's priority."""
        if urgent != self._queues.urgent:
            if self._writer is not None:
                self._writer.hurry(urgent)
            with self.lock:
                self._queues.urgent = urgent
                self._lanes["urgent"].notify_all()

    def scan(self) -> None:
        """Rebuild from the files (its own thread): batches of entries come back as ("scan", [..]),
        then ("scanned", None)."""
        threading.Thread(target=self._scan, name="kvtier-disk-scan", daemon=True).start()

    def remind(self, what: str) -> None:
        """Have ``completed()`` hand back ``(what, None)`` on the loop's next turn."""
        self._done.put((what, None))

    def completed(self) -> list:
        return self._done.take_all()

    def stalled(self, timeout: float) -> bool:
        """A read has waited on the disk for over ``timeout``: new loads should not queue behind it."""
        now = time.monotonic()
        with self.lock:
            return any(j.expired or now - j.started > timeout for j in self._running) or bool(
                self._queues.reads and self._queues.reads[0].deadline < now)

    def snapshot(self, tenant: str | None = None) -> tuple[dict, dict]:
        """Counters and the last error message per counter: every one (None: the operator),
        or only those about ``tenant``'s own files."""
        with self.lock:
            counters = self.counters + Counter(self._writer_counters)
            if tenant is None:
                return dict(counters), dict(self.errors)
            return dict(counters), {c: msg for (t, c), msg in self.tenant_errors.items() if t == tenant}

    def writer_state(self) -> dict:
        """Where the writes run: {"process": pid} or {"process": None, "why": reason}."""
        if self._writer is not None and not self._writer.lost:
            return {"process": self._writer.pid}
        return {"process": None, "why": self.writer_lost or "disk_writer = \"threads\""}

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        with self._cv:
            self._closing = True
            for cv in (self._cv, *set(self._lanes.values())):
                cv.notify_all()
        end = time.monotonic() + 5  # a thread stuck in a hung read is left behind (the pool stays mapped)
        for t in self._threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        self._done.close()
        if not any(t.is_alive() for t in self._threads):
            self.pool.release()  # the pool's owner may unmap it now

    # ---- workers -----------------------------------------------------------------------------
    def _queue(self, job: DiskJob) -> DiskJob:
        if not job.items:
            self._done.put(("done", job))
            return job
        lane = "read" if job.kind == "read" else "write"
        with self.lock:
            self._queues.push(job)
            self._lanes[lane].notify_all()
        return job

    def _take(self, lane: str):
        """The next (job, item index) of ``lane`` (``IOQueues``). None when closing."""
        cv = self._lanes[lane]
        with cv:
            while True:
                if self._closing:
                    return None
                got = self._queues.take(lane)
                if got is not None:
                    job = got[0]
                    if job.kind == "read" and not job.started:
                        job.started = time.monotonic()
                        self._running.add(job)
                    return got
                cv.wait()

    def _serve(self, lane: str) -> None:
        if lane == "write":
            lower_priority(WRITE_NICE)
        run = {"write": self._write_one, "read": self._read_one, "unlink": self._unlink_one}
        while True:
            got = self._take(lane)
            if got is None:
                return
            job, i = got
            tally: Counter = Counter()
            try:
                run[job.kind](job, i, tally)
            except Exception as exc:  # a bug here must not lose the caller's job
                log.exception("disk %s failed", job.kind)
                tally["errors"] += 1
                if job.kind != "unlink":
                    job.failed.append(i)
                self._note("errors", f"{type(exc).__name__}: {exc}")
            emptied = None
            with self.lock:
                self.counters.update(tally)
                job.finished += 1
                last = job.finished == len(job.items)
                if last:
                    self._running.discard(job)
                if job.kind == "unlink":
                    emptied = self._unlinked_in(os.path.dirname(job.items[i]))
            if last and job.kind != "unlink":
                self._done.put(("done", job))
            elif emptied:
                self._remove_dir(emptied)

    def _note(self, counter: str, message: str, ns_key: str = "") -> None:
        if self._on_note is not None:
            self._on_note(counter, message, ns_key)
            return
        with self.lock:
            first = counter not in self.errors
            self.errors[counter] = message
            if ns_key:  # about a tenant's file: that tenant may see it
                mine = (owner_of(ns_key), counter)
                self.tenant_errors.pop(mine, None)  # re-inserted last: the oldest go first
                self.tenant_errors[mine] = message
                if len(self.tenant_errors) > MAX_TENANT_ERRORS:
                    del self.tenant_errors[next(iter(self.tenant_errors))]
        if first:  # once per kind: a full disk fails every write, the log says it once
            log.error("disk tier %s: %s", counter, message)

    def _os_error(self, tally: Counter, what: str, exc: OSError, ns_key: str) -> None:
        name = ERRNO_COUNTER.get(exc.errno, "errors")
        tally[name] += 1
        self._note(name, f"{what}: {exc}", ns_key)

    def _write_one(self, job: DiskJob, i: int, tally: Counter) -> None:
        ns_key, key, seq, off = job.items[i]
        tmp = os.path.join(self.root, TMP_DIR, f"{self.tmp_prefix}{seq:x}.tmp")
        final = self.path_of(ns_key, key, seq)
        payload = None
        try:
            taken = i < len(job.evicted) and self._take_evicted(job.evicted[i], tmp)
            payload = self.pool[off:off + job.size]
            crc = checksum.of(payload)
            # O_DIRECT: the device reads the slot itself (pinned until this returns), the header from
            # an aligned page; no page-cache copy and no writeback for the kernel to do afterwards.
            direct = self.direct and (self.base + off) % ALIGN == 0 and job.size % ALIGN == 0
            header = encode_header(ns_key, key, seq, job.size, crc)
            if direct:
                page = self._page()
                page[:] = header
                header = memoryview(page)
            fd, recycled = self._open_tmp(tmp, taken, os.O_DIRECT if direct else 0)
            try:
                write_all(fd, [header, payload])
                if recycled and os.fstat(fd).st_size != HEADER_BYTES + job.size:  # a file of another size
                    os.ftruncate(fd, HEADER_BYTES + job.size)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            directory = os.path.dirname(final)
            if directory not in self._dirs:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                self._dirs.add(directory)
            for attempt in range(3):
                try:
                    os.rename(tmp, final)
                    break
                except FileNotFoundError:  # its directory was removed (emptied, or behind our back): again
                    if attempt == 2:
                        raise
                    os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            job.failed.append(i)
            self._os_error(tally, f"writing {final}", exc, ns_key)
            quiet_unlink(tmp)
            return
        except BaseException:  # a bug: the caller counts the error; nothing is left in tmp/
            quiet_unlink(tmp)
            raise
        finally:
            if payload is not None:
                payload.release()
        job.ok.append((i, crc, final))
        tally.update(written=1, written_bytes=job.size, written_direct=direct, recycled=recycled)

    def _open_tmp(self, tmp: str, taken: bool, direct: int) -> tuple[int, bool]:
        """The descriptor to write ``tmp`` through, and whether it overwrites a taken file. A taken
        file is overwritten only if it is still what the tier wrote: a regular file of ours, no
        other permission bits, one link (a FIFO planted there would block the open, a hard link
        kept elsewhere would see the new bytes); otherwise it goes and a new file is made."""
        if taken:
            try:
                fd = os.open(tmp, OPEN_REWRITE | os.O_NONBLOCK | direct)
            except OSError:
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if not check_file(st, self.uid) and st.st_nlink == 1:
                    # a write must wait for the disk, not fail with EAGAIN (an O_DIRECT write
                    # on a descriptor left non-blocking may, on some kernels and filesystems)
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
                    return fd, True
                os.close(fd)
            log.warning("disk file %s taken over for a write is not as written; deleted, a new one made", tmp)
            quiet_unlink(tmp)
        return os.open(tmp, OPEN_WRITE | direct, 0o600), False

    def _take_evicted(self, path: str, tmp: str) -> bool:
        """Move an evicted file to ``tmp`` for a write to overwrite (no reader finds it by name
        from here on; a crash leaves it in tmp/, which the next start empties). False when it
        is gone (a load found it corrupt and deleted it): the write creates its file."""
        try:
            os.rename(path, tmp)
            moved = True
        except OSError:
            moved = False
        with self.lock:
            emptied = self._unlinked_in(os.path.dirname(path))
        if emptied:
            self._remove_dir(emptied)
        return moved

    def _page(self) -> mmap.mmap:
        """This thread's page-aligned header buffer (O_DIRECT needs aligned memory)."""
        header = getattr(self._local, "header", None)
        if header is None:
            header = self._local.header = mmap.mmap(-1, HEADER_BYTES)
        return header

    def _read_one(self, job: DiskJob, i: int, tally: Counter) -> None:
        entry, off = job.items[i]
        if job.expired or self._closing:  # queued behind a slow disk: the load was answered without it
            job.failed.append(i)
            tally["read_late"] += 1
            return
        direct = self.direct and (self.base + off) % ALIGN == 0 and job.size % ALIGN == 0
        try:
            fd = os.open(entry.path, OPEN_READ)
        except OSError as exc:
            job.failed.append(i)
            job.bad.append(i)  # gone or unreadable: the index must forget it
            tally["missing" if exc.errno == errno.ENOENT else "read_errors"] += 1
            if exc.errno != errno.ENOENT:
                self._os_error(tally, f"opening {entry.path}", exc, entry.ns_key)
            return
        try:
            why = check_file(os.fstat(fd), self.uid, job.size)
            if not why and direct:  # only now: a FIFO or device would refuse O_DIRECT at open
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            why = why or self._read_verified(fd, entry, off, job.size)
            if not why and not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the pool has it now
        except OSError as exc:
            job.failed.append(i)
            job.bad.append(i)
            self._os_error(tally, f"reading {entry.path}", exc, entry.ns_key)
            tally["read_errors"] += 1
            return
        finally:
            os.close(fd)
        if why:
            job.failed.append(i)
            job.bad.append(i)
            if not os.path.lexists(entry.path):  # evicted and taken over by a write meanwhile: no fault
                tally["missing"] += 1
                return
            tally["rejected"] += 1
            log.error("disk block %s rejected and deleted: %s", entry.path, why)
            return
        job.ok.append((i, entry.crc))
        tally.update(read=1, read_bytes=job.size, read_direct=direct)

    def _read_verified(self, fd: int, entry, off: int, size: int) -> str:
        """Header and payload in one read (the payload straight into the pool slot;
        with O_DIRECT by DMA, no page cache), then both checked: why not, or ""."""
        header = self._page()
        dest = self.pool[off:off + size]
        try:
            n = read_all(fd, [memoryview(header), dest], 0)
            if n != HEADER_BYTES + size:
                return f"read {n} bytes, expected {HEADER_BYTES + size}"
            h = decode_header(header)
            if isinstance(h, str):
                return h
            if (h.ns_key, h.key, h.seq, h.size, h.crc) != (entry.ns_key, entry.key, entry.seq, size, entry.crc):
                return "header names another block"
            if not checksum.matches(dest, entry.crc):
                return "payload checksum mismatch"
            return ""
        finally:
            dest.release()

    def _unlinked_in(self, d: str) -> str | None:
        """One file queued in ``d`` is gone (under the lock): ``d`` when it was the last one
        there and ``d`` is wanted gone."""
        left = self._unlinking[d] - 1
        if left:
            self._unlinking[d] = left
            return None
        del self._unlinking[d]
        if d in self._rmdir_wanted:
            self._rmdir_wanted.discard(d)
            return d
        return None

    def _remove_dir(self, d: str) -> None:
        """A namespace directory emptied (ENOTEMPTY: a write landed meanwhile; keep it)."""
        self._dirs.discard(d)  # a later write of this namespace makes it again
        try:
            os.rmdir(d)
        except OSError:
            pass

    def _unlink_one(self, job: DiskJob, i: int, tally: Counter) -> None:
        if quiet_unlink(job.items[i]):
            tally["unlinked"] += 1

    def _clock(self) -> None:
        """Reports read jobs not done by their deadline as "expired" (once)."""
        while True:
            with self._cv:
                if self._closing:
                    return
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][2].finished >= len(
                        self._heap[0][2].items)):
                    job = heapq.heappop(self._heap)[2]
                    if job.finished < len(job.items) and not job.expired:
                        job.expired = True
                        self.counters["read_expired"] += 1
                        self._done.put(("expired", job))
                self._cv.wait(min(0.05, self._heap[0][0] - now) if self._heap else None)

    def _scan(self) -> None:
        tally: Counter = Counter()
        try:
            tally = scan(self.root, self.uid, self.tmp_prefix, self._done.put)
        except Exception:  # a bug: what was found stays found, the rest is not served
            log.exception("disk scan failed")
        finally:
            with self.lock:
                self.counters.update(tally)
            self._done.put(("scanned", None))

