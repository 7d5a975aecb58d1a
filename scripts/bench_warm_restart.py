#!/usr/bin/env python
# Feeds BENCHMARKS.md section 12.
"""Warm restart: restart-to-first-hit warm vs cold, and what the journal costs a store.

    python scripts/bench_warm_restart.py [--pools 1GiB,4GiB] [--reps 3] [--stores 200]

1. Restart. A daemon with ``warm_restart`` on holds a full pool; it is stopped
   (SIGTERM) and a new one started: measured from the spawn to its socket and
   to an engine's first loaded hit. The cold baseline, interleaved with it,
   starts the same pool size with nothing kept (its engines would re-prefill).
   Also timed: the pool part alone (cold: create + prefault; warm: open +
   adopt, from ``kvtier status``) and what verifying every block's crc at
   adoption would cost (one crc32 pass over the kept bytes).
2. Commit path. Two daemons side by side, ``warm_restart`` on and off; stores
   of new blocks alternate between them; the median store latency of each.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
import zlib

import torch

import subprocess
import sys

from benchlib import add_json_flag, emit, machine_notes, no_system_config, size_list, table

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import warm_names
from kvtier.pool.segment import unlink_segment
from kvtier.pool.sizes import format_size

NS = Namespace("bench-warm", "float16", "flashinfer", 16)
SHAPE = (64, 2, 16, 8, 128)  # 64 engine blocks; 4 layers x 64 KiB = 256 KiB per kvtier block
LAYERS = 4
BLOCK = 4 * 2 * 16 * 8 * 128 * 2


def spawn(sock: str, pool: int, warm: bool) -> tuple[subprocess.Popen, float]:
    """The daemon and the seconds until its loop answers a client (HELLO + stats)."""
    if os.path.exists(sock):
        os.unlink(sock)
    env = {**os.environ, "KVTIER_WARM_RESTART": "1" if warm else "0", "KVTIER_RAM_FRACTION": "0.95"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", sock, "--pool-size", str(pool),
                          "--slab-size", "16MiB", "--log-level", "WARNING", *no_system_config()],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        if p.poll() is not None:
            raise SystemExit(f"daemon failed: {p.communicate()[1][-2000:]}")
        if os.path.exists(sock):
            try:
                with Client(sock, name="probe", timeout=60) as c:
                    c.stats()
                break
            except Exception:  # bound but not serving yet
                pass
        time.sleep(0.002)
    return p, time.perf_counter() - t0


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(120)


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
        stop(p)
        for _ in range(reps):
            # Cold: the same pool size, nothing kept (warm_restart off also drops the kept pair,
            # so the cold run gets its own socket; the kept pool stays for the warm run).
            cold_sock = os.path.join(d, "cold.sock")
            p, ready = spawn(cold_sock, pool, False)
            rows["cold_ready_s"].append(ready)
            stop(p)
            rows["cold_pool_s"].append(_pool_create_s(pool))
            t0 = time.perf_counter()
            p, ready = spawn(sock, pool, True)
            got = first_hit(sock, kv, hashes)
            rows["warm_first_hit_s"].append(time.perf_counter() - t0)
            rows["warm_ready_s"].append(ready)
            assert got["hit"] and got["warm"]["start"] == "warm", got
            rows["warm_adopt_s"].append(got["warm"]["adopt_s"])
            rows["verify_all_s"].append(_crc_all(names[0], pool))
            stop(p)
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
        zlib.crc32(m)
        took = time.perf_counter() - t0
        m.close()
    return took


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
            stop(p)
        unlink_segment(warm_names(DaemonConfig(socket=socks["on"]))[0])
        unlink_segment(warm_names(DaemonConfig(socket=socks["on"]))[1])
    on, off = statistics.median(lat["on"]), statistics.median(lat["off"])
    return {"blocks": blocks, "bytes": blocks * BLOCK, "on_ms": on * 1e3, "off_ms": off * 1e3, "ratio": on / off}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", type=size_list, default=size_list("1GiB,4GiB"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stores", type=int, default=200)
    add_json_flag(p)
    a = p.parse_args()
    kv = ShmKVCache([SHAPE] * LAYERS, torch.float16)
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


if __name__ == "__main__":
    main()
