# Part of scripts/bench_disk.py (BENCHMARKS.md section 13): its baselines.
"""Plain file I/O that ``bench_disk.py`` measures the disk tier's loads against, in the
same run: cold caches, ``dd``-style ``O_DIRECT`` reads of one file (one stream or
fio-style several), the block files read front to back by one thread, the block
files read the ways the tier could (buffered ``preadv`` straight into the pool,
``O_DIRECT`` into a bounce buffer, ``O_DIRECT`` into the pool), and block file
writes with and without ``fsync``: each returns the seconds it took."""

from __future__ import annotations

import mmap
import os
import threading
import time

DROP = {"caches": True}  # --cache fadvise: leave the machine's page cache alone (CI, shared machines)


def drop_cache(files: list[str]) -> str:
    os.sync()
    try:
        if not DROP["caches"]:
            raise PermissionError
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def direct_read(path: str, size: int, streams: int = 1) -> float:
    """``dd iflag=direct bs=1M`` (one stream), or fio-style ``streams`` threads each
    reading its own part: the device at queue depth ``streams``."""
    part = size // streams // 2**20 * 2**20

    def read(start: int, end: int) -> None:
        buf = mmap.mmap(-1, 2**20)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        off = start
        while off < end:
            n = os.preadv(fd, [buf], off)
            if n <= 0:
                break
            off += n
        os.close(fd)
    ts = [threading.Thread(target=read, args=(i * part, size if i == streams - 1 else (i + 1) * part))
          for i in range(streams)]
    return timed_threads(ts)


def timed_threads(ts: list[threading.Thread]) -> float:
    """Seconds from starting these threads to the last one finishing."""
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def files_read(files: list[str], block: int) -> float:
    buf = bytearray(block + 4096)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
    return time.perf_counter() - t0


# ---- the I/O method ---------------------------------------------------------------------------
def read_files(files: list[str], block: int, threads: int, how: str, pool: mmap.mmap) -> float:
    """``how``: "buffered" (preadv into the pool), "bounce" (O_DIRECT into a buffer, then a copy),
    "direct" (O_DIRECT into the pool: what the tier does where the filesystem allows).
    ``pool``: page-aligned and prefaulted, as the daemon's."""
    view = memoryview(pool)
    it = iter(enumerate(files))
    lock = threading.Lock()

    def work():
        bounce = mmap.mmap(-1, block + 4096)
        header = memoryview(bounce)[:4096]
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            i, path = item
            fd = os.open(path, os.O_RDONLY | (0 if how == "buffered" else os.O_DIRECT))
            dest = view[i * block:(i + 1) * block]
            if how == "bounce":  # the header page and the payload in one aligned read, then copied
                os.preadv(fd, [bounce], 0)
                dest[:] = memoryview(bounce)[4096:4096 + block]
            else:  # header and payload in one call, the payload straight into the pool
                os.preadv(fd, [header, dest], 0)
            if how == "buffered":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            dest.release()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    return timed_threads(ts)


def write_files(root: str, block: int, n: int, fsync: bool) -> float:
    payload = os.urandom(block + 4096)
    os.makedirs(root, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        tmp, final = os.path.join(root, f"{i}.tmp"), os.path.join(root, f"{i}.kvb")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(fd, payload, 0)
        if fsync:
            os.fsync(fd)
        os.close(fd)
        os.rename(tmp, final)
    os.sync()  # what was not fsynced is written now: counted, or the comparison would be unfair
    return time.perf_counter() - t0
