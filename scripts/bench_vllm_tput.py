# Feeds BENCHMARKS.md section 8.
"""Issue 26's open row: vLLM's batched throughput with a KV connector, A/B'd one thing at a time.

    python scripts/bench_vllm_tput.py --rounds 8

Engines alive side by side (``vllm_procs.Engine``, the same settings and OpenMP
binding on every one), each round the same batch of ``--tp-prompts`` new
``--tp-tokens``-token prompts x ``--tp-out`` output tokens sent to every engine
in turn, the order rotating; tokens/s per engine, ratio = median of per-round
ratios to ``alone``:

* ``alone``    - vLLM, no connector (the baseline);
* ``control``  - vLLM alone, a second process (the noise floor; ``control2``, ``adopted2``, ...: more of a kind);
* ``adopted``  - vLLM alone with its KV cache moved into a sealed memfd as
  kvtier's worker does (no connector): kvtier's memory placement only;
* ``nodaemon`` - vLLM with kvtier's connector and no daemon at its socket;
* ``tier``     - vLLM with kvtier's connector, daemon up (every lookup misses, every block
  is stored; each tier engine has a daemon of its own): the daemons' CPU seconds over the
  rounds are printed next to the rounds' wall time, what their stores took from the cores.

Each engine's resolved KV mapping (anonymous or memfd, huge pages) is printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from vllm_procs import Engine, Prompts, default_bind, interleave
from benchlib import REPO, median, start_daemon

sys.path.insert(0, os.path.join(REPO, "client"))
import vllm_offline as ex  # noqa: E402


def cpu_delta(before: list, after: list) -> dict:
    """CPU seconds per thread name (summed) between two ``threads`` answers, the busy ones."""
    out: dict[str, float] = {}
    for name, _cpus, s in after:
        out[name] = out.get(name, 0) + s
    for name, _cpus, s in before:
        out[name] = out.get(name, 0) - s
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.05}


def spy(args, eng: dict) -> list[subprocess.Popen]:
    os.makedirs(args.spy, exist_ok=True)
    out = []
    for n, e in eng.items():
        for role, pid in e.ready["settings"]["pids"].items():
            out.append(subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--threads", "--nonblocking",
                 "--rate", "100", "-o", os.path.join(args.spy, f"{n}-{role}.txt")],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.spy, f"{n}-{role}.log"), "w")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="max_model_len - 256, as bench_vllm")
    ap.add_argument("--tp-prompts", type=int, default=8)
    ap.add_argument("--tp-tokens", type=int, default=1024)
    ap.add_argument("--tp-out", type=int, default=32)
    ap.add_argument("--omp-bind", default=default_bind())
    ap.add_argument("--engines", default="alone,control,adopted,nodaemon")
    ap.add_argument("--spy", default="", metavar="DIR",
                    help="py-spy (--py-spy) records on-CPU samples of every engine's processes over the rounds")
    ap.add_argument("--py-spy", default="py-spy")
    args = ap.parse_args(argv)
    names = args.engines.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = ex.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)
        kind = {n: n.rstrip("0123456789") for n in names}  # control2, adopted2, ...: more of a kind
        # Every tier engine gets a daemon of its own: the batch each round is the same
        # for every engine, so a second engine on one daemon would hit the first's stores.
        daemons = {n: start_daemon(os.path.join(tmp, f"{n}.sock"), "1GiB", env=ex.engine_env())
                   for n in names if kind[n] == "tier"}
        extra = {"alone": [], "control": [], "adopted": [],
                 "nodaemon": ["--kvtier", "--socket", os.path.join(tmp, "absent.sock")]}
        extra.update({n: ["--kvtier", "--socket", os.path.join(tmp, f"{n}.sock")] for n in daemons})
        eng = {n: Engine(n, model, args, extra.get(n, extra.get(kind[n], [])), tmp) for n in names}
        try:
            for e in eng.values():
                e.wait_ready()
            for n in names:
                if kind[n] == "adopted":
                    print(f"{n}:", eng[n].call("adopt_kv"), flush=True)
            prompts = Prompts(1024, seed=1)
            for n, e in eng.items():
                e.call("touch_kv")
                for _ in range(2):
                    e.call("generate", prompts=[prompts.new(args.tp_tokens) for _ in range(args.tp_prompts)],
                           max_tokens=args.tp_out)
                kv = e.call("settings")["kv_cache"]["mapping"]
                print(f"  {n:9s} KV mapping {kv['names']} kB {kv['kB']}", flush=True)
            spies = spy(args, eng) if args.spy else []
            cpu0 = {n: e.call("threads") for n, e in eng.items()}
            tps: dict[str, list[float]] = {n: [] for n in names}
            load0 = os.getloadavg()[0]
            d_cpu0, wall = daemon_cpu(daemons), 0.0
            for r in range(args.rounds):
                batch = [prompts.new(args.tp_tokens) for _ in range(args.tp_prompts)]
                got = interleave(r, [(n, lambda e=eng[n]: e.call("generate", prompts=batch,
                                                                  max_tokens=args.tp_out)["s"]) for n in names])
                for n, s in got.items():
                    tps[n].append(args.tp_prompts * args.tp_out / s)
                    wall += s if kind[n] == "tier" else 0
                print(f"  round {r}: " + "  ".join(f"{n} {tps[n][-1]:.1f}" for n in names), flush=True)
            for p in spies:
                p.send_signal(signal.SIGINT)
                p.wait(60)
            for n, e in eng.items():
                print(f"  {n:9s} engine-core threads' CPU s over the rounds: {cpu_delta(cpu0[n], e.call('threads'))}")
            if daemons:
                d = daemon_cpu(daemons) - d_cpu0
                print(f"  daemons' CPU s over the rounds: {d:.2f}; their tier engines' batches took "
                      f"{wall:.2f} s wall x 2 cores: the daemons used {100 * d / (2 * wall):.1f}% of that core time")
            print(f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {args.rounds} rounds of "
                  f"{args.tp_prompts} x {args.tp_tokens} x {args.tp_out}")
            for n in names:
                ratios = [a / b for a, b in zip(tps[n], tps["alone"])]
                print(f"  {n:9s} {median(tps[n]):7.1f} tok/s  vs alone {median(ratios):.3f}  per round "
                      + " ".join(f"{x:.2f}" for x in ratios), flush=True)
            by_kind(names, kind, tps)
        finally:
            for e in eng.values():
                e.close()
            for d in daemons.values():
                d.terminate()
                d.wait(30)
    return 0


def by_kind(names: list[str], kind: dict, tps: dict) -> None:
    """With several processes of a kind (alone,alone2,...): each round's baseline is the
    median of the alone processes that round; a process's ratio is the median of its
    rounds' ratios; a kind's ratio is the median over its processes. One process of a
    kind runs up to 12% apart from another for a whole invocation (BENCHMARKS 8.4), so
    this is the row a +-3% target is judged on."""
    kinds = sorted(set(kind.values()), key=lambda k: (k != "alone", k))
    if all(sum(1 for n in names if kind[n] == k) < 2 for k in kinds):
        return
    base = [median([tps[n][r] for n in names if kind[n] == "alone"]) for r in range(len(tps[names[0]]))]
    print("  by kind (round baseline = median of the alone processes):")
    for k in kinds:
        per = sorted(median([a / b for a, b in zip(tps[n], base)]) for n in names if kind[n] == k)
        print(f"    {k:9s} {len(per)} processes  median {median(per):.3f}  processes "
              + " ".join(f"{x:.3f}" for x in per), flush=True)


def daemon_cpu(daemons: dict) -> float:
    """User + system CPU seconds of the daemon processes so far."""
    import psutil
    return sum(t.user + t.system for t in (psutil.Process(d.pid).cpu_times() for d in daemons.values()))


if __name__ == "__main__":
    sys.exit(main())
