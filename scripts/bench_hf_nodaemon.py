#!/usr/bin/env python
# Feeds BENCHMARKS.md section 11.
"""What kvtier's HF integration does, and costs, when no daemon is at its socket (and when lookups miss).

    python scripts/bench_hf_nodaemon.py [--runs 7] [--json PATH]      (~3 min)

The no-reuse workload of ``scripts/bench_hf.py`` (24 new prompts of 64-192
tokens, 32 new each, a cache that holds them all; random Llama hidden 256,
4 layers, 1 torch thread), in one process, four ways interleaved run by run:

* ``plain``    - HF's ``ContinuousBatchingManager``;
* ``memfd``    - the same, its paged cache moved into a memfd by
                 ``adopt_tensors`` (kvtier's memory placement, no kvtier calls);
* ``nodaemon`` - ``KVTierContinuousBatchingManager``, nothing at its socket;
* ``tier``     - the same with a private daemon (every lookup misses, every
                 finished request's blocks are stored).

Each is timed from submitting the requests to the last result (wall and
this process's CPU seconds), engine start and stop outside, as in
bench_hf.py. Three tables:

1. **Start**: the batch processor's creation (HF allocating its paged cache,
   plus, for kvtier, what ``_attach`` adds), which HF runs on its generation
   thread after ``start()`` (bench_hf.py waits for it before timing).
2. **Per step**: in the ``nodaemon`` and ``tier`` runs, every kvtier hook HF calls,
   counted and timed (its own time, HF's work inside it excluded), and the
   client's keeper-thread wake-ups; per generation step and per run.
3. **Runs**: tokens/s of each way and its ratio to ``plain`` in the same
   round (median of the per-round ratios), wall and CPU; and the CPU time
   of HF's forward steps alone (the generation thread's own CPU clock, so
   other jobs' load barely moves it): memfd vs anonymous pages under the
   same attention.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager  # noqa: E402

import benchlib as bl  # noqa: E402
from bench_hf import MODEL_ID, PAGE, build_model, cb_config, greedy, prompts, started  # noqa: E402
from kvtier.client import keeper as keeper_mod  # noqa: E402
from kvtier.demo.daemon_proc import PrivateDaemon  # noqa: E402
from kvtier.integrations.transformers import KVTierContinuousBatchingManager, scheduler, tier  # noqa: E402
from kvtier.transfer.adopt import adopt_tensors  # noqa: E402


class MemfdManager(ContinuousBatchingManager):
    """Plain HF with its paged cache in a memfd, as kvtier's attach leaves it."""

    def _create_batch_processor(self):
        fresh = getattr(self, "batch_processor", None) is None
        processor = super()._create_batch_processor()
        if fresh:
            self.adopted = adopt_tensors([processor.cache.cache_tensor])
        return processor


# ---- counting the hooks ---------------------------------------------------------------------
class Meter:
    """Counts calls and each metered function's own time: time in nested metered
    calls and in HF's methods it calls is excluded (each thread keeps its own stack)."""

    def __init__(self):
        self.calls: dict[tuple, int] = defaultdict(int)     # (way, hook) -> calls
        self.own: dict[tuple, float] = defaultdict(float)   # (way, hook) -> own seconds
        self._local = threading.local()
        self.on = ""  # the way being measured ("": off)

    def _frame(self, fn, label: str | None):
        meter = self

        def framed(*a, **kw):
            stack = getattr(meter._local, "stack", None)
            if stack is None:
                stack = meter._local.stack = []
            if not meter.on or (label is None and not stack):
                return fn(*a, **kw)
            stack.append(0.0)  # time spent in nested frames
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                total = time.perf_counter() - t
                nested = stack.pop()
                if label is not None:  # a kvtier hook: record its own time
                    meter.calls[meter.on, label] += 1
                    meter.own[meter.on, label] += total - nested
                if stack:
                    stack[-1] += total

        return framed

    def wrap(self, owner, name: str, label: str) -> None:
        setattr(owner, name, self._frame(getattr(owner, name), label))

    def hf(self, owner, name: str) -> None:
        """HF's own method, called from a kvtier override: its time is not kvtier's."""
        setattr(owner, name, self._frame(getattr(owner, name), None))


