#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 0.
"""Engine-shaped speed of kvtier, each row a ratio against a baseline timed in the same run.

Rows (the table of issue 16), every kvtier measurement interleaved with its baseline
(``benchlib.round_robin``: one rep of each per round, so both see the same background
load) and compared by medians:

  1 block, 32 per-layer tensors of 64 KiB   store/load of one block through the daemon
                                            vs 32 ``copy_`` of 64 KiB in this process
  16 blocks per call                        the same with 16 blocks (32 MiB) per call
  256 scattered blocks, 32 tensors of       store/load of 256 random engine block ids
  512 B / 1 KiB / 2 KiB pieces              vs one ``index_select`` (store) /
                                            ``index_copy_`` (load) per tensor
  lookup of 1000 / 4096 hashes, p50         vs a bare ZeroMQ DEALER/ROUTER echo of the
                                            same frame (``benchlib.EchoServer``)
  32-hash lookups/s, 8 client processes     vs the bare echo from 8 processes

Ratio = baseline time / kvtier time (lookups: kvtier p50 / echo p50, lower is better;
throughput: kvtier req/s and their share of the echo's). The copy rows also show
``routine``: the daemon's copy routine (``KVLayout.copy``) run in this process on
the same blocks, i.e. the copy without IPC or the daemon loop.

    python scripts/bench_engine.py            # ~3 minutes
    python scripts/bench_engine.py --quick    # ~1 minute, noisier
"""

from __future__ import annotations

import argparse
import os

import bench_control as bc
import benchlib as bl
import torch

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.demo.daemon_proc import PrivateDaemon
from kvtier.transfer.layout import KVLayout

LAYERS = 32


