#!/usr/bin/env python
# Feeds BENCHMARKS.md section 13.9 (how long a load of small blocks from disk takes).
"""Loads of 4 KiB blocks from the disk tier, next to the same loads from RAM.

    python scripts/bench_disk_small_loads.py [--lengths 1,16,64] [--chains 20] [--threads 4] [--json]

A daemon with a disk tier stores ``--chains`` chains of each length (1-layer
4 KiB blocks) and writes them to disk; a fresh daemon on the same directory
(its RAM pool empty, its scan done) then, per chain: a lookup, a load (every
block from disk: read, verified, committed, copied to the engine), and a
second load of the same chain (now from RAM: the in-run baseline). Median and
spread per length, with the daemon's read counters. The trace replay's disk
scenario is bound by such loads (BENCHMARKS.md 13.6).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import bench_disk as bd  # scripts/ is first on the path of a script run by its file name
from benchlib import add_json_flag, emit, machine_notes, table

from kvtier.client import Client, Namespace, ShmKVCache

NS = Namespace("bench-small-loads", "float16", "flashinfer", 16)
SHAPE = (256, 2, 16, 1, 64)  # 256 engine blocks of 2 x 16 x 64 float16: 4 KiB each, one layer


def store_chains(sock: str, kv, chains: list[list[bytes]]) -> None:
    with Client(sock, name="filler", timeout=120) as c:
        c.register_kv_cache(kv, [0], NS)
        for hs in chains:
            assert c.store(hs, list(range(len(hs)))).wait().ok
            while bd.disk_stats(sock)["queued_bytes"]:  # every block written, none skipped
                time.sleep(0.01)


def time_loads(sock: str, kv, chains: list[list[bytes]]) -> dict:
    disk, ram = [], []
    with Client(sock, name="engine", timeout=120) as c:
        c.register_kv_cache(kv, [0], NS)
        for hs in chains:
            ids = list(range(len(hs)))
            if c.lookup(hs) != len(hs):
                raise RuntimeError("a chain stored before the restart is not whole on disk")
            for out in (disk, ram):  # first from disk, then the same blocks from RAM
                t0 = time.perf_counter()
                r = c.load(hs, ids).wait()
                out.append((time.perf_counter() - t0) * 1e3)
                if not (r.ok and r.done == len(hs)):
                    raise RuntimeError(f"load failed: {r}")
    return {"disk_ms": disk, "ram_ms": ram}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1,16,64", help="blocks per chain, comma-separated (at most 256)")
    ap.add_argument("--chains", type=int, default=20, help="chains per length")
    ap.add_argument("--threads", type=int, default=4, help="disk_threads (the daemon's readers)")
    ap.add_argument("--dir", default="/var/tmp")
    add_json_flag(ap)
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error("--lengths: comma-separated block counts")
    if not lengths or min(lengths) < 1 or max(lengths) > SHAPE[0]:
        ap.error(f"--lengths must be between 1 and {SHAPE[0]}")
    if args.chains < 1 or args.threads < 1:
        ap.error("--chains and --threads must be at least 1")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir} is not a directory")
    import torch
    root = tempfile.mkdtemp(prefix="kvtier-bench-small-", dir=args.dir)
    # The socket in a short directory of its own: a Unix socket's path is at most 107 bytes.
    sockdir = tempfile.mkdtemp(prefix="kvt-")
    sock, disk = os.path.join(sockdir, "kvtier.sock"), os.path.join(root, "disk")
    kv = ShmKVCache([SHAPE], torch.float16)
    load0 = os.getloadavg()[0]
    lengths = sorted(set(lengths))  # a chain's keys: its length, its number and each block's place
    chains = {n: [[bd.key(n % 256, i, k) for i in range(n)] for k in range(args.chains)] for n in lengths}
    proc = None
    try:
        proc = bd.daemon(sock, disk, 256 << 20, 64 << 20, threads=args.threads)
        store_chains(sock, kv, [hs for n in lengths for hs in chains[n]])
        bd.stop_daemon(proc)
        proc = bd.daemon(sock, disk, 256 << 20, 64 << 20, threads=args.threads)  # RAM empty
        rows = []
        for n in lengths:
            t = time_loads(sock, kv, chains[n])
            d, r = statistics.median(t["disk_ms"]), statistics.median(t["ram_ms"])
            rows.append({"blocks": n, "disk_p50_ms": d, "disk_min_ms": min(t["disk_ms"]),
                         "disk_max_ms": max(t["disk_ms"]), "ram_p50_ms": r, "disk_vs_ram": d / r,
                         "disk_us_per_block": d * 1e3 / n})
        counters = {k: v for k, v in bd.disk_stats(sock).items() if k.startswith("read")}
    finally:
        if proc is not None:
            bd.stop_daemon(proc)
        kv.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    report = {"machine": machine_notes(), "threads": args.threads, "chains": args.chains,
              "loadavg": [load0, os.getloadavg()[0]], "rows": rows, "read_counters": counters}
    tab = table(["blocks per load", "from disk p50 ms", "min", "max", "from RAM p50 ms", "disk / RAM",
                 "disk us per block"],
                [[r["blocks"], round(r["disk_p50_ms"], 2), round(r["disk_min_ms"], 2), round(r["disk_max_ms"], 2),
                  round(r["ram_p50_ms"], 2), round(r["disk_vs_ram"], 1), round(r["disk_us_per_block"])]
                 for r in rows],
                f"Loads of 4 KiB blocks, {args.chains} chains per length, disk_threads={args.threads} "
                f"(load average {load0:.2f} -> {os.getloadavg()[0]:.2f})")
    emit(report, [tab], args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