def meter_hooks() -> Meter:
    from transformers.generation.continuous_batching.scheduler import FIFOScheduler
    m = Meter()
    m.hf(FIFOScheduler, "schedule_batch")
    m.hf(FIFOScheduler, "_infer_request_tokens")
    m.hf(FIFOScheduler, "finish_request")
    S, T = scheduler.KVTierScheduler, tier.HFKVTier
    m.wrap(S, "schedule_batch", "scheduler.schedule_batch (step)")
    m.wrap(S, "_infer_request_tokens", "scheduler._infer_request_tokens")
    m.wrap(S, "finish_request", "scheduler.finish_request")
    m.wrap(S, "release_blocks", "scheduler.release_blocks")
    m.wrap(S, "_load_prefix", "scheduler._load_prefix")
    m.wrap(S, "_store", "scheduler._store")
    for name in ("prefix_keys", "lookup", "load", "store", "finished_stores", "offload", "restore"):
        m.wrap(T, name, f"tier.{name}")
    m.wrap(keeper_mod.Keeper, "_beat", "keeper thread wake-up (_beat)")
    return m


class Forwards:
    """Wall and CPU seconds (the generation thread's own) inside HF's model forward
    steps (``ContinuousBatchProcessor._generation_step``), summed per run."""

    def __init__(self):
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor
        self.wall = self.cpu = 0.0
        fn = ContinuousBatchProcessor._generation_step

        def timed(proc, *a, **kw):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(proc, *a, **kw)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.thread_time() - c

        ContinuousBatchProcessor._generation_step = timed

    def take(self) -> tuple[float, float]:
        out, self.wall, self.cpu = (self.wall, self.cpu), 0.0, 0.0
        return out


FORWARDS: Forwards | None = None
DAEMON: PrivateDaemon | None = None


# ---- the runs -------------------------------------------------------------------------------
def run_once(model, kind: str, inputs, blocks: int, new: int, socket: str, meter: Meter) -> tuple:
    if kind == "plain":
        mgr = ContinuousBatchingManager(model, greedy(new), cb_config(blocks))
    elif kind == "memfd":
        mgr = MemfdManager(model, greedy(new), cb_config(blocks))
    else:
        mgr = KVTierContinuousBatchingManager(model, greedy(new), cb_config(blocks), model_id=MODEL_ID,
                                              socket=socket if kind == "nodaemon" else DAEMON.socket)
    mgr.start()
    try:
        started(mgr)  # engine start outside the timed region, as in bench_hf.py
        meter.on = kind if kind in ("nodaemon", "tier") else ""
        t0, c0 = time.perf_counter(), time.process_time()
        ids = mgr.add_requests(inputs, max_new_tokens=new)
        done = {}
        while len(done) < len(ids):
            out = mgr.get_result(timeout=60)
            if out is None:
                raise RuntimeError(f"{kind} stalled")
            if out.is_finished():
                done[out.request_id] = out
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        meter.on = ""
    finally:
        mgr.stop(block=True)
        mgr.destroy()
    return [done[i].generated_tokens for i in ids], wall, cpu, FORWARDS.take()


