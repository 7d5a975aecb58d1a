#!/usr/bin/env python
# Feeds BENCHMARKS.md section 13 (what the tier costs a store, 13.1 and 13.2: bench_disk_stores.py).
"""The disk tier: load GB/s vs a sequential read of the same bytes, the I/O
method, and what a disk hit costs a lookup.

    python scripts/bench_disk.py [--bytes 1GiB] [--reps 3] [--threads 1,2,4] [--dir /var/tmp]

1. Loads. A daemon with ``disk_path`` stores ``--bytes`` of 256 KiB blocks
   and writes them to disk; then, per rep and per ``disk_threads`` value
   (interleaved), the page cache is dropped (``echo 3 > drop_caches`` as root,
   else ``POSIX_FADV_DONTNEED`` on every file), a fresh daemon (empty RAM
   pool) scans the files and an engine loads every block (4 loads of 64
   blocks in flight): disk -> pool (verified) -> engine memory. Baselines in
   the same rep, caches dropped before each: ``dd``-style sequential reads
   with ``O_DIRECT`` (1 MiB requests) of one file holding the same number of
   bytes on the same filesystem, the same with 4 streams (fio-style, queue
   depth 4), and one thread reading the block files themselves front to back.
2. I/O method. The same block files read cold into a pool-sized buffer:
   buffered ``preadv`` straight into the buffer (what the tier does) vs
   ``O_DIRECT`` into an aligned bounce buffer + a copy into the buffer, with
   1/2/4 threads; and writes of the same blocks, with and without ``fsync``.
3. Lookups. One daemon, one 64-block chain in RAM and one only on disk;
   client lookups of each alternate (round trip, median us); and the index
   call alone in process (``BlockIndex.lookup`` with the disk tier off, on
   with a RAM chain, on with a disk chain).

What the disk tier costs a store: ``bench_disk_stores.py``.

Output: markdown tables to paste into BENCHMARKS.md, with the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from benchlib import add_json_flag, emit, machine_notes, size_list, start_daemon, stop_daemon, table
from disk_baselines import DROP, direct_read, drop_cache, files_read, read_files, write_files

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.pool.sizes import format_size

NS = Namespace("bench-disk", "float16", "flashinfer", 16)
SHAPE = (256, 2, 16, 8, 128)  # 256 engine blocks; 4 layers x 64 KiB = 256 KiB per kvtier block
LAYERS = 4
BLOCK = 4 * 2 * 16 * 8 * 128 * 2
PER_LOAD, IN_FLIGHT = 64, 4


def hashes(n: int, tag: int = 0) -> list[bytes]:
    """Digests, as engines' block hashes are: the lookup mirror's table takes a key's first 8
    bytes as its bucket, so counters there put every key in a few buckets (its probes then
    walked full buckets on every write until the table overflowed: BENCHMARKS.md 13.5)."""
    return [key(tag, i) for i in range(n)]


def key(tag: int, i: int, j: int = 0) -> bytes:
    return hashlib.blake2b(bytes([tag]) + i.to_bytes(8, "little") + j.to_bytes(4, "little"), digest_size=16).digest()


def daemon(sock: str, disk: str, disk_size: int, pool: int, threads: int = 2, repo: str | None = None,
           extra_env: dict | None = None):
    """Ready once its start-up scan is done. ``repo``: run another checkout's daemon; ``disk`` "": the tier off;
    ``extra_env``: more of its settings (e.g. ``KVTIER_DISK_WRITER``)."""
    env = {**os.environ, "KVTIER_DISK_PATH": disk, "KVTIER_DISK_SIZE": str(disk_size),
           "KVTIER_DISK_THREADS": str(threads), "KVTIER_DISK_TIMEOUT_S": "60", "KVTIER_RAM_FRACTION": "0.95",
           **(extra_env or {})}
    if not disk:
        del env["KVTIER_DISK_PATH"], env["KVTIER_DISK_SIZE"]
    return start_daemon(sock, pool, env, 300, ("--slab-size", "16MiB"), cwd=repo, log_level="WARNING",
                        ready=lambda s: not disk_stats(s).get("scanning"))


def disk_stats(sock: str) -> dict:
    with Client(sock, name="probe", timeout=60) as c:
        return c.stats()["disk"]


def block_files(root: str) -> list[str]:
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".kvb"))


# ---- 1. loads ------------------------------------------------------------------------------
def fill(sock: str, kv, n: int) -> list[bytes]:
    hs = hashes(n)
    with Client(sock, name="filler", timeout=120) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        for start in range(0, n, PER_LOAD):  # 16 MiB stores: within any pool's write-behind queue
            part = hs[start:start + PER_LOAD]
            assert c.store(part, list(range(len(part)))).wait().ok
            while disk_stats(sock)["queued_bytes"]:  # let the write-behind keep up (no block skipped)
                time.sleep(0.01)
    return hs


def load_all(sock: str, kv, hs: list[bytes]) -> float:
    with Client(sock, name="engine", timeout=300) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        t0 = time.perf_counter()
        pending = []
        for start in range(0, len(hs), PER_LOAD):
            part = hs[start:start + PER_LOAD]
            slot = (start // PER_LOAD) % IN_FLIGHT * PER_LOAD
            if len(pending) >= IN_FLIGHT:
                r = pending.pop(0).wait()
                assert r.ok, r
            pending.append(c.load(part, list(range(slot, slot + len(part)))))
        for h in pending:
            r = h.wait()
            assert r.ok, r
        return time.perf_counter() - t0


# ---- 2. I/O method ----------------------------------------------------------------------------
# ---- lookups --------------------------------------------------------------------------------
def lookup_round_trips(sock: str, kv, ram: list[bytes], disk: list[bytes], n: int) -> dict:
    out = {"ram": [], "disk": []}
    with Client(sock, name="engine", timeout=60) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        assert c.lookup(ram) == len(ram) and c.lookup(disk) == len(disk)
        for i in range(n):
            for kind in (("ram", "disk") if i % 2 else ("disk", "ram")):
                keys = ram if kind == "ram" else disk
                t0 = time.perf_counter()
                c.lookup(keys)
                out[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def lookup_in_process(n: int) -> dict:
    """BlockIndex.lookup alone: no socket, no daemon loop (ns per call, median of batches)."""
    from kvtier.disk.bridge import DiskBridge
    from kvtier.disk.index import DiskEntry, DiskIndex
    from kvtier.disk.io import DiskIO
    from kvtier.pool.allocator import SlabAllocator
    from kvtier.pool.index import BlockIndex
    ram, disk = hashes(64, 1), hashes(64, 2)
    indexes = {}  # the same blocks in RAM, without and with the disk tier below
    for tiered in (False, True):
        index = BlockIndex(SlabAllocator(64 * 2**20, 2**20))
        ns = index.namespace("t\x1fbench", 4096)
        index.complete_store(index.prepare_store(ns, ram))
        indexes[tiered] = (index, ns)
    root = tempfile.mkdtemp(prefix="kvtier-bench-lookup-")
    os.mkdir(os.path.join(root, "tmp"))
    io = DiskIO(root, bytearray(4096), 1)
    index, ns = indexes[True]
    bridge = DiskBridge(io, DiskIndex(2**40), index, 1.0, 0)
    index.attach_lower(bridge)
    for k in disk:
        bridge.dindex.add(DiskEntry(ns.key, k, 1, 4096, 0, ""))

    def per_call(keys, tiered) -> float:
        index, ns = indexes[tiered]
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            for _ in range(100):
                index.lookup(ns, keys)
            times.append((time.perf_counter_ns() - t0) / 100)
        return statistics.median(times)
    out = {}
    for _ in range(3):  # interleaved
        for name, keys, tiered in (("ram, tier off", ram, False), ("ram, tier on", ram, True),
                                   ("disk, tier on", disk, True), ("miss, tier off", disk, False)):
            out.setdefault(name, []).append(per_call(keys, tiered))
    io.close()
    shutil.rmtree(root, ignore_errors=True)
    return {k: min(v) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bytes", type=size_list, default=[2**30], help="bytes of blocks on disk (one size)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", default="1,2,4", help="disk_threads values to compare")
    p.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--cache", choices=("drop", "fadvise"), default="drop",
                   help="cold reads by drop_caches (as root; else fadvise) or POSIX_FADV_DONTNEED on the files")
    add_json_flag(p)
    a = p.parse_args()
    DROP["caches"] = a.cache == "drop"
    total = max(1, a.bytes[0] // BLOCK // PER_LOAD) * PER_LOAD * BLOCK  # whole loads of 64 blocks
    n = total // BLOCK
    threads = [int(t) for t in a.threads.split(",")]
    work = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=a.dir)
    os.chmod(work, 0o700)
    root, sock = os.path.join(work, "disk"), os.path.join(work, "d.sock")
    pool = total + 64 * 2**20
    disk_size = 2 * total + 64 * 2**20  # the blocks, their headers, and the lookup part's RAM chain
    kv = ShmKVCache([SHAPE] * LAYERS, __import__("torch").float16)
    for t in kv.tensors:
        t.normal_()
    report = {"machine": machine_notes(), "bytes": total, "blocks": n, "block_bytes": BLOCK}
    load1 = os.getloadavg()
    try:
        d = daemon(sock, root, disk_size, pool)
        hs = fill(sock, kv, n)
        s = disk_stats(sock)
        assert s["written"] == n, s
        stop_daemon(d)
        files = block_files(root)
        big = os.path.join(work, "sequential.bin")
        with open(big, "wb") as f:  # the dd baseline's file: as many bytes, same filesystem
            for _ in range(total // 2**24):
                f.write(os.urandom(2**24))
        rows, how = {t: [] for t in threads}, ""
        dd, fio, cat = [], [], []
        for rep in range(a.reps):
            for t in (threads if rep % 2 == 0 else threads[::-1]):
                how = drop_cache(files + [big])
                d = daemon(sock, root, disk_size, pool, t)
                rows[t].append(total / load_all(sock, kv, hs) / 1e9)
                stop_daemon(d)
            drop_cache(files + [big])
            dd.append(total / direct_read(big, total) / 1e9)
            drop_cache(files + [big])
            fio.append(total / direct_read(big, total, 4) / 1e9)
            drop_cache(files + [big])
            cat.append(total / files_read(files, BLOCK) / 1e9)
        med = statistics.median
        base_dd, base_fio, base_cat = med(dd), med(fio), med(cat)
        runs = lambda v: ", ".join(f"{x:.2f}" for x in v)  # noqa: E731
        t1 = table(["what", "GB/s (median)", "runs", "vs dd", "vs fio-style x4", "vs reading the files"],
                   [[f"kvtier load, disk_threads={t}", med(v), runs(v), f"{med(v) / base_dd:.0%}",
                     f"{med(v) / base_fio:.0%}", f"{med(v) / base_cat:.0%}"] for t, v in rows.items()]
                   + [["dd: O_DIRECT 1 MiB reads, one stream, one file", base_dd, runs(dd), "100%", "", ""],
                      ["fio-style: 4 streams of the same", base_fio, runs(fio), "", "100%", ""],
                      ["one thread reading the block files (buffered)", base_cat, runs(cat), "", "", "100%"]],
                   f"Disk-tier loads, {format_size(total)} in {n} blocks of {format_size(BLOCK)}, "
                   f"cache dropped by {how}")
        report["loads"] = {"kvtier": rows, "dd": dd, "fio4": fio, "files": cat, "cache": how}

        method, hows = {}, ("buffered", "bounce", "direct")
        pool_buf = mmap.mmap(-1, len(files) * BLOCK)
        pool_buf.write(bytes(len(files) * BLOCK))  # prefaulted, as the daemon's pool is
        for rep in range(a.reps):
            for t in threads:
                for how_ in (hows if rep % 2 == 0 else hows[::-1]):
                    drop_cache(files)
                    method.setdefault((t, how_), []).append(total / read_files(files, BLOCK, t, how_, pool_buf) / 1e9)
        t2 = table(["threads", "buffered preadv into the pool GB/s", "O_DIRECT into a buffer + copy GB/s",
                    "O_DIRECT into the pool GB/s", "direct / buffered"],
                   [[t, med(method[(t, "buffered")]), med(method[(t, "bounce")]), med(method[(t, "direct")]),
                     f"{med(method[(t, 'direct')]) / med(method[(t, 'buffered')]):.2f}"] for t in threads],
                   "I/O method: the same block files read cold, no verification (median of reps)")
        wn = min(n, 1024)
        writes = {False: [], True: []}
        for rep in range(a.reps):
            for fs in ((False, True) if rep % 2 == 0 else (True, False)):
                out = os.path.join(work, f"w{rep}{int(fs)}")
                writes[fs].append(wn * BLOCK / write_files(out, BLOCK, wn, fs) / 1e9)
                shutil.rmtree(out)
        t3 = table(["writes", "GB/s (median)", "runs"],
                   [["tmp + rename, no fsync (then one sync)", med(writes[False]),
                     ", ".join(f"{x:.2f}" for x in writes[False])],
                    ["tmp + fsync + rename", med(writes[True]), ", ".join(f"{x:.2f}" for x in writes[True])]],
                   f"Block file writes ({wn} x {format_size(BLOCK)})")
        report["method"] = {f"{t}-{h}": v for (t, h), v in method.items()}
        report["writes"] = {"no_fsync": writes[False], "fsync": writes[True]}

        d = daemon(sock, root, disk_size, pool)  # RAM empty: the first chain is on disk only
        disk_chain = hs[:64]
        with Client(sock, name="filler", timeout=60) as c:
            c.register_kv_cache(kv, [0] * LAYERS, NS)
            ram_chain = hashes(64, 9)
            assert c.store(ram_chain, list(range(64))).wait().ok
        rt = lookup_round_trips(sock, kv, ram_chain, disk_chain, a.lookups)
        stop_daemon(d)
        ip = lookup_in_process(200)
        t4 = table(["lookup of 64 blocks", "RAM hits", "disk hits", "disk / RAM"],
                   [["client round trip, median us", rt["ram"], rt["disk"], f"{rt['disk'] / rt['ram']:.2f}"]],
                   "What a disk hit adds to a lookup")
        t5 = table(["BlockIndex.lookup, 64 keys, in process", "ns per call"], [[k, v] for k, v in ip.items()])
        report["lookups"] = {"round_trip_us": rt, "in_process_ns": ip}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        kv.close()
    load2 = os.getloadavg()
    report["loadavg"] = [load1, load2]
    note = (f"Load average at start {load1[0]:.2f} / {load1[1]:.2f} / {load1[2]:.2f}, at end "
            f"{load2[0]:.2f} / {load2[1]:.2f} / {load2[2]:.2f}; {os.cpu_count()} CPUs; disk: {a.dir}")
    emit(report, [note, t1, t2, t3, t4, t5], a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
