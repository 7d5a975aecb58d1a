"""kvtier side by side with its peers on vLLM's CPU build: LMCache's multi-process mode and
vLLM's own CPU offloading, each against vLLM alone, in one run.

    bash scripts/peers_venv.sh                                  # .venv-lmcache: vLLM CPU, LMCache 0.5.6, kvtier
    .venv-lmcache/bin/python scripts/bench_peers.py --out peers.json            # BENCHMARKS.md section 19
    .venv-lmcache/bin/python scripts/bench_peers.py --quick                     # one round, tiny prompts

Systems (``--systems``; ``scripts/peers_systems.py`` says how each starts):
``alone``, ``kvtier``, ``lmcache-lmcache_driven``, ``lmcache-engine_driven``,
``vllm-offload``, ``vllm-simple``. Each system has its own store (a private
kvtier daemon, a private LMCache server) and two engine processes, A (stores)
and B (a second process that should hit), every engine the same tiny random
Llama in bfloat16 with the same printed settings, all pinned to the same
``VLLM_CPU_OMP_THREADS_BIND``. A system whose engine vLLM cannot build on this
machine is reported with the exception it raised, and left out.

Rows, each round sending the same new prompt to every system back to back in
a rotating order (``--rounds``), with ``--gap`` seconds of idle before every
timed call (vLLM's CPU worker busy-polls for about a second after a request):

* (a) miss    - TTFT of a new prompt on A (every lookup misses, its blocks are stored);
* (b) hit     - TTFT of that prompt on B, a second process (vLLM alone: a prefill);
* (c) batched - tokens/s of ``--tp-prompts`` new prompts x ``--tp-out`` tokens on A;
* the service's CPU seconds over the timed rounds, the prompt tokens B counted as
  external hits;
* long prompts (``--long``, e.g. 8192): rows (a) and (b) at that length;
* concurrency (``--concurrent N``): N engine processes of a system asking for the
  same stored prompt at once (a barrier), TTFT p50 / max, one system at a time;
* pressure (``--trace EVERY``): sessions of a public prefix trace replayed through
  the engines, stores smaller than their working set (``scripts/peers_pressure.py``):
  prompt share served by the store, TTFT p50/p99, an offline LRU of the same size;
* disk (``--disk SIZE``): a hit from each system's local disk tier once its RAM tier
  was flooded (``scripts/peers_disk.py``);
* footprint: installed size of the packages each system adds to vLLM, resident
  memory of the service and per engine, start times.

Output: Markdown tables, medians and per-round ratios to vLLM alone, and
``--out FILE`` (JSON, every timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from benchlib import REPO

import peers_disk
import peers_footprint
import peers_pressure
import peers_systems as ps

sys.path.insert(0, os.path.join(REPO, "client"))
import vllm_offline  # noqa: E402
from vllm_procs import Prompts, default_bind, settings_diff  # noqa: E402

SHARED_STORE = ("kvtier", "lmcache-lmcache_driven", "lmcache-engine_driven")


class Bench:
    """The systems that started, their engines and services, and every timing taken."""

    def __init__(self, args, tmp: str):
        self.args, self.tmp = args, tmp
        self.services: dict[str, ps.Service] = {}
        self.engines: dict[str, dict[str, ps.Engine]] = {}
        self.skipped: dict[str, str] = {}
        self.prompts = Prompts(args.prefix_tokens + args.suffix_tokens, seed=1)
        self.times: dict[str, dict[str, list]] = {}

    # ---- start ---------------------------------------------------------------------
    def env(self) -> dict:
        env = vllm_offline.engine_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                                      VLLM_CPU_OMP_THREADS_BIND=self.args.omp_bind, **ps.NO_TRACKING)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only; --kv-bytes sizes every engine alike
        return env

    def start(self, model: str) -> None:
        a, env = self.args, self.env()
        transfers = {}
        for s in a.systems:
            try:
                transfers[s] = self._service(s, env)
            except (RuntimeError, OSError) as e:
                self.skipped[s] = f"its service did not start: {e}"
        length = self.max_len()
        for s, transfer in transfers.items():
            python = a.python if not s.startswith("lmcache") else ps.lmcache_python()
            roles = ("A", "B") if s in SHARED_STORE else ("A",)  # the others' hits are A's own
            self.engines[s] = {r: ps.Engine(s, r, python, model, transfer, env, self.tmp, a.kv_bytes, length)
                               for r in roles}
        for s in list(self.engines):
            for e in self.engines[s].values():
                if not e.wait_ready():
                    self.skipped[s] = e.failed
            if s in self.skipped:
                for e in self.engines.pop(s).values():
                    e.close()
        print(f"started: {', '.join(self.engines)}; left out: "
              + ("; ".join(f"{s} ({why})" for s, why in self.skipped.items()) or "none"), flush=True)

    def max_len(self) -> int:
        a = self.args
        trace = a.trace_cut * a.trace_block if a.trace else 0
        return max([a.prefix_tokens + a.suffix_tokens, trace, *(n + a.suffix_tokens for n in a.long)]) + 64

    def _service(self, s: str, env: dict) -> dict | None:
        a = self.args
        if s == "alone":
            return None
        if s == "kvtier":
            config = peers_disk.kvtier_config(self.tmp, a.disk) if a.disk else ""
            self.services[s], transfer = ps.start_kvtier(self.tmp, a.kvtier_pool, env, config)
            return transfer
        if s.startswith("lmcache-"):
            if ps.lmcache_python() is None:
                raise RuntimeError("no .venv-lmcache with LMCache (make it: bash scripts/peers_venv.sh)")
            mode = s.split("-", 1)[1]
            disk = peers_disk.lmcache_flags(self.tmp, mode) if a.disk else []
            self.services[s], transfer = ps.start_lmcache(self.tmp, mode, a.lmcache_l1_gb, env, disk)
            return transfer
        return ps.vllm_offload(s, a.offload_bytes)

    def print_settings(self) -> dict:
        engines = [e for es in self.engines.values() for e in es.values()]
        diff = settings_diff(engines)
        first = engines[0].ready["settings"]
        common = {k: v for k, v in first.items() if k not in ("threads", "pids")}
        print(f"VLLM_CPU_OMP_THREADS_BIND={self.args.omp_bind} on every engine; resolved settings (all engines):\n"
              f"  {json.dumps(common)}")
        print("settings that differ between engines:" + ("" if diff else " none (but the connector)"))
        for k, vals in diff:
            print(f"  {k}: " + " / ".join(json.dumps(v) for v in vals))
        return {"common": common, "diff": diff}

    # ---- timed calls -------------------------------------------------------------------
    def idle(self) -> None:
        time.sleep(self.args.gap)

    def record(self, row: str, system: str, value) -> None:
        self.times.setdefault(row, {}).setdefault(system, []).append(value)

    def order(self, r: int) -> list[str]:
        names = list(self.engines)
        k = r % len(names)
        return names[k:] + names[:k]

    def hit_engine(self, s: str) -> ps.Engine:
        """Who asks for a stored prompt: B where the store is shared between processes;
        vLLM alone and the in-process offloaders: A with vLLM's own prefix cache dropped."""
        es = self.engines[s]
        if s in SHARED_STORE:
            return es["B"]
        es["A"].call("reset")
        return es["A"]

    def miss_hit(self, r: int, tokens: int, tag: str) -> None:
        """Rows (a) and (b) for one new prompt of ``tokens`` tokens."""
        p = self.prompts.new(tokens)
        for s in self.order(r):
            self.idle()
            self.record(f"miss{tag}", s, self.engines[s]["A"].ttft(p))
        self.settle()
        for s in self.order(r):
            e = self.hit_engine(s)
            before = e.call("metrics").get("vllm:external_prefix_cache_hits", 0)
            self.idle()
            self.record(f"hit{tag}", s, e.ttft(p))
            self.record(f"hit_tokens{tag}", s, e.call("metrics").get("vllm:external_prefix_cache_hits", 0) - before)

    def settle(self) -> None:
        """Untimed: vLLM hands a finished request's stores to its worker at the next step, so
        each A runs one short request; then kvtier's daemon is asked until it writes nothing
        (LMCache has no such probe: the idle gaps before each hit give it the same time)."""
        for s in self.engines:
            self.engines[s]["A"].ttft(self.prompts.new(40))
        if "kvtier" in self.services:
            from kvtier.client import Client
            deadline = time.monotonic() + 60
            with Client(os.path.join(self.tmp, "kvtier.sock"), name="bench-settle") as c:
                while time.monotonic() < deadline and any(n["writing"] for n in c.stats()["namespaces"]):
                    time.sleep(0.05)

    def batched(self, r: int) -> None:
        a = self.args
        batch = [self.prompts.new(a.tp_tokens) for _ in range(a.tp_prompts)]
        for s in self.order(r):
            self.idle()
            got = self.engines[s]["A"].call("generate", prompts=batch, max_tokens=a.tp_out)
            self.record("tok_s", s, sum(map(len, got["tokens"])) / got["s"])

    def rounds(self) -> None:
        a = self.args
        for e in (e for es in self.engines.values() for e in es.values()):  # warm every engine
            for _ in range(a.warmup):
                e.ttft(self.prompts.new())
            e.call("reset")
        cpu0 = {s: svc.cpu_s() for s, svc in self.services.items()}
        self.load = [os.getloadavg()[0]]
        for r in range(a.rounds):
            self.miss_hit(r, a.prefix_tokens + a.suffix_tokens, "")
            self.batched(r)
            self.load.append(os.getloadavg()[0])
            print(f"  round {r + 1}/{a.rounds} done (load {self.load[-1]:.1f})", flush=True)
            self.checkpoint()
        self.service_cpu = {s: svc.cpu_s() - cpu0[s] for s, svc in self.services.items()}
        for n in a.long:
            for r in range(a.long_rounds):
                self.miss_hit(r, n, f"@{n}")
            self.load.append(os.getloadavg()[0])
            print(f"  {n}-token rows done (load {self.load[-1]:.1f})", flush=True)
            self.checkpoint()

    def checkpoint(self) -> None:
        """Every timing so far into ``--out`` (a run stopped halfway keeps its rounds)."""
        if self.args.out:
            with open(self.args.out, "w") as f:
                json.dump({"partial": True, "systems": list(self.engines), "skipped": self.skipped,
                           "load": self.load, "times": self.times}, f, indent=1)

    # ---- concurrency -----------------------------------------------------------------
    def concurrent(self, model: str) -> None:
        """N processes of one system ask for the same stored prompt at once; one system at a
        time (N engines of every system alive together would not fit in this machine's memory)."""
        a, env = self.args, self.env()
        length = self.max_len()
        for s in list(self.engines):
            es = self.engines[s]
            python = a.python if not s.startswith("lmcache") else ps.lmcache_python()
            extra = [ps.Engine(s, f"C{i}", python, model, es["A"].transfer, env, self.tmp, a.kv_bytes, length)
                     for i in range(a.concurrent - len(es))]
            try:
                if not all(e.wait_ready() for e in extra):
                    self.skipped[f"{s} x{a.concurrent}"] = next(e.failed for e in extra if e.failed)
                    continue
                group = [*es.values(), *extra]
                for e in extra:
                    e.ttft(self.prompts.new())
                for r in range(a.conc_rounds):
                    p = self.prompts.new()
                    es["A"].ttft(p)  # stored (alone: nothing to share, every engine prefills)
                    self.settle()
                    for e in group:
                        e.call("reset")
                    self.idle()
                    self.record("concurrent", s, at_once(group, p))
                print(f"  concurrency x{a.concurrent}: {s} done (load {os.getloadavg()[0]:.1f})", flush=True)
            finally:
                for e in extra:
                    e.close()


