#!/usr/bin/env python
# Feeds BENCHMARKS.md sections 13.1, 13.2, 13.3 and 13.5.
"""What the disk tier costs a store, against the tier off and another checkout.

    python scripts/bench_disk_stores.py --stores 200 --baseline /path/to/other/checkout [--reps 3] [--dir /var/tmp]
                                        [--disk-size 4GiB] [--threads-row]

One engine stores N new chains of 16 blocks (4 MiB) back to back, waiting for
each reply, into a 64 MiB pool (write-behind queue 16 MiB, so the disk falls
behind and the pool evicts), per store p50/p99 in ms and the daemon's CPU
per store (its loop thread; its other threads: copies, disk I/O); daemons of this
checkout with the disk tier on and off, and of ``--baseline DIR`` (another
checkout) with it on, alternating per rep. Also what each run wrote and did
not write. ``--disk-size`` below what a run writes (e.g. 128MiB: ~490 files)
measures a full disk, where every write makes room by evicting a file (the
steady state of a node's disk). ``--threads-row`` adds this checkout's daemon with
``disk_writer = "threads"`` (the writes on the daemon's own threads instead of its
writer process: BENCHMARKS.md 13.12). (Loads, the I/O method and lookups: ``bench_disk.py``.)

Output: a markdown table to paste into BENCHMARKS.md, with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import psutil
from bench_disk import BLOCK, LAYERS, NS, SHAPE, daemon, disk_stats, key
from benchlib import add_json_flag, emit, machine_notes, stop_daemon, table

from kvtier.client import Client, ShmKVCache
from kvtier.pool.sizes import format_size, parse_size

STORE_CHAIN = 16


def store_latencies(sock: str, kv, n: int, tag: int) -> list[float]:
    with Client(sock, name="engine", timeout=60) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        out = []
        for i in range(n):
            hs = [key(tag, i, j) for j in range(STORE_CHAIN)]
            t0 = time.perf_counter()
            assert c.store(hs, list(range(i % 16 * STORE_CHAIN, (i % 16 + 1) * STORE_CHAIN))).wait().ok
            out.append(time.perf_counter() - t0)
        return out


def bench_stores(a, work: str, kv) -> dict:
    sides = {"baseline, disk on": (a.baseline, True), "this, disk on": (None, True), "this, disk off": (None, False)}
    if a.threads_row:
        sides["this, disk on, writes on threads"] = (None, "threads")
    got: dict = {name: [] for name in sides}
    cpu: dict = {name: [] for name in sides}  # (loop thread, the others) CPU ms per store
    written: dict = {name: [] for name in sides}
    sock = os.path.join(work, "s.sock")
    for rep in range(a.reps):
        for name in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            repo, on = sides[name]
            root = os.path.join(work, f"disk-{rep}-{len(got[name])}-{list(sides).index(name)}")
            d = daemon(sock, root if on else "", a.disk_size, 64 << 20, 4, repo,
                       {"KVTIER_DISK_WRITER": "threads"} if on == "threads" else None)
            before = thread_cpu(d.pid)
            lat = store_latencies(sock, kv, a.stores, rep + 1)
            after = thread_cpu(d.pid)
            loop = after[0] - before[0]
            # the process's total keeps the CPU of threads that ended between the samples (a writer, the prefault),
            # which a sum over the threads alive at each sample would subtract and could take below zero
            cpu[name].append((loop * 1e3 / a.stores, max(0.0, after[1] - before[1] - loop) * 1e3 / a.stores))
            time.sleep(2)  # the write-behind catches up (or not): what was written and what was not
            s = disk_stats(sock)
            stop_daemon(d)
            shutil.rmtree(root, ignore_errors=True)
            got[name].append((statistics.median(lat) * 1e3, sorted(lat)[int(len(lat) * 0.99) - 1] * 1e3))
            written[name].append({k: s.get(k) for k in ("written", "recycled", "unlinked", "queue_full", "not_written")
                                  if k in s})
    rows = [[name, round(statistics.median(x[0] for x in v), 2), round(statistics.median(x[1] for x in v), 2),
             "; ".join(f"{p50:.2f}/{p99:.2f}" for p50, p99 in v),
             "; ".join(f"{lp:.2f}/{other:.2f}" for lp, other in cpu[name]), written[name][-1]]
            for name, v in got.items()]
    return {"table": table(["daemon", "store p50 ms", "store p99 ms", "runs p50/p99",
                            "daemon CPU ms/store: loop/other threads", "last run: written, not"],
                           rows, f"{a.stores} stores of {STORE_CHAIN} x {format_size(BLOCK)} into a 64 MiB pool, "
                           f"disk_size {format_size(a.disk_size)}, reps alternating, baseline {a.baseline}"),
            "runs": got, "written": written, "cpu_ms_per_store": cpu}


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of the daemon's loop thread (its id is the pid) and of the whole process."""
    proc = psutil.Process(pid)
    loop = next((t.user_time + t.system_time for t in proc.threads() if t.id == pid), 0.0)
    total = proc.cpu_times()
    return loop, total.user + total.system


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", type=int, default=200, help="stores per daemon and rep")
    p.add_argument("--baseline", default="", help="another checkout's daemon to compare (default: this one)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/var/tmp", help="a directory on the disk to measure")
    p.add_argument("--disk-size", default="4GiB", help="the tier's disk_size (small: a full disk)")
    p.add_argument("--threads-row", action="store_true",
                   help="also this checkout with disk_writer = threads (the writes on the daemon's threads)")
    add_json_flag(p)
    a = p.parse_args(argv)
    try:
        a.disk_size = parse_size(a.disk_size)
    except ValueError as exc:
        p.error(f"--disk-size: {exc}")
    if a.stores < 1 or a.reps < 1:
        p.error("--stores and --reps must be at least 1")
    if a.baseline and not os.path.isdir(os.path.join(a.baseline, "kvtier")):
        p.error(f"--baseline {a.baseline}: not a kvtier checkout (no kvtier/ in it)")
    work = tempfile.mkdtemp(prefix="kvtier-bench-stores-", dir=a.dir)
    os.chmod(work, 0o700)
    kv = ShmKVCache([SHAPE] * LAYERS, __import__("torch").float16)
    load1 = os.getloadavg()
    try:
        out = bench_stores(a, work, kv)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        kv.close()
    note = f"Load average at start {load1[0]:.2f}, at end {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs"
    emit({"machine": machine_notes(), "stores": out["runs"], "written": out["written"],
          "cpu_ms_per_store": out["cpu_ms_per_store"]}, [note, out["table"]], a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