def start_costs(model, blocks: int, socket: str, reps: int) -> dict:
    """Batch processor creation, plain vs kvtier with no daemon, interleaved (main thread, no loop)."""
    def plain():
        ContinuousBatchingManager(model, greedy(), cb_config(blocks))._create_batch_processor()

    def nodaemon():
        mgr = KVTierContinuousBatchingManager(model, greedy(), cb_config(blocks), model_id=MODEL_ID, socket=socket)
        mgr.batch_processor = None
        mgr.batch_processor = mgr._create_batch_processor()
        mgr._close_tier()

    def memfd():
        MemfdManager(model, greedy(), cb_config(blocks))._create_batch_processor()

    times = bl.round_robin({"plain HF": (plain, None), "kvtier, no daemon": (nodaemon, None),
                            "plain HF + memfd placement": (memfd, None)}, 1e9, min_reps=reps, max_reps=reps)
    return {k: {"median_ms": bl.median(v) * 1e3, "p90_ms": bl.pct(v, 90) * 1e3} for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--start-reps", type=int, default=15)
    bl.add_json_flag(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = build_model(args.hidden, args.layers)
    socket = os.path.join(tempfile.mkdtemp(), "absent.sock")
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g).tolist()
    blocks = sum(-(-(n + args.new_tokens) // PAGE) for n in lengths) + 16
    meter = meter_hooks()
    global FORWARDS
    FORWARDS = Forwards()
    kinds = ["plain", "memfd", "nodaemon", "tier"]
    global DAEMON
    DAEMON = PrivateDaemon(pool_size="1GiB", slab_size="16MiB", extra=tuple(bl.no_system_config()))
    for k in kinds:  # warm
        run_once(model, k, prompts(5, [64, 80]), 64, 4, socket, meter)
    meter.calls.clear()
    meter.own.clear()
    starts = start_costs(model, blocks, socket, args.start_reps)
    load0 = os.getloadavg()[0]
    res = {k: {"wall": [], "cpu": [], "fwd_wall": [], "fwd_cpu": []} for k in kinds}
    for r in range(args.runs):
        inputs = prompts(1000 + r, lengths)
        toks = {}
        for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            toks[k], wall, cpu, (fwd_wall, fwd_cpu) = run_once(model, k, inputs, blocks, args.new_tokens, socket,
                                                                meter)
            for key, v in (("wall", wall), ("cpu", cpu), ("fwd_wall", fwd_wall), ("fwd_cpu", fwd_cpu)):
                res[k][key].append(v)
        if not toks["plain"] == toks["memfd"] == toks["nodaemon"] == toks["tier"]:
            sys.exit("tokens differ between the ways")
    load1 = os.getloadavg()[0]
    DAEMON.stop()
    generated = args.requests * args.new_tokens
    step_label = "scheduler.schedule_batch (step)"
    steps = meter.calls["nodaemon", step_label]
    walls = {w: statistics.median(res[w]["wall"]) for w in ("nodaemon", "tier")}
    labels = sorted({label for _, label in meter.calls}, key=lambda lb: -meter.own["nodaemon", lb])
    rows = []
    for label in labels + ["all of kvtier's hooks"]:
        row = [label]
        for way in ("nodaemon", "tier"):
            if label in labels:
                n, own = meter.calls[way, label], meter.own[way, label]
            else:
                n, own = 0, sum(v for (w, _), v in meter.own.items() if w == way)
            row += [n / args.runs if n else "", own / n * 1e6 if n else "", own / args.runs * 1e3,
                    100 * own / args.runs / walls[way]]
        rows.append(row)
    run_rows = []
    for k in kinds:
        ratios = [res["plain"]["wall"][i] / res[k]["wall"][i] for i in range(args.runs)]
        cratios = [res["plain"]["cpu"][i] / res[k]["cpu"][i] for i in range(args.runs)]
        fratios = [res[k]["fwd_cpu"][i] / res["plain"]["fwd_cpu"][i] for i in range(args.runs)]
        run_rows.append([k, generated / statistics.median(res[k]["wall"]), statistics.median(ratios),
                         " ".join(f"{x:.3f}" for x in ratios), statistics.median(res[k]["cpu"]),
                         statistics.median(cratios), statistics.median(res[k]["fwd_cpu"]),
                         statistics.median(fratios), " ".join(f"{x:.3f}" for x in fratios)])
    title = (f"{args.requests} prompts of {args.prompt_min}-{args.prompt_max} tokens x {args.new_tokens} new, "
             f"{blocks} blocks, {args.runs} rounds (load average {load0:.1f} -> {load1:.1f})")
    tables = [bl.table(["batch processor creation", "median ms", "p90 ms"],
                       [[k, v["median_ms"], v["p90_ms"]] for k, v in starts.items()],
                       f"start (interleaved, {args.start_reps} each; on HF's generation thread after start())"),
              bl.table(["kvtier hook", "no daemon: calls per run", "us per call", "ms per run", "% of the run",
                        "daemon, misses: calls per run", "us per call", "ms per run", "% of the run"], rows,
                       f"per step: {steps / args.runs:.0f} generation steps per run; run medians "
                       f"{walls['nodaemon']:.3f} s (no daemon), {walls['tier']:.3f} s (daemon)"),
              bl.table(["way", "tokens/s median", "vs plain (median of rounds)", "per round", "CPU s median",
                        "CPU vs plain", "forward CPU s", "forward CPU / plain's", "per round"], run_rows, title)]
    bl.emit({"start": starts, "hooks": {f"{w}: {k}": {"calls": n, "own_s": meter.own[w, k]}
                                        for (w, k), n in meter.calls.items() if n},
             "runs": res, "steps": steps, "args": vars(args)}, tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
