#!/usr/bin/env python
# Feeds BENCHMARKS.md sections 13.8 and 13.10 (what a disk writer's and reader's CPU per block is made of).
"""Where a disk writer's and reader's CPU goes, system call by system call, per block.

    python scripts/bench_disk_writes.py [--blocks 400] [--rounds 3] [--block-bytes 256KiB]
                                        [--dir /var/tmp] [--json F]

The disk tier writes each block as a file of its own (``kvtier/disk/io.py``):
open a file under ``tmp/`` (``O_DIRECT`` where the filesystem takes it), one
``pwritev`` of the header page and the payload straight from the pool, close,
rename into its namespace's directory; and, once the disk is full, each new
file cost an old one's ``unlink`` (until 90f9186; since then the write moves the
file evicted for it to ``tmp/`` and overwrites it: the second row, its "unlink"
column that rename). Under a store flood the writers' CPU is
what the stores compete with (BENCHMARKS.md 13.6). This times, on the calling
thread (``time.thread_time``: the CPU the kernel charges the writer, system
time included), each step of that path over ``--blocks`` blocks of a
page-aligned anonymous buffer (a stand-in for the pool), against the same
bytes written by ``pwritev`` at offsets of one file opened once (a
log-structured layout's write: no open, close, rename or unlink per block),
with and without ``O_DIRECT``. Then ``--blocks`` reads of what is on disk (the
last 64 blocks, in turn), as the tier reads a file (open, fstat, ``O_DIRECT``
set by fcntl, one ``preadv`` of header and payload, close) and as one open file
is read at offsets; buffered reads come from the page cache. Variants run in
turn within each round; the files are removed after each variant. The
checksum is left out (13.7 times it).

Output: a markdown table (CPU us per block per step, median over rounds) and
the load average.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time

from kvtier.disk.files import direct_io_works
from kvtier.pool.sizes import format_size, parse_size

HEADER = 4096
STEPS = ("open", "write", "close", "rename", "unlink")
READ_STEPS = ("open", "read", "close")
KEEP = 64  # blocks left on disk for the reads


def tier_dirs(root: str) -> tuple[str, str, memoryview]:
    """The tier's tmp/ and a namespace directory under ``root``, and an aligned header page."""
    tmp, final = os.path.join(root, "tmp"), os.path.join(root, "ns")
    os.makedirs(tmp), os.makedirs(final)
    return tmp, final, memoryview(mmap.mmap(-1, HEADER))


def per_file(root: str, buf: mmap.mmap, blocks: int, direct: bool) -> dict:
    """The tier's path: a file per block, renamed into place, and one unlinked per block written."""
    tmp, final, header = tier_dirs(root)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    cpu = dict.fromkeys(STEPS, 0.0)
    block = len(buf) // KEEP  # the buffer holds KEEP blocks
    names = []
    w0 = time.perf_counter()
    for i in range(blocks):
        payload = memoryview(buf)[(i % KEEP) * block:(i % KEEP + 1) * block]
        t = os.path.join(tmp, f"{i:x}.tmp")
        f = os.path.join(final, f"{i:032x}.kvb")
        c0 = time.thread_time()
        fd = os.open(t, flags, 0o600)
        c1 = time.thread_time()
        os.pwritev(fd, [header, payload], 0)
        c2 = time.thread_time()
        os.close(fd)
        c3 = time.thread_time()
        os.rename(t, f)
        c4 = time.thread_time()
        names.append(f)
        if len(names) > KEEP:  # a full disk: each new file costs an old one
            os.unlink(names.pop(0))
        c5 = time.thread_time()
        for step, a, b in zip(STEPS, (c0, c1, c2, c3, c4), (c1, c2, c3, c4, c5)):
            cpu[step] += b - a
        payload.release()
    cpu["wall"] = time.perf_counter() - w0
    cpu.update(reads(names, buf, blocks, direct))
    return cpu


def recycled(root: str, buf: mmap.mmap, blocks: int, direct: bool) -> dict:
    """The tier's path since 90f9186: once the disk is full, the file evicted for a block is
    moved to tmp/ ("unlink" column: that rename), opened and checked ("open": open, fstat, two
    fcntl), overwritten (no create) and renamed into place."""
    tmp, final, header = tier_dirs(root)
    direct_flag = os.O_DIRECT if direct else 0
    create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | direct_flag
    rewrite = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | direct_flag
    cpu = dict.fromkeys(STEPS, 0.0)
    block = len(buf) // KEEP
    names = []
    w0 = time.perf_counter()
    for i in range(blocks):
        payload = memoryview(buf)[(i % KEEP) * block:(i % KEEP + 1) * block]
        t = os.path.join(tmp, f"{i:x}.tmp")
        f = os.path.join(final, f"{i:032x}.kvb")
        c0 = time.thread_time()
        full = len(names) >= KEEP
        if full:
            os.rename(names.pop(0), t)
        c1 = time.thread_time()
        fd = os.open(t, (rewrite | os.O_NONBLOCK) if full else create, 0o600)
        if full:  # the tier's checks of a taken file: fstat, then blocking again
            os.fstat(fd)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        c2 = time.thread_time()
        os.pwritev(fd, [header, payload], 0)
        c3 = time.thread_time()
        os.close(fd)
        c4 = time.thread_time()
        os.rename(t, f)
        c5 = time.thread_time()
        names.append(f)
        for step, a, b in zip(("unlink", "open", "write", "close", "rename"), (c0, c1, c2, c3, c4),
                              (c1, c2, c3, c4, c5)):
            cpu[step] += b - a
        payload.release()
    cpu["wall"] = time.perf_counter() - w0
    cpu.update(reads(names, buf, blocks, direct))
    return cpu


