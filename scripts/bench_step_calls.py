#!/usr/bin/env python3
# Feeds BENCHMARKS.md sections 11 and 15.
"""What kvtier's calls cost one engine step, in every state the daemon can be in.

One "step" is what a vLLM engine does per scheduling step for one new
2,048-token prompt that misses: a lookup of its 128 block keys, the submit
of an 8-block store and a ``done()`` poll of the previous step's store
(vLLM's ``get_finished``). Clients in every state live side by side in this
process and their steps are interleaved (``benchlib.round_robin``), next to
a bare ZeroMQ round trip of the lookup's frame in the same run:

  daemon, socket lookups   lookup_index off: one round trip per lookup
  daemon at nice -5        the same, the daemon as the systemd unit runs it
  daemon, mirror lookups   lookup_index on: the lookup reads shared memory
  no daemon                nothing at the socket path
  daemon killed            connected, then the daemon was SIGKILLed (its
                           socket file stays: what a restart looks like)
  no kvtier                the step's own work (making 128 keys), no call

``--busy N`` adds N processes spinning on the cores (a busy neighbour).
Then, separately: a client looking up every millisecond while its daemon is
SIGKILLed - the longest single call and how long until lookups answer 0.

``--layouts`` instead measures what the vLLM integration's own code costs a
step on a miss, per TP layout (``kvtier_tp_layout``), both layouts' steps
interleaved against one daemon, for ``bench_vllm.py``'s workload (random
8-layer Llama, hidden 512: 4 KV heads; 2,048+32-token prompts of new
prefixes; 32-token blocks = 65 chunks): the scheduler's path for one waiting
request (the connector's ``expect``, vLLM's ``lookup`` of the first chunk,
``on_schedule_end``) with new keys and with the same keys again (a request
still waiting), and a worker's ``submit_store`` of the 65 chunks plus one
``get_finished`` poll (and, separately, until the daemon's copy is done).
``per-rank`` sends one key per chunk, ``shared`` one per chunk and KV head.

    python scripts/bench_step_calls.py [--rounds 2000] [--busy 2] [--json PATH]
    python scripts/bench_step_calls.py --layouts [--rounds 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import tempfile
import time

import benchlib as bl

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.demo.daemon_proc import PrivateDaemon
from kvtier.protocol import messages as m
from kvtier.protocol.codec import encode

KEYS = 128          # 2,048 tokens / 16 per block
STORE = 8           # blocks a step stores
BLOCK = 256         # bytes per block: the calls, not the copy, are measured
NS = Namespace("bench-step", "uint8", "flat", 16)


class Engine:
    def __init__(self, socket: str, require: bool = True):
        import torch
        self.kv = ShmKVCache([(STORE, BLOCK)], torch.uint8)
        self.c = Client(socket, name="bench-step", require_daemon=require)
        self.c.register_kv_cache(self.kv, [0], NS)
        self.pending = None

    def step(self) -> None:
        keys = [os.urandom(16) for _ in range(KEYS)]
        self.c.lookup(keys)
        if self.pending is not None:
            self.pending.done()
        self.pending = self.c.store(keys[:STORE], list(range(STORE)))

    def settle(self) -> None:  # untimed: the previous store must not hold the blocks
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def close(self) -> None:
        self.settle()
        self.c.close()
        self.kv.close()


def spin() -> None:
    while True:
        pass


def states(rounds: int, busy: int) -> dict:
    """Every state's step, interleaved: quiet, then with ``busy`` spinners."""
    with PrivateDaemon(pool_size="64MiB", slab_size="4MiB") as plain, \
            PrivateDaemon(pool_size="64MiB", slab_size="4MiB", env={"KVTIER_LOOKUP_INDEX": "true"}) as mirrored, \
            PrivateDaemon(pool_size="64MiB", slab_size="4MiB") as doomed, \
            PrivateDaemon(pool_size="64MiB", slab_size="4MiB") as favoured, \
            bl.EchoServer(os.path.join(tempfile.mkdtemp(), "echo.sock"), len(encode(m.Hits(0), 1))) as echo:
        os.setpriority(os.PRIO_PROCESS, favoured.proc.pid, -5)  # what the unit's Nice=-5 does (root only)
        engines = {"daemon, socket lookups": Engine(plain.socket),
                   "daemon at nice -5, socket lookups": Engine(favoured.socket),
                   "daemon, mirror lookups": Engine(mirrored.socket),
                   "no daemon": Engine(os.path.join(tempfile.mkdtemp(), "absent.sock"), require=False),
                   "daemon killed": Engine(doomed.socket)}
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait()
        time.sleep(0.5)
        bare = bl.BareClient(echo.socket, len(encode(m.Lookup(1, os.urandom(16 * KEYS)), 123456)))
        cases = {name: (e.step, e.settle) for name, e in engines.items()}
        cases["no kvtier (the step's own key making)"] = (lambda: [os.urandom(16) for _ in range(KEYS)], None)
        cases["bare ZeroMQ round trip (lookup frame)"] = (bare.call, None)
        out = {"quiet": bl.round_robin(cases, 1e9, min_reps=rounds, max_reps=rounds)}
        spinners = [mp.Process(target=spin, daemon=True) for _ in range(busy)]
        for sp in spinners:
            sp.start()
        try:
            out["busy"] = bl.round_robin(cases, 1e9, min_reps=rounds, max_reps=rounds)
        finally:
            for sp in spinners:
                sp.kill()
        for e in engines.values():
            e.close()
        bare.close()
    return {load: {k: {"p50_us": bl.median(v) * 1e6, "p99_us": bl.pct(v, 99) * 1e6, "max_us": max(v) * 1e6,
                       "n": len(v)} for k, v in times.items()} for load, times in out.items()}


