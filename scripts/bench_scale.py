#!/usr/bin/env python
# Feeds BENCHMARKS.md section 18 and docs/SCALE.md.
"""Scale: a pool of millions of small blocks (issue 35 item 5).

    python scripts/bench_scale.py [--pool 8GiB] [--block 4KiB] [--flush-blocks 1000000]
                                  [--baseline-tree DIR] [--reps 2] [--json PATH]

Real daemons (``python -m kvtier.daemon``), one client storing 16,384 blocks
per request from a registered CPU cache (sealed shared memory).

1. Big pool. A daemon with ``warm_restart`` on starts cold (spawn to first
   answered ``stats``), is filled to the brim (namespace X gets
   ``--flush-blocks``, Y the rest), and its RSS outside the pool (anon: heap,
   not the shared pool pages) is read before and after: bytes per block.
   Lookups of 32-block chains that hit, on the full daemon, interleaved with
   the same lookup on a small daemon (same block size, 1,024 blocks) and a
   bare ping: p50/p99. Then SIGTERM and a warm start (ready time, adoption
   time, blocks adopted), and a cold start of the same size after it.
2. Flush hold, before/after. With ``--baseline-tree`` (a checkout of the
   commit before the spread flush), daemons of both trees in turn (A, B, A,
   B), each holding ``--flush-blocks`` in one namespace, flushed while a
   prober process pings as fast as it can: the flush call's time, the
   longest ping during the flush (an upper bound of how long the loop was
   held, plus a round trip) next to the longest in an idle second before it,
   and after the change the daemon's own longest flush turn
   (``stats.flushes``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
import torch

from benchlib import (REPO, add_json_flag, answers_stats, emit, machine_notes, parse_size, pct, round_robin,
                      start_daemon, stop_daemon, table)

from kvtier.client import Client, Namespace, ShmKVCache

X = Namespace("scale-x", "float16", "flashinfer", 16)
Y = Namespace("scale-y", "float16", "flashinfer", 16)
ENGINE_BLOCKS = 4096   # the client's cache: chains reuse its blocks (block i of a store: engine block i % 4096)
PER_STORE = 16384      # blocks per store request
SLAB = "16MiB"
MiB = 2**20


def load() -> str:
    return "%.1f/%.1f/%.1f" % os.getloadavg()


def keys(tag: int, start: int, n: int) -> list[bytes]:
    a = np.empty((n, 2), "<u8")
    a[:, 0], a[:, 1] = tag, np.arange(start, start + n)
    b = a.tobytes()
    return [b[i:i + 16] for i in range(0, 16 * n, 16)]


def make_kv(block: int) -> ShmKVCache:
    kv = ShmKVCache([(ENGINE_BLOCKS, 2, 16, 1, block // 64)], torch.float16)
    kv.tensors[0].copy_(torch.randn(kv.tensors[0].shape).half())
    return kv


def spawn(tree: str, sock: str, pool: int, warm: bool) -> tuple[subprocess.Popen, float]:
    """A daemon from ``tree`` and the seconds from spawn until it answers ``stats``."""
    env = {**os.environ, "KVTIER_WARM_RESTART": "1" if warm else "0", "KVTIER_RAM_FRACTION": "0.9",
           "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = start_daemon(sock, pool, env, 3600, ("--slab-size", SLAB), cwd=tree, log_level="WARNING",
                     ready=lambda s: answers_stats(s, 120))  # a big warm pool takes minutes to adopt
    return p, time.perf_counter() - t0


def anon_rss(pid: int) -> int:
    mi = psutil.Process(pid).memory_info()
    return mi.rss - mi.shared


def fill(sock: str, kv, ns: Namespace, tag: int, n: int) -> tuple[int, float]:
    """Store up to ``n`` new blocks under ``ns``; (blocks stored, seconds)."""
    done, t0 = 0, time.perf_counter()
    with Client(sock, name=f"filler-{tag}", timeout=600, transfer_timeout=600) as c:
        c.register_kv_cache(kv, [0], ns)
        while done < n:
            k = min(PER_STORE, n - done)
            r = c.store(keys(tag, done, k), [i % ENGINE_BLOCKS for i in range(k)]).wait()
            done += r.done
            if not r.ok:
                break
    return done, time.perf_counter() - t0


def prober(sock: str, stop_evt, out) -> None:
    """Ping as fast as possible until told to stop; (start, round trip) per ping."""
    samples = []
    with Client(sock, name="prober", timeout=600) as c:
        c.ping()
        out.put("ready")
        while not stop_evt.is_set():
            t = time.perf_counter()
            c.ping()
            samples.append((t, time.perf_counter() - t))
    out.put(samples)


def flush_under_probe(sock: str, ns: Namespace) -> dict:
    """Flush ``ns`` while a prober pings; longest ping in an idle window first, then during the flush."""
    ctx = mp.get_context("spawn")
    stop_evt, out = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=prober, args=(sock, stop_evt, out))
    p.start()
    try:  # the prober is stopped whatever happens (left running, it pings a daemon forever)
        assert out.get(timeout=120) == "ready"
        with Client(sock, name="flusher", timeout=600) as c:
            time.sleep(1.0)
            t_idle = time.perf_counter()
            time.sleep(1.0)
            t0 = time.perf_counter()
            removed = c.flush(ns)
            t1 = time.perf_counter()
            fl = c.stats().get("flushes", {})
            turns, longest, cpu = fl.get("turns"), fl.get("longest_turn_ms"), fl.get("longest_turn_cpu_ms")
    finally:
        stop_evt.set()
    samples = out.get(timeout=120)
    p.join(60)
    idle = [rtt for t, rtt in samples if t_idle <= t and t + rtt < t0]
    during = [rtt for t, rtt in samples if t < t1 and t + rtt > t0]
    return {"removed": removed, "flush_s": t1 - t0, "turns": turns, "longest_turn_ms": longest, "longest_turn_cpu_ms": cpu,
            "idle_pings": len(idle), "idle_max_ms": max(idle) * 1e3, "idle_p99_ms": pct(idle, 99) * 1e3,
            "during_pings": len(during), "during_max_ms": max(during) * 1e3 if during else None,
            "during_p99_ms": pct(during, 99) * 1e3 if during else None, "load": load()}


def big_pool(args, d: str) -> dict:
    pool, block = args.pool, args.block
    sock = os.path.join(d, "big.sock")
    kv = make_kv(block)
    r: dict = {"pool": pool, "block": block, "load_start": load()}
    p, r["cold_start_s"] = spawn(REPO, sock, pool, True)
    with Client(sock, name="reg", timeout=60) as c:  # a registration first: its mappings are not per block
        c.register_kv_cache(kv, [0], X)
        rss0 = anon_rss(p.pid)
        nx, r["fill_x_s"] = fill(sock, kv, X, 1, args.flush_blocks)
        free = c.stats()["pool"]["free_bytes"] // block  # the rest of the slabs: Y must evict none of X
        ny, r["fill_y_s"] = fill(sock, kv, Y, 2, free)
        rss1 = anon_rss(p.pid)
        s = c.stats()
        assert s["pool"]["evictions"] == 0, "the fill evicted: RSS per block would be per block stored"
    r.update(blocks=nx + ny, blocks_x=nx, rss0_mib=rss0 / MiB, rss_full_mib=rss1 / MiB,
             rss_per_block=(rss1 - rss0) / (nx + ny), used_bytes=s["pool"]["used_bytes"], load_filled=load())
    print(f"filled {nx + ny:,} blocks in {r['fill_x_s'] + r['fill_y_s']:.0f} s; daemon anon RSS "
          f"{rss0 / MiB:.0f} -> {rss1 / MiB:.0f} MiB: {r['rss_per_block']:.0f} B/block (load {load()})", flush=True)

    # Lookups: full daemon vs a small one vs a bare ping, interleaved.
    small_sock = os.path.join(d, "small.sock")
    sp, _ = spawn(REPO, small_sock, 64 * MiB, False)
    fill(small_sock, kv, Y, 2, 1024)
    rng = np.random.default_rng(1)
    with Client(sock, name="lk", timeout=60) as big, Client(small_sock, name="lk", timeout=60) as small:
        big.register_kv_cache(kv, [0], Y)
        small.register_kv_cache(kv, [0], Y)
        starts = iter(rng.integers(0, ny - 32, 100000).tolist())
        times = round_robin({
            "lookup_full": (lambda: big.lookup(keys(2, next(starts), 32)) == 32 or _miss(), None),
            "lookup_small": (lambda: small.lookup(keys(2, 0, 32)) == 32 or _miss(), None),
            "ping_full": (big.ping, None)}, min_time=3.0, min_reps=2000, max_reps=5000)
    stop_daemon(sp, 600)
    r["lookups"] = {k: {"n": len(v), "p50_ms": pct(v, 50) * 1e3, "p99_ms": pct(v, 99) * 1e3} for k, v in times.items()}
    r["load_lookups"] = load()
    print("lookups", r["lookups"], load(), flush=True)

    # Restart: warm (the kept pool adopted), then cold of the same size.
    r["stop_s"] = stop_daemon(p, 600)
    p, r["warm_start_s"] = spawn(REPO, sock, pool, True)
    with Client(sock, name="probe", timeout=60) as c:
        w = c.stats()["warm_restart"]
    r.update(warm=w["start"], adopt_s=w["adopt_s"], adopted_blocks=w["adopted_blocks"],
             rss_warm_mib=anon_rss(p.pid) / MiB, load_warm=load())
    print(f"warm start {r['warm_start_s']:.1f} s (adopt {w['adopt_s']:.1f} s, {w['adopted_blocks']:,} blocks)",
          flush=True)
    stop_daemon(p, 600)
    kv.close()
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.warm import warm_names
    from kvtier.pool.segment import unlink_segment
    for n in warm_names(DaemonConfig(socket=sock)):
        unlink_segment(n)
    p, r["cold_start_again_s"] = spawn(REPO, sock, pool, False)
    stop_daemon(p, 600)
    return r


def _miss():
    raise AssertionError("a lookup that must hit missed")


def flush_hold(args, d: str, trees: dict) -> list[dict]:
    """A, B, A, B: each tree's daemon holding ``flush_blocks`` in X, flushed under the prober."""
    block, n = args.block, args.flush_blocks
    slab = parse_size(SLAB)
    pool = -(-int(n * block * 1.05) // slab) * slab
    kv = make_kv(block)
    rows = []
    for rep in range(args.reps):
        for name, tree in trees.items():
            sock = os.path.join(d, f"hold-{name}.sock")
            p, _ = spawn(tree, sock, pool, False)
            try:
                got, _ = fill(sock, kv, X, 1, n)
                row = {"tree": name, "rep": rep, "blocks": got, **flush_under_probe(sock, X)}
            finally:
                stop_daemon(p, 600)
            print(row, flush=True)
            rows.append(row)
    kv.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=parse_size, default=parse_size("8GiB"))
    ap.add_argument("--block", type=parse_size, default=parse_size("4KiB"))
    ap.add_argument("--flush-blocks", type=int, default=1_000_000)
    ap.add_argument("--baseline-tree", help="a checkout of the tree before the spread flush (for part 2)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-big", action="store_true")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="kvt-scale-")
    report = {"machine": machine_notes()}
    tables = []
    if not args.skip_big:
        b = report["big"] = big_pool(args, d)
        lk = b["lookups"]
        tables.append(table(["measure", "value", "baseline (same run)"], [
            ["blocks held", f"{b['blocks']:,}", f"pool {b['pool'] / 2**30:.1f} GiB / {b['block']} B"],
            ["daemon anon RSS per block", f"{b['rss_per_block']:.0f} B", f"{b['rss0_mib']:.0f} MiB empty"],
            ["lookup 32 hits p50 / p99 (ms)", f"{lk['lookup_full']['p50_ms']:.3f} / {lk['lookup_full']['p99_ms']:.3f}",
             f"small pool {lk['lookup_small']['p50_ms']:.3f} / {lk['lookup_small']['p99_ms']:.3f}; ping "
             f"{lk['ping_full']['p50_ms']:.3f} / {lk['ping_full']['p99_ms']:.3f}"],
            ["start, cold (s)", f"{b['cold_start_s']:.1f}", f"again after: {b['cold_start_again_s']:.1f}"],
            ["warm restart (s)", f"{b['warm_start_s']:.1f} (adopt {b['adopt_s']:.1f})",
             f"{b['adopted_blocks']:,} blocks adopted of {b['blocks']:,}"],
        ], title=f"Big pool (load {b['load_start']} at start, {b['load_filled']} filled)"))
    if args.baseline_tree:
        rows = report["flush_hold"] = flush_hold(args, d, {"before": args.baseline_tree, "after": REPO})
        tables.append(table(["tree", "rep", "blocks", "flush call s", "longest turn ms (cpu)", "longest ping ms",
                             "ping p99 ms", "idle longest / p99 ms", "turns", "load"],
                            [[r["tree"], r["rep"], r["blocks"], r["flush_s"],
                              f"{r['longest_turn_ms']} ({r['longest_turn_cpu_ms']})" if r["turns"] else "-",
                              r["during_max_ms"], r["during_p99_ms"], f"{r['idle_max_ms']:.1f} / {r['idle_p99_ms']:.2f}",
                              r["turns"] or "-", r["load"]] for r in rows],
                            title="Flush hold, interleaved"))
    emit(report, tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