def reads(names: list[str], buf: mmap.mmap, blocks: int, direct: bool) -> dict:
    """The tier's read of a block file into a pool slot, ``blocks`` times over ``names``."""
    block = len(buf) // KEEP
    header = memoryview(mmap.mmap(-1, HEADER))
    cpu = {f"read {s}": 0.0 for s in READ_STEPS}
    for i in range(blocks):
        payload = memoryview(buf)[:block]
        c0 = time.thread_time()
        fd = os.open(names[i % len(names)], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.fstat(fd)
        if direct:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        c1 = time.thread_time()
        os.preadv(fd, [header, payload], 0)
        c2 = time.thread_time()
        os.close(fd)
        c3 = time.thread_time()
        for step, a, b in zip(READ_STEPS, (c0, c1, c2), (c1, c2, c3)):
            cpu[f"read {step}"] += b - a
        payload.release()
    return cpu


def one_file(root: str, buf: mmap.mmap, blocks: int, direct: bool) -> dict:
    """The same bytes by pwritev at offsets of one file opened once (slots reused past 64)."""
    header = memoryview(mmap.mmap(-1, HEADER))
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    cpu = dict.fromkeys(STEPS, 0.0)
    block = len(buf) // KEEP  # the buffer holds KEEP blocks
    w0 = time.perf_counter()
    c0 = time.thread_time()
    fd = os.open(os.path.join(root, "log"), flags, 0o600)
    cpu["open"] += time.thread_time() - c0
    try:
        for i in range(blocks):
            payload = memoryview(buf)[(i % KEEP) * block:(i % KEEP + 1) * block]
            c1 = time.thread_time()
            os.pwritev(fd, [header, payload], (i % (KEEP + 1)) * (HEADER + block))
            cpu["write"] += time.thread_time() - c1
            payload.release()
        cpu["wall"] = time.perf_counter() - w0
        cpu.update({f"read {s}": 0.0 for s in READ_STEPS})
        for i in range(blocks):
            payload = memoryview(buf)[:block]
            c1 = time.thread_time()
            os.preadv(fd, [header, payload], (i % KEEP) * (HEADER + block))
            cpu["read read"] += time.thread_time() - c1
            payload.release()
    finally:
        c2 = time.thread_time()
        os.close(fd)
        cpu["close"] += time.thread_time() - c2
    return cpu


VARIANTS = {
    "file per block, O_DIRECT, evicted file unlinked (the tier before 90f9186)": (per_file, True),
    "file per block, O_DIRECT, evicted file overwritten (the tier)": (recycled, True),
    "file per block, buffered": (per_file, False),
    "one file, O_DIRECT at offsets": (one_file, True),
    "one file, buffered at offsets": (one_file, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-bytes", default="256KiB", help="a multiple of 4 KiB")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.blocks < 1 or args.rounds < 1:
        ap.error("--blocks and --rounds must be at least 1")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir} is not a directory")
    try:
        block = parse_size(args.block_bytes)
    except ValueError as exc:
        ap.error(f"--block-bytes: {exc}")
    if block < HEADER or block % HEADER:
        ap.error("--block-bytes must be a multiple of 4 KiB")
    buf = mmap.mmap(-1, KEEP * block)  # the pool's stand-in: the functions take the block size from it
    buf.write(os.urandom(len(buf)))
    load0 = os.getloadavg()
    direct_ok = direct_io_works(args.dir)  # tmpfs before Linux 6.6 refuses O_DIRECT: those rows left out
    variants = {name: v for name, v in VARIANTS.items() if direct_ok or not v[1]}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (fn, direct) in variants.items():
            root = tempfile.mkdtemp(prefix="kvtier-bench-writes-", dir=args.dir)
            try:
                cpu = fn(root, buf, args.blocks, direct)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs[name].append({k: v / args.blocks * 1e6 for k, v in cpu.items()})
    load1 = os.getloadavg()
    rsteps = tuple(f"read {s}" for s in READ_STEPS)
    print(f"Load average at start {load0[0]:.2f}, at end {load1[0]:.2f}; {os.cpu_count()} CPUs; dir {args.dir}; "
          f"{args.blocks} blocks of {format_size(block)} (+4 KiB header) x {args.rounds} rounds, variants in turn"
          + ("" if direct_ok else "; O_DIRECT refused here, its rows left out") + "\n")
    print("| path | " + " | ".join(f"{c} us" for c in STEPS) + " | write CPU us per block | write wall us | "
          + " | ".join(f"{c} us" for c in rsteps) + " | read CPU us per block |")
    print("|---|" + "---:|" * (len(STEPS) + len(rsteps) + 3))
    table = {}
    for name, rs in runs.items():
        med = {c: statistics.median(r[c] for r in rs) for c in (*STEPS, *rsteps, "wall")}
        total = statistics.median(sum(r[c] for c in STEPS) for r in rs)
        rtotal = statistics.median(sum(r[c] for c in rsteps) for r in rs)
        table[name] = {**med, "cpu": total, "read_cpu": rtotal,
                       "runs_cpu": [round(sum(r[c] for c in STEPS), 1) for r in rs],
                       "runs_read_cpu": [round(sum(r[c] for c in rsteps), 1) for r in rs]}
        print(f"| {name} | " + " | ".join(f"{med[c]:.1f}" for c in STEPS) + f" | {total:.1f} | {med['wall']:.1f} | "
              + " | ".join(f"{med[c]:.1f}" for c in rsteps) + f" | {rtotal:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg": [load0[0], load1[0]], "block_bytes": block, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