def kill_mid_run() -> dict:
    """Lookups every millisecond across a SIGKILL of the daemon."""
    with PrivateDaemon(pool_size="64MiB", slab_size="4MiB") as d:
        e = Engine(d.socket)
        keys = [os.urandom(16) for _ in range(KEYS)]
        for _ in range(200):
            e.c.lookup(keys)
        calls: list[tuple[float, float, bool]] = []
        end = time.monotonic() + 4.0
        killed_at = time.monotonic() + 1.0
        killed = False
        while time.monotonic() < end:
            if not killed and time.monotonic() >= killed_at:
                d.proc.send_signal(signal.SIGKILL)
                killed_at, killed = time.monotonic(), True
            t0 = time.monotonic()
            e.c.lookup(keys)
            calls.append((t0, time.monotonic() - t0, e.c.connected))
            time.sleep(0.001)
        after = [c for c in calls if c[0] >= killed_at]
        degraded = next((c[0] for c in after if not c[2]), None)
        e.c.close()
        e.kv.close()
    return {"longest_call_after_kill_ms": max(c[1] for c in after) * 1e3,
            "calls_after_kill": len(after),
            "degraded_after_ms": None if degraded is None else (degraded - killed_at) * 1e3}


# ---- vLLM TP layouts ----------------------------------------------------------------------
HEADS, HEAD_DIM, LAYERS, TOKENS, CHUNKS = 4, 64, 8, 32, 65     # bench_vllm.py's model and prompt
PAGE = 2 * TOKENS * HEADS * HEAD_DIM * 2                      # K and V, bf16: one layer of one block


