#!/usr/bin/env python
# Feeds BENCHMARKS.md section 12.
"""Warm restart: restart-to-first-hit warm vs cold, and what the journal costs a store.

    python scripts/bench_warm_restart.py [--pools 1GiB,4GiB] [--reps 3] [--stores 200]
    python scripts/bench_warm_restart.py --disk --trees NEW,OLD [--pools 1GiB] [--missing 0,0.5]

1. Restart. A daemon with ``warm_restart`` on holds a full pool; it is stopped
   (SIGTERM) and a new one started: measured from the spawn to its socket and
   to an engine's first loaded hit. The cold baseline, interleaved with it,
   starts the same pool size with nothing kept (its engines would re-prefill).
   Also timed: the pool part alone (cold: create + prefault; warm: open +
   adopt, from ``kvtier status``) and what verifying every block's crc at
   adoption would cost (one checksum (CRC-32C) pass over the kept bytes).
2. Commit path. Two daemons side by side, ``warm_restart`` on and off; stores
   of new blocks alternate between them; the median store latency of each.
3. ``--disk``: a warm restart with the disk tier on, each daemon run from one of
   ``--trees`` (repository roots: this change and the one before it), the trees
   taking turns (A,B,B,A...). The pool is filled and every block written to
   disk; before each start a share (``--missing``) of the kept blocks' files is
   deleted, as if the last daemon was SIGKILLed before writing them. Timed from
   the spawn: ready, first hit, the disk's start-up scan done, and its write
   backlog empty (the re-queued blocks written); and how many were re-queued.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from benchlib import add_json_flag, answers_stats, emit, machine_notes, size_list, start_daemon, stop_daemon, table

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import warm_names
from kvtier.pool import checksum
from kvtier.pool.segment import unlink_segment
from kvtier.pool.sizes import format_size

NS = Namespace("bench-warm", "float16", "flashinfer", 16)
SHAPE = (64, 2, 16, 8, 128)  # 64 engine blocks; 4 layers x 64 KiB = 256 KiB per kvtier block
LAYERS = 4
BLOCK = 4 * 2 * 16 * 8 * 128 * 2


def spawn(sock: str, pool: int, warm: bool, extra: dict | None = None,
          tree: str | None = None) -> tuple[subprocess.Popen, float]:
    """The daemon (from repository ``tree``: its kvtier, not this one's) and the seconds
    until its loop answers a client (HELLO + stats)."""
    env = {**os.environ, "KVTIER_WARM_RESTART": "1" if warm else "0", "KVTIER_RAM_FRACTION": "0.95", **(extra or {})}
    t0 = time.perf_counter()
    p = start_daemon(sock, pool, env, 600, ("--slab-size", "16MiB"), cwd=tree, log_level="WARNING",
                     ready=answers_stats)
    return p, time.perf_counter() - t0


def fill(sock: str, kv, pool: int) -> list[bytes]:
    """Store blocks until the pool is (about) full; their hashes."""
    hashes = []
    with Client(sock, name="filler", timeout=60) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        for n in range(pool // BLOCK // SHAPE[0]):
            hs = [(n * SHAPE[0] + i).to_bytes(8, "little") * 2 for i in range(SHAPE[0])]
            if not c.store(hs, list(range(SHAPE[0]))).wait().ok:
                break
            hashes += hs
    return hashes


def first_hit(sock: str, kv, hashes: list[bytes]) -> dict:
    with Client(sock, name="engine", timeout=60) as c:
        c.register_kv_cache(kv, [0] * LAYERS, NS)
        hit = c.lookup(hashes[-8:]) == 8 and c.load(hashes[-8:], list(range(8))).wait().ok
        return {"hit": hit, "warm": c.stats()["warm_restart"]}


def restart_case(pool: int, reps: int, kv) -> dict:
    d = tempfile.mkdtemp(prefix="kvt-warm-bench-")
    sock = os.path.join(d, "kvtier.sock")
    names = warm_names(DaemonConfig(socket=sock))
    rows = {"cold_ready_s": [], "cold_pool_s": [], "warm_ready_s": [], "warm_first_hit_s": [],
            "warm_adopt_s": [], "verify_all_s": []}
    try:
        p, _ = spawn(sock, pool, True)
        hashes = fill(sock, kv, pool)
        stop_daemon(p)
        for _ in range(reps):
            # Cold: the same pool size, nothing kept (warm_restart off also drops the kept pair,
            # so the cold run gets its own socket; the kept pool stays for the warm run).
            cold_sock = os.path.join(d, "cold.sock")
            p, ready = spawn(cold_sock, pool, False)
            rows["cold_ready_s"].append(ready)
            stop_daemon(p)
            rows["cold_pool_s"].append(_pool_create_s(pool))
            t0 = time.perf_counter()
            p, ready = spawn(sock, pool, True)
            got = first_hit(sock, kv, hashes)
            rows["warm_first_hit_s"].append(time.perf_counter() - t0)
            rows["warm_ready_s"].append(ready)
            assert got["hit"] and got["warm"]["start"] == "warm", got
            rows["warm_adopt_s"].append(got["warm"]["adopt_s"])
            rows["verify_all_s"].append(_crc_all(names[0], pool))
            stop_daemon(p)
        blocks = len(hashes)
    finally:
        for n in names:
            unlink_segment(n)
    return {"pool": pool, "blocks": blocks, **{k: statistics.median(v) for k, v in rows.items()}}


def _pool_create_s(pool: int) -> float:
    """What a cold start spends on the pool alone: create, reserve, prefault."""
    from kvtier.pool.segment import ShmSegment
    t0 = time.perf_counter()
    seg = ShmSegment(f"/kvtier-bench.{os.getpid()}", pool, create=True)
    took = time.perf_counter() - t0
    seg.close()
    return took


def _crc_all(name: str, pool: int) -> float:
    import mmap
    with open("/dev/shm" + name, "rb") as f:
        m = mmap.mmap(f.fileno(), pool, prot=mmap.PROT_READ)
        t0 = time.perf_counter()
        checksum.of(m)  # what the daemon would verify at adoption
        took = time.perf_counter() - t0
        m.close()
    return took


def disk_stats(sock: str) -> dict:
    with Client(sock, name="probe", timeout=60) as c:
        return c.stats()["disk"]


def wait_disk(sock: str, done, t0: float, timeout: float = 600) -> float:
    """Seconds from ``t0`` until ``done(disk stats)``."""
    while not done(disk_stats(sock)):
        assert time.perf_counter() - t0 < timeout, disk_stats(sock)
        time.sleep(0.01)
    return time.perf_counter() - t0


def drained(s: dict) -> bool:
    return not (s["scanning"] or s["backlog_blocks"] or s["queued_bytes"] or s.get("warm_waiting"))


def disk_case(pool: int, reps: int, kv, trees: list[str], missing: float) -> dict:
    d = tempfile.mkdtemp(prefix="kvt-warm-bench-")
    sock, root = os.path.join(d, "kvtier.sock"), os.path.join(d, "disk")
    extra = {"KVTIER_DISK_PATH": root, "KVTIER_DISK_SIZE": str(2 * pool)}
    names = warm_names(DaemonConfig(socket=sock))
    rows = {t: {k: [] for k in ("ready_s", "first_hit_s", "scanned_s", "drained_s", "requeued", "adopt_s",
                                "handover_s")} for t in trees}
    try:
        p, _ = spawn(sock, pool, True, extra, trees[0])
        hashes = fill(sock, kv, pool)
        wait_disk(sock, drained, time.perf_counter())
        stop_daemon(p)
        gone = {h.hex() for h in hashes[::max(1, round(1 / missing))]} if missing else set()
        for r in range(reps):
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                for dp, _, fs in os.walk(root):  # as if never written: the last daemon was SIGKILLed
                    for f in fs:
                        if f.rpartition("-")[0] in gone:
                            os.unlink(os.path.join(dp, f))
                t0 = time.perf_counter()
                p, ready = spawn(sock, pool, True, extra, tree)
                got = first_hit(sock, kv, hashes)
                row = rows[tree]
                row["first_hit_s"].append(time.perf_counter() - t0)
                row["ready_s"].append(ready)
                assert got["hit"] and got["warm"]["start"] == "warm", got
                row["adopt_s"].append(got["warm"]["adopt_s"])
                row["handover_s"].append(got["warm"].get("handover_s", 0.0))  # 0: a tree without it
                row["scanned_s"].append(wait_disk(sock, lambda s: not s["scanning"], t0))
                row["drained_s"].append(wait_disk(sock, drained, t0))
                row["requeued"].append(disk_stats(sock).get("warm_requeued", 0))
                stop_daemon(p)
    finally:
        for n in names:
            unlink_segment(n)
        shutil.rmtree(d, ignore_errors=True)
    return {"pool": pool, "blocks": len(hashes), "missing": len(gone), "reps": rows,
            **{t: {k: statistics.median(v) for k, v in row.items()} for t, row in rows.items()}}


def commit_case(stores: int, kv, blocks: int) -> dict:
    d = tempfile.mkdtemp(prefix="kvt-warm-bench-")
    socks = {w: os.path.join(d, f"{w}.sock") for w in ("on", "off")}
    procs = {w: spawn(s, 256 * 2**20, w == "on")[0] for w, s in socks.items()}
    lat = {"on": [], "off": []}
    try:
        clients = {w: Client(s, name="bench", timeout=60) for w, s in socks.items()}
        for c in clients.values():
            c.register_kv_cache(kv, [0] * LAYERS, NS)
        for n in range(stores):
            for w in (("on", "off") if n % 2 else ("off", "on")):  # interleaved, order alternating
                hs = [(n * blocks + i).to_bytes(8, "little") * 2 for i in range(blocks)]
                t0 = time.perf_counter()
                assert clients[w].store(hs, list(range(blocks))).wait().ok
                lat[w].append(time.perf_counter() - t0)
        for c in clients.values():
            c.close()
    finally:
        for p in procs.values():
            stop_daemon(p)
        unlink_segment(warm_names(DaemonConfig(socket=socks["on"]))[0])
        unlink_segment(warm_names(DaemonConfig(socket=socks["on"]))[1])
    on, off = statistics.median(lat["on"]), statistics.median(lat["off"])
    return {"blocks": blocks, "bytes": blocks * BLOCK, "on_ms": on * 1e3, "off_ms": off * 1e3, "ratio": on / off}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", type=size_list, default=size_list("1GiB,4GiB"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stores", type=int, default=200)
    p.add_argument("--disk", action="store_true", help="warm restart with the disk tier, per tree (--trees)")
    p.add_argument("--trees", default="", help="repository roots, comma-separated (--disk): this change first")
    p.add_argument("--missing", default="0,0.5", help="shares of the kept blocks' files deleted (--disk)")
    add_json_flag(p)
    a = p.parse_args()
    kv = ShmKVCache([SHAPE] * LAYERS, torch.float16)
    if a.disk:
        disk_main(a, kv)
        return
    report = {"machine": machine_notes(), "restart": [], "commit": []}
    for pool in a.pools:
        report["restart"].append(restart_case(pool, a.reps, kv))
    for blocks in (1, 16):
        report["commit"].append(commit_case(a.stores, kv, blocks))
    t1 = table(["pool", "blocks kept", "cold: spawn->ready s", "cold: pool prefault s", "warm: spawn->ready s",
                "warm: spawn->first hit s", "warm: adopt s", "adopt/prefault", "crc of all kept bytes s"],
               [[format_size(r["pool"]), r["blocks"], r["cold_ready_s"], r["cold_pool_s"], r["warm_ready_s"],
                 r["warm_first_hit_s"], r["warm_adopt_s"], f"{r['warm_adopt_s'] / r['cold_pool_s']:.1%}",
                 r["verify_all_s"]] for r in report["restart"]],
               "Restart to first hit: warm (pool kept) vs cold (same pool size), medians, interleaved")
    t2 = table(["store", "warm_restart off ms", "warm_restart on ms", "on/off"],
               [[f"{r['blocks']} x {format_size(BLOCK)}", r["off_ms"], r["on_ms"], f"{r['ratio']:.3f}"]
                for r in report["commit"]],
               "Store latency (commit path) with warm_restart on vs off, interleaved, medians")
    emit(report, [t1, t2], a.json)
    kv.close()


def disk_main(a, kv) -> None:
    trees = [os.path.abspath(t) for t in a.trees.split(",") if t] or [os.getcwd()]
    report = {"machine": machine_notes(), "trees": trees, "disk": []}
    for pool in a.pools:
        for share in (float(x) for x in a.missing.split(",")):
            report["disk"].append(disk_case(pool, a.reps, kv, trees, share))
    t = table(["pool", "blocks kept", "files deleted", "tree", "spawn->ready s", "spawn->first hit s",
               "spawn->scan done s", "spawn->backlog empty s", "re-queued", "adopt ms", "hand-over ms"],
              [[format_size(r["pool"]), r["blocks"], r["missing"], os.path.basename(tree), *(
                  r[tree][k] for k in ("ready_s", "first_hit_s", "scanned_s", "drained_s", "requeued")),
                r[tree]["adopt_s"] * 1e3, r[tree]["handover_s"] * 1e3]
               for r in report["disk"] for tree in trees],
              "Warm restart with the disk tier, per tree, interleaved, medians")
    emit(report, [t], a.json)
    kv.close()


if __name__ == "__main__":
    main()
