#!/usr/bin/env python3
# Feeds BENCHMARKS.md sections 2 and 6.
"""Control-path cost of a real kvtier daemon, next to bare ZeroMQ.

Three measurements, each in this one run:
  1. lookup latency p50/p99 for 1..4096 hashes per call (all hit, and all
     miss), next to a bare DEALER/ROUTER round trip carrying a frame of the
     same size (``benchlib.EchoServer``: same synchronous poll loop, no
     decoding, reply as long as the daemon's);
  2. requests/s of 32-hash lookups from 1, 4 and 16 client processes, and of
     the bare round trip from as many processes;
  3. lookup latency as the index grows from 10^3 to 10^6 blocks (256-byte
     blocks stored in batches of up to 65536), with the store rate, the
     latency of a ``stats`` call and the daemon's resident memory.

    python scripts/bench_control.py [--quick] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import benchlib as bl

from kvtier.protocol import messages as m
from kvtier.protocol.codec import encode

BLOCK = 256            # bytes per block: the index, not the copy, is measured here
STORE_BATCH = 65536    # the daemon's per-call limit


def hashes(n: int) -> list[bytes]:
    raw = os.urandom(16 * n)
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]


def lookup_frame_bytes(n: int) -> tuple[int, int]:
    """Wire sizes of a lookup of ``n`` hashes and of its reply (request id of a busy client)."""
    return (len(encode(m.Lookup(1, os.urandom(16 * n)), 123456)), len(encode(m.Hits(n), 123456)))


class Engine:
    """A client with a tiny registered cache (``blocks`` x 256 B) in one namespace."""

    def __init__(self, socket: str, blocks: int, name: str = "bench-control"):
        import torch
        from kvtier.client import Client, Namespace, ShmKVCache
        self.kv = ShmKVCache([(blocks, BLOCK)], torch.uint8)
        self.c = Client(socket, name=name, timeout=60, transfer_timeout=600)
        self.c.register_kv_cache(self.kv, [0], Namespace("bench-control", "uint8", "mla", 16))

    def store(self, keys: list[bytes]) -> None:
        for i in range(0, len(keys), STORE_BATCH):
            part = keys[i:i + STORE_BATCH]
            r = self.c.store(part, list(range(len(part)))).wait()
            if not r.ok or r.done + r.skipped != len(part):
                raise SystemExit(f"store failed: {r}")

    def close(self) -> None:
        self.c.close()
        self.kv.close()


# ---- 1. latency vs hashes per call ---------------------------------------------------
def latency_sweep(args, socket: str) -> list[dict]:
    e = Engine(socket, max(args.sizes))
    stored = hashes(max(args.sizes))
    e.store(stored)
    rows = []
    try:
        for n in args.sizes:
            rows.append(latency_point(args, e, stored[:n], hashes(n)))
    finally:
        e.close()
    return rows


def latency_point(args, e: Engine, hit: list[bytes], miss: list[bytes]) -> dict:
    """Hit, miss and bare round trips timed in alternation (same background load)."""
    n = len(hit)
    assert e.c.lookup(hit) == n and e.c.lookup(miss) == 0
    frame, reply = lookup_frame_bytes(n)
    path = os.path.join(tempfile.mkdtemp(prefix="kvtier-echo-"), "echo.sock")
    with bl.EchoServer(path, reply):
        bare = bl.BareClient(path, frame)
        for _ in range(50):  # connect and warm up
            bare.call()
        t = bl.round_robin({"hit": (lambda: e.c.lookup(hit), None), "miss": (lambda: e.c.lookup(miss), None),
                            "bare": (bare.call, None)}, args.min_time, args.min_reps, args.max_reps)
        bare.close()
    os.rmdir(os.path.dirname(path))
    row = {"hashes": n, "frame_bytes": frame, "reps": len(t["hit"])}
    for k, times in t.items():
        row[f"{k}_p50_us"], row[f"{k}_p99_us"] = bl.pct(times, 50) * 1e6, bl.pct(times, 99) * 1e6
    row["hit_mean_us"] = sum(t["hit"]) / len(t["hit"]) * 1e6
    row["hit_vs_bare_p50"] = row["hit_p50_us"] / row["bare_p50_us"]
    return row


# ---- 2. throughput with several client processes --------------------------------------
class LookupClient:
    """One client process: a kvtier engine hitting its own blocks, and a bare DEALER."""

    def __init__(self, idx: int, kv_socket: str, echo_socket: str, n: int, threads: int):
        bl.use_threads(threads)
        self.engine = Engine(kv_socket, n, name=f"bench-tput-{idx}")
        self.keys = hashes(n)
        self.engine.store(self.keys)  # each process hits its own blocks
        self.bare = bl.BareClient(echo_socket, lookup_frame_bytes(n)[0])
        self.call = None

    def prep(self, kind: str) -> None:
        self.call = self.bare.call if kind == "bare" else (lambda: self.engine.c.lookup(self.keys))
        for _ in range(20):
            self.call()

    def go(self, t_end: float) -> int:
        return bl.run_until(t_end, self.call)[0]


def throughput_sweep(args, socket: str) -> list[dict]:
    frame, reply = lookup_frame_bytes(args.tput_hashes)
    path = os.path.join(tempfile.mkdtemp(prefix="kvtier-echo-"), "echo.sock")
    rows = []
    with bl.EchoServer(path, reply), bl.WorkerPool(max(args.clients), LookupClient, socket, path,
                                                   args.tput_hashes, args.threads) as pool:
        for n in args.clients:
            k = b = 0
            for _ in range(args.slices):  # alternate the two so both see the same background load
                k += sum(pool.run(n, "kvtier", args.duration / args.slices)) / args.duration
                b += sum(pool.run(n, "bare", args.duration / args.slices)) / args.duration
            rows.append({"clients": n, "hashes": args.tput_hashes, "kvtier_rps": k, "bare_rps": b,
                         "kvtier_vs_bare": k / b})
    os.rmdir(os.path.dirname(path))
    return rows


# ---- 3. lookup cost vs index size ------------------------------------------------------
def index_sweep(args, daemon) -> list[dict]:
    e = Engine(daemon.socket, STORE_BATCH)
    rss0 = daemon.heap_bytes()  # private memory: the pool is shared, so excluded
    keys: list[bytes] = []
    rows = []
    try:
        for target in args.index_sizes:
            new = hashes(target - len(keys))
            t0 = time.perf_counter()
            e.store(new)
            store_s = time.perf_counter() - t0
            keys += new
            rows.append(index_row(args, e, keys, len(new), store_s, daemon.heap_bytes() - rss0))
    finally:
        e.close()
    return rows


def index_row(args, e: Engine, keys: list[bytes], added: int, store_s: float, growth: int) -> dict:
    row = {"blocks": len(keys), "store_blocks_per_s": added / store_s, "rss_growth_mib": growth / 2**20,
           "rss_growth_per_block": growth / len(keys)}
    for n in (32, 1000):
        start = (len(keys) // 2) // n * n  # a chain from the middle of the index
        chain = keys[start:start + n] if len(keys) >= n else keys
        assert e.c.lookup(chain) == len(chain)
        t = bl.repeat(lambda: e.c.lookup(chain), args.min_time, args.min_reps, args.max_reps)
        row[f"lookup{n}_p50_us"], row[f"lookup{n}_p99_us"] = bl.pct(t, 50) * 1e6, bl.pct(t, 99) * 1e6
    t = bl.repeat(e.c.stats, args.min_time / 4, 3, 50)
    row["stats_p50_ms"] = bl.pct(t, 50) * 1e3
    return row


# ---- output ------------------------------------------------------------------------------
def render(report: dict) -> list[str]:
    lat = [[r["hashes"], r["frame_bytes"], r["hit_p50_us"], r["hit_p99_us"], r["hit_mean_us"], r["miss_p50_us"],
            r["miss_p99_us"], r["bare_p50_us"], r["bare_p99_us"], r["hit_vs_bare_p50"]]
           for r in report["latency"]]
    tput = [[r["clients"], r["hashes"], r["kvtier_rps"], r["bare_rps"], r["kvtier_vs_bare"]]
            for r in report["throughput"]]
    idx = [[r["blocks"], r["store_blocks_per_s"], r["lookup32_p50_us"], r["lookup32_p99_us"],
            r["lookup1000_p50_us"], r["lookup1000_p99_us"], r["stats_p50_ms"], r["rss_growth_mib"],
            r["rss_growth_per_block"]]
           for r in report["index"]]
    return [
        bl.table(["hashes/call", "frame B", "hit p50 us", "hit p99 us", "hit mean us", "miss p50 us", "miss p99 us",
                  "bare p50 us", "bare p99 us", "hit/bare p50"], lat,
                 "Lookup latency vs hashes per call (bare = ZeroMQ round trip, same frame size)"),
        bl.table(["clients", "hashes/call", "kvtier req/s", "bare req/s", "kvtier/bare"], tput,
                 "Lookup throughput with N client processes"),
        bl.table(["blocks indexed", "store blocks/s", "lookup32 p50 us", "lookup32 p99 us",
                  "lookup1000 p50 us", "lookup1000 p99 us", "stats p50 ms", "daemon heap +MiB", "heap B/block"], idx,
                 f"Lookup cost vs index size ({BLOCK} B blocks)"),
    ]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes", type=bl.int_list, default=None, help="hashes per lookup, default 1,4,...,4096")
    p.add_argument("--clients", type=bl.int_list, default=None, help="process counts, default 1,4,16")
    p.add_argument("--tput-hashes", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="seconds per throughput point and side")
    p.add_argument("--slices", type=int, default=3, help="kvtier/bare alternations per throughput point")
    p.add_argument("--index-sizes", type=bl.int_list, default=None,
                   help="index sizes, default 1000,10000,100000,1000000 (--quick up to 100000)")
    p.add_argument("--min-time", type=float, default=None, help="timed seconds per latency point")
    p.add_argument("--min-reps", type=int, default=200)
    p.add_argument("--max-reps", type=int, default=20000)
    p.add_argument("--threads", type=int, default=1, help="torch threads here and in the daemon")
    bl.add_json_flag(p)
    a = p.parse_args(argv)
    q = a.quick
    a.sizes = a.sizes or [1, 4, 16, 64, 256, 1024, 4096]
    a.clients = a.clients or [1, 4, 16]
    a.duration = a.duration or (1.0 if q else 3.0)
    a.index_sizes = sorted(a.index_sizes or ([1000, 10_000, 100_000] if q else [1000, 10_000, 100_000, 1_000_000]))
    a.min_time = a.min_time if a.min_time is not None else (0.2 if q else 0.5)
    return a


def main(argv=None) -> int:
    from kvtier.demo.daemon_proc import PrivateDaemon
    args = parse(argv)
    env = bl.use_threads(args.threads)
    report = {"bench": "control", "threads": args.threads}
    with PrivateDaemon("64MiB", "4MiB", env=env) as d:
        report["latency"] = latency_sweep(args, d.socket)
        report["throughput"] = throughput_sweep(args, d.socket)
    pool = max(64 * 2**20, 2 * max(args.index_sizes) * BLOCK)  # slack: ~1 slab per 16 Mi of blocks
    with PrivateDaemon(str(pool), "16MiB", env=env) as d:
        report["index"] = index_sweep(args, d)
    report["machine"] = bl.machine_notes()  # after the run: the load average it ended under
    bl.emit(report, render(report), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