class Layout:
    """A scheduler manager and a TP=1 worker of one ``kvtier_tp_layout``."""

    def __init__(self, socket: str, shared: bool):
        import torch
        from vllm.v1.kv_offload import base as vb
        from kvtier.integrations.vllm.groups import TierGroup
        from kvtier.integrations.vllm.manager import KVTierManager
        from kvtier.integrations.vllm.slices import PER_RANK, plan
        from kvtier.integrations.vllm.worker import KVTierWorker
        self.vb, self.shared, self.jobs = vb, shared, 0
        sl = plan(1, 0, HEADS, False, True) if shared else PER_RANK
        ns = (Namespace("bench-layout", "bfloat16", "vllm-LBHNC", TOKENS, extra=sl.tag()) if shared else
              Namespace("bench-layout", "bfloat16", "vllm-LBHNC", TOKENS, tp_rank=0, tp_size=1))
        self.manager = KVTierManager([TierGroup(0, ns, LAYERS * PAGE // sl.count, slices=sl)], 1, socket,
                                     name=f"sched-{'shared' if shared else 'per-rank'}")
        tensors = [torch.zeros(2 * CHUNKS, PAGE, dtype=torch.uint8) for _ in range(LAYERS)]
        caches = vb.CanonicalKVCaches(tensors=[vb.CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                      group_data_refs=[[vb.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
        self.worker = KVTierWorker(caches, ns, 1, socket, name=f"w-{'shared' if shared else 'per-rank'}", slices=sl)
        self.waiting = self.fresh = self.new_keys()
        self.pending: set[int] = set()

    def new_keys(self) -> list[bytes]:
        return [self.vb.make_offload_key(os.urandom(32), 0) for _ in range(CHUNKS)]

    def schedule(self, keys: list[bytes]) -> None:
        """What the scheduler's kvtier code does for one waiting request in one step."""
        ctx = self.vb.ReqContext(req_id="r")
        self.manager.expect("r", keys)  # the connector; vLLM's first lookup asks the daemon
        assert self.manager.lookup(keys[0], ctx) == self.vb.LookupResult.MISS  # vLLM stops at the first miss
        self.manager.on_schedule_end(None)

    def renew(self) -> None:  # untimed: vLLM hashes a new request's blocks
        self.fresh = self.new_keys()

    def store(self) -> None:
        """A step's store of the prompt's chunks, and vLLM's ``get_finished`` poll."""
        from kvtier.integrations.vllm.manager import KVTierSpecs
        from kvtier.integrations.vllm.naming import kvtier_key
        self.jobs += 1
        ids = list(range((self.jobs % 2) * CHUNKS, (self.jobs % 2 + 1) * CHUNKS))
        self.worker.submit_store(self.jobs, self.vb.GPULoadStoreSpec(ids, group_sizes=[CHUNKS], block_indices=[0]),
                                 KVTierSpecs([kvtier_key(k) for k in self.store_keys]))
        self.pending.add(self.jobs)
        self.pending -= {r.job_id for r in self.worker.get_finished()}

    def settle(self) -> None:  # untimed: the previous store is done, the next one's keys are made
        while self.pending:
            self.pending -= {r.job_id for r in self.worker.get_finished()}
            time.sleep(0.0002)
        self.store_keys = self.new_keys()

    def store_done(self) -> None:
        self.store()
        self.settle()

    def close(self) -> None:
        self.settle()
        self.manager.shutdown()
        self.worker.shutdown()


def interleaved(cases: dict, rounds: int) -> dict:
    """``bl.round_robin`` in batches of 10 rounds, the case order reversed every batch
    (whichever case runs first after another's work pays for it)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for b in range(0, rounds, 10):
        order = dict(reversed(cases.items())) if b // 10 % 2 else cases
        for k, v in bl.round_robin(order, 1e9, min_reps=min(10, rounds - b), max_reps=min(10, rounds - b)).items():
            times[k] += v
    return times


def layouts(rounds: int) -> dict:
    # One daemon per layout, as one engine sees it: one block size evicting its own (two
    # block sizes in one full pool would time slab reclaims between size classes).
    with PrivateDaemon(pool_size="256MiB", slab_size="4MiB") as d1, \
            PrivateDaemon(pool_size="256MiB", slab_size="4MiB") as d2:
        lay = {"per-rank": Layout(d1.socket, False), "shared": Layout(d2.socket, True)}

        def quiet(x=None):  # untimed: no store copying in the daemon while a lookup is timed
            for y in lay.values():
                y.settle()
            if x is not None:
                x.renew()

        cases = {}
        for name, x in lay.items():
            cases[f"scheduler, new request ({name})"] = (lambda x=x: x.schedule(x.fresh), lambda x=x: quiet(x))
        for name, x in lay.items():
            cases[f"scheduler, request still waiting ({name})"] = (lambda x=x: x.schedule(x.waiting), quiet)
        for name, x in lay.items():
            cases[f"worker, submit_store + poll ({name})"] = (x.store, x.settle)
        times = interleaved(cases, rounds)
        done = interleaved({f"worker, store until done ({n})": (x.store_done, x.settle) for n, x in lay.items()},
                           max(20, rounds // 10))
        keys = {n: x.manager.round_trips for n, x in lay.items()}
        for x in lay.values():
            x.close()
    return {"cases": {k: {"min_us": min(v) * 1e6, "p50_us": bl.median(v) * 1e6, "p99_us": bl.pct(v, 99) * 1e6,
                          "n": len(v)} for k, v in {**times, **done}.items()},
            "scheduler_round_trips": keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2000, help="steps of each case per load (interleaved)")
    p.add_argument("--busy", type=int, default=os.cpu_count(), help="spinning neighbours for the busy run")
    p.add_argument("--layouts", action="store_true", help="only the vLLM TP layouts' miss cost (see above)")
    bl.add_json_flag(p)
    args = p.parse_args()
    if args.layouts:
        report = {"machine": bl.machine_notes(), **layouts(args.rounds)}
        rows = [[k, v["min_us"], v["p50_us"], v["p99_us"], v["n"]] for k, v in report["cases"].items()]
        bl.emit(report, [bl.table(["one step, 65 chunks missing", "min us", "p50 us", "p99 us", "n"], rows,
                                  "vLLM integration per step: per-rank vs shared (head-sliced) TP layout")],
                args.json)
        return
    report = {"machine": bl.machine_notes(), **states(args.rounds, args.busy)}
    report["kill"] = kill_mid_run()
    rows = [[name, q["p50_us"], q["p99_us"], report["busy"][name]["p50_us"], report["busy"][name]["p99_us"]]
            for name, q in report["quiet"].items()]
    tables = [bl.table(["one step (lookup 128 + store 8 + poll)", "quiet p50 us", "quiet p99 us",
                        f"busy x{args.busy} p50 us", "busy p99 us"], rows, "kvtier calls per engine step"),
              bl.table(["daemon SIGKILLed mid-run", "value"], [[k, v] for k, v in report["kill"].items()])]
    bl.emit(report, tables, args.json)


if __name__ == "__main__":
    main()