def at_once(engines: list[ps.Engine], prompt: list[int]) -> list[float]:
    """TTFT of ``prompt`` on every engine, all released by one barrier."""
    barrier, out = threading.Barrier(len(engines)), [0.0] * len(engines)

    def ask(i: int) -> None:
        barrier.wait()
        out[i] = engines[i].ttft(prompt)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from report_peers import report
    with tempfile.TemporaryDirectory(prefix="kvtier-peers-") as tmp:
        model = vllm_offline.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)
        bench = Bench(args, tmp)
        _longer_positions(model, bench.max_len())
        try:
            bench.start(model)
            if "alone" not in bench.engines:
                raise SystemExit("vLLM alone did not start: " + bench.skipped.get("alone", "?"))
            settings = bench.print_settings()
            bench.rounds()
            if args.trace:
                peers_pressure.replay(bench, SHARED_STORE)
            if args.disk:
                peers_disk.rounds(bench, SHARED_STORE, ps.kv_bytes_per_token(args))
            footprint = peers_footprint.measure(bench)
            if args.concurrent > 1:
                bench.concurrent(model)
        finally:
            for es in bench.engines.values():
                for e in es.values():
                    e.close()
            for svc in bench.services.values():
                svc.stop()
        out, tables = report(bench, settings, footprint)
    print("\n\n".join(tables))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _longer_positions(model: str, tokens: int) -> None:
    """The tiny Llama says 8,192 positions; longer prompts need the config to allow them."""
    path = os.path.join(model, "config.json")
    cfg = json.load(open(path))
    if cfg["max_position_embeddings"] < tokens:
        cfg["max_position_embeddings"] = tokens
        json.dump(cfg, open(path, "w"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(ps.ALL), help="comma list (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=0)
    ap.add_argument("--long", default="", help="comma list of long prompt lengths, e.g. 8192,32768")
    ap.add_argument("--long-rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=0, help="engines asking at once (0: no concurrency rows)")
    ap.add_argument("--conc-rounds", type=int, default=2)
    ap.add_argument("--trace", type=int, default=0, metavar="EVERY",
                    help="pressure row: replay the prefix trace's sessions whose first block id is a multiple of "
                         "EVERY (32: 129 requests; scripts/peers_pressure.py); 0: no trace row")
    ap.add_argument("--trace-cut", type=int, default=24, help="block ids kept of each trace request")
    ap.add_argument("--trace-block", type=int, default=256, help="tokens per trace block id")
    ap.add_argument("--disk", default="", metavar="SIZE",
                    help="disk row: kvtier's disk tier of SIZE and LMCache's file-system L2 under the run's "
                         "temporary directory, a hit after the RAM tier was flooded (scripts/peers_disk.py)")
    ap.add_argument("--disk-rounds", type=int, default=3)
    ap.add_argument("--tp-prompts", type=int, default=8)
    ap.add_argument("--tp-tokens", type=int, default=1024)
    ap.add_argument("--tp-out", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gap", type=float, default=1.2, help="idle seconds before each timed call")
    ap.add_argument("--kv-bytes", type=int, default=512 * 2**20, help="each engine's own KV cache")
    ap.add_argument("--kvtier-pool", default="1GiB")
    ap.add_argument("--lmcache-l1-gb", type=float, default=1.0)
    ap.add_argument("--offload-bytes", type=int, default=2**30, help="vLLM's own offloaders' CPU bytes")
    ap.add_argument("--omp-bind", default=default_bind(), help="VLLM_CPU_OMP_THREADS_BIND (default: %(default)s)")
    ap.add_argument("--python", default=ps.lmcache_python() or sys.executable,
                    help="interpreter of every engine (default: .venv-lmcache's when it exists, so all systems "
                         "run the same vLLM and torch)")
    ap.add_argument("--quick", action="store_true", help="one round, tiny prompts and model (the smoke test)")
    ap.add_argument("--out", default="", help="write every timing as JSON here")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(ps.ALL)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(ps.ALL)}")
    if "alone" not in args.systems:
        args.systems.insert(0, "alone")  # the baseline of every ratio
    args.long = [int(x) for x in args.long.split(",") if x]
    if args.quick:
        args.rounds, args.prefix_tokens, args.layers, args.hidden, args.warmup = 1, 256, 2, 128, 1
        args.tp_prompts, args.tp_tokens, args.tp_out, args.gap, args.kv_bytes = 2, 128, 4, 0.2, 64 * 2**20
        args.kvtier_pool, args.lmcache_l1_gb, args.offload_bytes = "256MiB", 0.25, 256 * 2**20
        args.trace_block = 32
        if args.disk:  # RAM tiers small enough to flood with tiny prompts
            args.kvtier_pool, args.lmcache_l1_gb = "16MiB", 0.016
    return args


if __name__ == "__main__":
    sys.exit(main())
