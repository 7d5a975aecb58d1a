"""Block files on the disk: the checks and syscalls the I/O threads and the
start-up scan share (no state).

Primitives: ``check_file(st, uid, size)``, ``write_all(fd, bufs)``,
``read_all(fd, bufs, offset)``, ``direct_io_works(dir)``, ``buffer_address(buf)``,
``quiet_unlink(path)``, ``lower_priority(delta)``, ``scan(root, uid, keep_prefix, put)``.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import Counter

from ..ownership import GROUP_OTHERS_ANY, distrust
from .format import HEADER_BYTES, TMP_DIR, decode_header, ns_dir, parse_name

log = logging.getLogger("kvtier.disk")
ALIGN = 4096  # O_DIRECT: buffer address, file offset and length in multiples of this
SCAN_BATCH = 1024  # files per hand-over to the loop: a few ms of index inserts there
OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_file(st: os.stat_result, uid: int, size: int | None = None) -> str:
    """Why a block file may not be read ("" = it may): another user's file, one
    others could have written, a non-regular file, or one of the wrong size."""
    return distrust(st, "regular file", (uid,), deny=GROUP_OTHERS_ANY,
                    size=None if size is None else HEADER_BYTES + size)



def _advance(views: list, n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers (a short pwritev/preadv)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if views and n:
        views[0] = memoryview(views[0])[n:]


def write_all(fd: int, bufs: list) -> None:
    views = [memoryview(b) for b in bufs]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        _advance(views, n)


def read_all(fd: int, bufs: list, offset: int) -> int:
    """Read into ``bufs`` from ``offset`` until full or end of file; bytes read."""
    views, got = list(bufs), 0
    while views:
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        _advance(views, n)
    return got


def direct_io_works(directory: str) -> bool:
    """Whether this filesystem takes O_DIRECT (tmpfs before Linux 6.6 does not: EINVAL)."""
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        return os.pwritev(fd, [buf], 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
    except OSError:
        return False
    finally:
        os.close(fd)
        quiet_unlink(probe)


def buffer_address(buf) -> int:
    import numpy as np
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)  # the array (and its export) dies here


def lower_priority(delta: int) -> None:
    """Nice the calling thread by ``delta`` (Linux keeps a nice per thread). Lowering a priority
    needs no privilege; where it fails anyway the thread runs at the daemon's."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + delta))
    except OSError as exc:
        log.warning("disk write threads run at the daemon's priority: %s", exc)


def quiet_unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False



# ---- the start-up scan (its own thread) ------------------------------------------------------
def scan(root: str, uid: int, keep_prefix: str, put) -> Counter:
    """Index every block file under ``root``: ``put(("scan", [DiskEntry, ...]))`` in batches.
    Deletes what may not be served: torn writes of earlier daemons in tmp/, and files that
    are not ours (name, header, owner, mode, size). Returns the counters."""
    tally: Counter = Counter()
    tmp = os.path.join(root, TMP_DIR)
    for name in os.listdir(tmp):
        if not name.startswith(keep_prefix):  # an earlier daemon's torn write
            quiet_unlink(os.path.join(tmp, name))
    batch = []
    for entry in _scan_files(root, uid, tally):
        batch.append(entry)
        if len(batch) >= SCAN_BATCH:
            put(("scan", batch))
            batch = []
    put(("scan", batch))
    return tally


def _scan_files(root: str, uid: int, tally: Counter):
    from .index import DiskEntry
    for d in sorted(os.listdir(root)):
        path = os.path.join(root, d)
        if d == TMP_DIR or len(d) != 24 or not os.path.isdir(path) or os.path.islink(path):
            continue
        kept = 0
        for name in os.listdir(path):
            file = os.path.join(path, name)
            why, h = _vet(d, name, file, uid)
            if why:
                tally["scan_rejected"] += 1
                log.warning("disk file %s deleted: %s", file, why)
                quiet_unlink(file)
                continue
            tally["scanned"] += 1
            kept += 1
            yield DiskEntry(h.ns_key, h.key, h.seq, h.size, h.crc, file)
        if not kept:  # an empty namespace directory (an earlier daemon's): it goes
            try:
                os.rmdir(path)
            except OSError:  # a write of this daemon landed in it meanwhile
                pass


def _vet(d: str, name: str, file: str, uid: int):
    parsed = parse_name(name)
    if parsed is None:
        return "not a block file name", None
    try:
        fd = os.open(file, OPEN_READ | os.O_NONBLOCK)  # a FIFO planted here must not hang the scan
    except OSError as exc:
        return str(exc), None
    try:
        st = os.fstat(fd)
        why = check_file(st, uid)
        if why:
            return why, None
        h = decode_header(os.pread(fd, HEADER_BYTES, 0))
    except OSError as exc:
        return str(exc), None
    finally:
        os.close(fd)
    if isinstance(h, str):
        return h, None
    if (h.key, h.seq) != parsed or ns_dir(h.ns_key) != d:
        return "header does not match its name", None
    if st.st_size != HEADER_BYTES + h.size:
        return f"{st.st_size} bytes, header says {HEADER_BYTES + h.size}", None
    return "", h