class CopyCase:
    """One per-layer cache (``LAYERS`` fp16 tensors of ``(blocks, piece_bytes / 2)``)
    and two clients over it: stores go through ``cs`` (its namespace flushed between
    reps, untimed), loads through ``cl`` (blocks stored once)."""

    def __init__(self, socket: str, name: str, blocks: int, piece: int, ids: list[int]):
        self.name, self.piece, self.ids = name, piece, ids
        self.kv = ShmKVCache([(blocks, piece // 2)] * LAYERS, torch.float16)
        for j, t in enumerate(self.kv.tensors):  # touched, and distinct bytes per layer
            t.copy_(torch.arange(t.numel(), dtype=torch.float16).view(t.shape) + j)
        self.cs, self.cl = (self._client(socket, role) for role in ("store", "load"))
        self.n = len(ids)
        self.nbytes = self.n * piece * LAYERS
        self.idx = torch.tensor(ids, dtype=torch.int64)
        self.flat = [t.view(torch.uint8).view(blocks, piece) for t in self.kv.tensors]
        self.stage = [torch.ones(self.n, piece, dtype=torch.uint8) for _ in range(LAYERS)]
        self.layout = KVLayout(self.kv.tensors, [0] * LAYERS)
        self.pool = torch.ones(self.n * piece * LAYERS, dtype=torch.uint8)
        self.pairs = [(i * piece * LAYERS, e) for i, e in enumerate(ids)]
        self.hashes = bc.hashes(self.n)
        self._check(self.cl.store(self.hashes, ids).wait())

    def _client(self, socket: str, role: str) -> Client:
        c = Client(socket, name=f"bench-engine-{role}", timeout=60, transfer_timeout=600)
        c.ns = Namespace("bench-engine", "float16", "per-layer", 16, extra=f"{self.name}-{role}")
        c.register_kv_cache(self.kv, [0] * LAYERS, c.ns)
        return c

    def _check(self, r) -> None:
        if not r.ok or r.done != self.n:
            raise SystemExit(f"{self.name}: transfer failed: {r}")

    def store(self) -> None:
        self._check(self.cs.store(bc.hashes(self.n), self.ids).wait())

    def load(self) -> None:
        self._check(self.cl.load(self.hashes, self.ids).wait())

    def roundtrip_ok(self) -> bool:
        """Loaded bytes equal stored bytes: wipe the blocks, load, compare."""
        want = [f[self.idx].clone() for f in self.flat]
        for f in self.flat:
            f[self.idx] = 0
        self.load()
        return all(torch.equal(f[self.idx], w) for f, w in zip(self.flat, want))

    # baselines: what an engine would do in-process without kvtier
    def copy_out(self) -> None:      # per-tensor copy_ (ids contiguous) / index_select (scattered)
        if self.contiguous:
            lo = self.ids[0]
            for f, s in zip(self.flat, self.stage):
                s.copy_(f[lo:lo + self.n])
        else:
            for f, s in zip(self.flat, self.stage):
                torch.index_select(f, 0, self.idx, out=s)

    def copy_in(self) -> None:
        if self.contiguous:
            lo = self.ids[0]
            for f, s in zip(self.flat, self.stage):
                f[lo:lo + self.n].copy_(s)
        else:
            for f, s in zip(self.flat, self.stage):
                f.index_copy_(0, self.idx, s)

    @property
    def contiguous(self) -> bool:
        return self.ids == list(range(self.ids[0], self.ids[0] + self.n))

    def routine(self, to_pool: bool) -> None:
        self.layout.copy(self.pool, self.pairs, to_pool)

    def close(self) -> None:
        self.cs.close()
        self.cl.close()
        self.kv.close()


def copy_rows(args, socket: str) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    cases = [("1 block, 32 x 64 KiB", 32, 64 << 10, [5]),
             ("16 blocks, 32 x 64 KiB", 32, 64 << 10, list(range(8, 24)))]
    for piece in args.pieces:
        cases.append((f"256 scattered, 32 x {bl.short_size(piece)}", 1024, piece,
                      torch.randperm(1024, generator=gen)[:256].tolist()))
    rows = []
    for name, blocks, piece, ids in cases:
        c = CopyCase(socket, name.replace(" ", "").replace(",", "-"), blocks, piece, ids)
        try:
            if not c.roundtrip_ok():
                raise SystemExit(f"{name}: loaded bytes differ from stored bytes")
            flush = lambda: c.cs.flush(c.cs.ns)  # noqa: E731
            t = bl.round_robin({"store": (c.store, flush), "base_out": (c.copy_out, None),
                                "routine_out": (lambda: c.routine(True), None),
                                "load": (c.load, None), "base_in": (c.copy_in, None),
                                "routine_in": (lambda: c.routine(False), None)},
                               args.min_time, args.min_reps, args.max_reps)
            med = {k: bl.median(v) for k, v in t.items()}
            base = "copy_" if c.contiguous else "index_select/index_copy_"
            for d, kv_k, base_k, rt_k in (("store", "store", "base_out", "routine_out"),
                                          ("load", "load", "base_in", "routine_in")):
                rows.append({"path": f"{d} {name}", "baseline": base, "bytes": c.nbytes,
                             "kvtier_us": med[kv_k] * 1e6, "base_us": med[base_k] * 1e6,
                             "routine_us": med[rt_k] * 1e6, "ratio": med[base_k] / med[kv_k],
                             "routine_ratio": med[base_k] / med[rt_k], "reps": len(t[kv_k])})
                if args.progress:
                    r = rows[-1]
                    print(f"  {r['path']}: {r['ratio']:.3f} (routine {r['routine_ratio']:.3f})", flush=True)
        finally:
            c.close()
    return rows


def lookup_rows(args, socket: str, label: str = "") -> list[dict]:
    e = bc.Engine(socket, max(args.lookup_sizes))
    stored = bc.hashes(max(args.lookup_sizes))
    e.store(stored)
    rows = []
    try:
        for n in args.lookup_sizes:
            r = bc.latency_point(args, e, stored[:n], bc.hashes(n))
            rows.append({"path": f"lookup {n} hashes{label}, p50", "kvtier_us": r["hit_p50_us"],
                         "base_us": r["bare_p50_us"], "ratio": r["hit_vs_bare_p50"],
                         "miss_us": r["miss_p50_us"], "reps": r["reps"]})
            if args.progress:
                print(f"  lookup {n}{label}: {r['hit_p50_us']:.0f} vs {r['bare_p50_us']:.0f} us", flush=True)
    finally:
        e.close()
    return rows


def throughput_rows(args, socket: str, label: str = "") -> list[dict]:
    rows = bc.throughput_sweep(args, socket)
    return [{"path": f"{r['hashes']}-hash lookups/s, {r['clients']} clients{label}", "kvtier_rps": r["kvtier_rps"],
             "base_rps": r["bare_rps"], "ratio": r["kvtier_vs_bare"]} for r in rows]


def render(report: dict) -> list[str]:
    cp = [[r["path"], r["baseline"], bl.short_size(r["bytes"]), r["kvtier_us"], r["routine_us"], r["base_us"],
           r["ratio"], r["routine_ratio"]] for r in report["copy"]]
    lk = [[r["path"], r["kvtier_us"], r["miss_us"], r["base_us"], r["ratio"]] for r in report["lookup"]]
    tp = [[r["path"], r["kvtier_rps"], r["base_rps"], r["ratio"]] for r in report["throughput"]]
    return [
        bl.table(["path", "baseline", "bytes", "kvtier us", "routine us", "baseline us", "baseline/kvtier",
                  "baseline/routine"], cp,
                 "Per-layer copies: store/load through the daemon vs in-process baseline (medians, interleaved)"),
        bl.table(["path", "hit us", "miss us", "bare echo us", "kvtier/echo"], lk,
                 "Lookup latency vs a bare ZeroMQ echo of the same frame (p50, interleaved)"),
        bl.table(["path", "kvtier req/s", "bare echo req/s", "kvtier/echo"], tp,
                 "Lookup throughput from several client processes (alternating slices)"),
    ]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter reps")
    p.add_argument("--pieces", type=bl.size_list, default=bl.size_list("512,1KiB,2KiB"),
                   help="piece sizes of the scattered rows")
    p.add_argument("--lookup-sizes", type=bl.int_list, default=[1000, 4096])
    p.add_argument("--clients", type=bl.int_list, default=[8], help="client processes for the throughput row")
    p.add_argument("--tput-hashes", type=int, default=32)
    p.add_argument("--duration", type=float, default=None, help="seconds per throughput side")
    p.add_argument("--slices", type=int, default=3)
    p.add_argument("--min-time", type=float, default=None, help="timed seconds per measurement")
    p.add_argument("--min-reps", type=int, default=30)
    p.add_argument("--max-reps", type=int, default=3000)
    p.add_argument("--threads", type=int, default=1, help="torch threads here and in the daemon")
    p.add_argument("--only", default="copy,lookup,throughput", type=lambda s: s.split(","))
    p.add_argument("--progress", action="store_true")
    bl.add_json_flag(p)
    a = p.parse_args(argv)
    a.duration = a.duration or (1.5 if a.quick else 4.0)
    a.min_time = a.min_time if a.min_time is not None else (0.15 if a.quick else 0.5)
    return a


def main(argv=None) -> int:
    args = parse(argv)
    env = bl.use_threads(args.threads)
    report = {"bench": "engine", "threads": args.threads, "copy": [], "lookup": [], "throughput": []}
    with PrivateDaemon("512MiB", "8MiB", env=env) as d:
        if "copy" in args.only:
            report["copy"] = copy_rows(args, d.socket)
        if "lookup" in args.only:
            report["lookup"] = lookup_rows(args, d.socket)
        if "throughput" in args.only:
            report["throughput"] = throughput_rows(args, d.socket)
    # The same rows with the daemon's lookup mirror on (config lookup_index): the
    # client answers from shared memory, no round trip.
    with PrivateDaemon("512MiB", "8MiB", env={**env, "KVTIER_LOOKUP_INDEX": "true"}) as d:
        if "lookup" in args.only:
            report["lookup"] += lookup_rows(args, d.socket, " (lookup_index on)")
        if "throughput" in args.only:
            report["throughput"] += throughput_rows(args, d.socket, " (lookup_index on)")
    report["machine"] = bl.machine_notes()
    report["commit"] = os.popen(f"git -C {bl.REPO} rev-parse --short HEAD 2>/dev/null").read().strip()
    bl.emit(report, render(report), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
