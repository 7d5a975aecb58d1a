# Feeds BENCHMARKS.md sections 8 and 11.
"""The fair engine benchmark for vLLM (CPU build): what kvtier costs an engine, and what a hit gains.

    python scripts/bench_vllm.py --neighbours quiet,busy,engine     # the BENCHMARKS.md section 8 table (~10 min)
    python scripts/bench_vllm.py --quick                             # a tiny smoke run (tests/e2e)

Engines alive side by side, each a separate process started and warmed before
anything is timed (``scripts/vllm_engine.py``), every one with the *same*
settings, printed and diffed at the start:

* ``alone``    - vLLM, no connector (the baseline of every ratio);
* ``tier``     - vLLM with kvtier's connector, daemon up;
* ``nodaemon`` - vLLM with kvtier's connector and no daemon at its socket.

Same settings means the OpenMP binding too: vLLM's CPU build reserves one
more core when *any* KV connector is configured, and on a 2-core machine that
flips its choice from 1 compute thread to 2 (the ~235 vs ~430 ms of issue 26).
The script pins ``VLLM_CPU_OMP_THREADS_BIND`` (``--omp-bind``, default: what
vLLM picks without a connector) on every engine.

Every engine's KV cache is written once and a few prompts run through it
before timing. Rows (``--runs`` runs, each ``--prompts`` new prompts of
``--prefix-tokens`` + 32 tokens, TTFT = a 1-token generate), each prompt sent to
all the engines of its row back to back, the order rotating, so background
load hits every side alike:

* ``miss``     - tier: every lookup misses (each prompt is new), its blocks are stored;
* ``no daemon`` - nodaemon;
* ``hit``      - tier: vLLM's own prefix cache dropped, a prompt stored earlier (loaded from kvtier);
* ``killed``   - tier after its daemon was SIGKILLed mid-run (last, once per run);
* throughput   - 8 new 1,024-token prompts x 32 output tokens in one ``generate``.

Neighbours (``--neighbours``, each a block of runs in the same invocation):
``quiet`` (nothing added), ``busy`` (a busy-loop process on the cores), ``engine``
(another vLLM engine prefilling new prompts the whole time: two engines at once).
Output: median / p90 / max TTFT per row and its ratio against ``alone`` in the
same runs, the machine's load average during each block.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from benchlib import add_json_flag, emit, median, pct, start_daemon, table
from vllm_procs import (SETTINGS_NOT_COMPARED, Engine, Neighbour, Prompts, compute_threads, default_bind, ex,
                        interleave, settings_diff)


def miss_names(eng: dict) -> tuple:
    """The engines timed side by side on new prompts (``control``: vLLM alone in a second
    process, how far two identical engines drift apart: the resolution of every ratio)."""
    return ("alone", "tier", "nodaemon") + (("control",) if "control" in eng else ())


def one_block(args, eng: dict, prompts: Prompts, stored: list, times: dict, run: int) -> None:
    """One run: the miss / no-daemon rows, then the hit row."""
    for i in range(args.prompts):
        p = prompts.new()
        got = interleave(i + run, [(n, lambda e=eng[n]: e.ttft(p)) for n in miss_names(eng)])
        stored.append(p)
        for n, s in got.items():
            times.setdefault(f"{n}/miss-row", []).append(s)
    settle(eng["tier"], args.socket, prompts)
    before = eng["tier"].call("metrics").get("vllm:external_prefix_cache_hits", 0)
    for i in range(args.prompts):
        p, hit = prompts.new(), stored.pop(0)
        for e in (eng["alone"], eng["tier"]):
            e.call("reset")  # untimed: the next request can only hit kvtier
        got = interleave(i + run, [("alone", lambda: eng["alone"].ttft(p)), ("tier", lambda: eng["tier"].ttft(hit))])
        times.setdefault("alone/hit-row", []).append(got["alone"])
        times.setdefault("tier/hit-row", []).append(got["tier"])
    hits = eng["tier"].call("metrics").get("vllm:external_prefix_cache_hits", 0) - before
    times.setdefault("hit_tokens", []).append(hits / (args.prompts * len(p)))


def settle(tier: Engine, socket: str, prompts: Prompts, timeout: float = 120) -> None:
    """Untimed: let the miss rows' stores reach the pool before the hit row asks for them.
    vLLM hands a finished request's stores to the worker at its next step, so one short
    request goes first; then wait until the daemon writes nothing and holds no transfer."""
    from kvtier.client import Client
    tier.ttft(prompts.new(40))
    deadline = time.monotonic() + timeout
    with Client(socket, name="bench-settle") as c:
        while time.monotonic() < deadline:
            st = c.stats()
            if not any(n["writing"] for n in st["namespaces"]) and not any(
                    x["inflight"] for x in st["clients"] if x["name"] != "bench-settle"):
                return
            time.sleep(0.05)
    print("  warning: the daemon was still storing after 120 s; hit rows may miss", flush=True)


def throughput(args, eng: dict, names: tuple, prompts: Prompts, rows: dict, run: int) -> None:
    batch = [prompts.new(args.tp_tokens) for _ in range(args.tp_prompts)]
    got = interleave(run, [(n, lambda e=eng[n]: e.call("generate", prompts=batch, max_tokens=args.tp_out)["s"])
                           for n in names])
    for n, s in got.items():
        rows.setdefault(n, []).append(args.tp_prompts * args.tp_out / s)


def stat_row(label: str, base: list[float], xs: list[float], per_run: list[float]) -> list:
    return [label, round(median(xs) * 1e3, 1), round(pct(xs, 90) * 1e3, 1), round(max(xs) * 1e3, 1),
            round(median(base) * 1e3, 1), round(median(xs) / median(base), 3), round(max(xs) / median(base), 2),
            " ".join(f"{r:.2f}" for r in per_run)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=5, help="new prompts per row per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--neighbours", default="quiet", help="comma list of quiet, busy, engine")
    ap.add_argument("--omp-bind", default=default_bind(),
                    help="VLLM_CPU_OMP_THREADS_BIND for every engine (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tp-prompts", type=int, default=8)
    ap.add_argument("--tp-tokens", type=int, default=1024)
    ap.add_argument("--tp-out", type=int, default=32)
    ap.add_argument("--control", action="store_true",
                    help="a second vLLM-alone engine timed like the others (rows 'control'): the noise floor")
    ap.add_argument("--tp-layout", default="", help="kvtier_tp_layout of the kvtier engines (shared, per-rank)")
    ap.add_argument("--no-killed", action="store_true", help="skip the daemon-killed rows")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--profile", metavar="DIR", default="",
                    help="py-spy (on PATH or --py-spy) records the kvtier engines' processes and the daemon "
                         "over the timed blocks into DIR (summarise: scripts/profile_summary.py DIR)")
    ap.add_argument("--py-spy", default="py-spy")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.prompts, args.runs, args.layers, args.hidden = 256, 2, 1, 2, 128
        args.warmup, args.tp_prompts, args.tp_tokens, args.tp_out = 1, 2, 128, 4
    neighbours = [n for n in args.neighbours.split(",") if n]
    if not set(neighbours) <= {"quiet", "busy", "engine"}:
        ap.error("--neighbours: quiet, busy, engine")
    prompt_len = args.prefix_tokens + args.suffix_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = ex.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)
        socket = args.socket = os.path.join(tmp, "kvtier.sock")
        daemon = start_daemon(socket, "2GiB", env=ex.engine_env())
        layout = ["--tp-layout", args.tp_layout] if args.tp_layout else []
        specs = {"alone": [], "tier": ["--kvtier", "--socket", socket, *layout],
                 "nodaemon": ["--kvtier", "--socket", os.path.join(tmp, "absent.sock")]}
        if args.control:
            specs["control"] = []
        if "engine" in neighbours:
            specs["neighbour"] = []
        eng = {n: Engine(n, model, args, extra, tmp) for n, extra in specs.items()}
        try:
            report = measure(args, eng, daemon, neighbours, prompt_len)
        finally:
            for e in eng.values():
                e.close()
            if daemon.poll() is None:
                daemon.terminate()
                daemon.wait(30)
    emit(report, report.pop("_tables"), args.json)
    return 0


def measure(args, eng: dict, daemon, neighbours: list[str], prompt_len: int) -> dict:
    t_start = time.time()
    for e in eng.values():
        e.wait_ready()
    timed = miss_names(eng)
    diff = settings_diff([eng[n] for n in timed])
    print(f"engines up in {time.time() - t_start:.0f} s; VLLM_CPU_OMP_THREADS_BIND={args.omp_bind} on every engine",
          flush=True)
    for n in timed:
        print(f"  {n:9s} compute threads {compute_threads(eng[n])}", flush=True)
    common = {k: v for k, v in eng["alone"].ready["settings"].items() if k not in SETTINGS_NOT_COMPARED}
    print(f"  resolved settings (alone; the others equal but for the diff below): {json.dumps(common)}")
    print(f"  resolved settings that differ ({' / '.join(timed)}):" + ("" if diff else " none"))
    for k, vals in diff:
        print(f"    {k}: " + " / ".join(json.dumps(v) for v in vals))
    prompts = Prompts(prompt_len, seed=1)
    for e in eng.values():  # the KV cache written once, then a few prompts through every engine
        e.call("touch_kv")
        for _ in range(args.warmup):
            e.ttft(prompts.new())
        e.call("reset")
    throughput(args, eng, timed, prompts, {}, 0)  # warm the batched path too
    spies = profile(args, eng, daemon) if args.profile else []
    blocks, tp_blocks, loads = {}, {}, {}
    for nb in neighbours:
        times, per_run, tp, stored = {}, [], {}, []
        load0 = os.getloadavg()[0]
        with Neighbour(nb, eng.get("neighbour"), prompt_len) as _n:
            for run in range(args.runs):
                t = {}
                one_block(args, eng, prompts, stored, t, run)
                throughput(args, eng, timed, prompts, tp, run)
                for k, v in t.items():
                    times.setdefault(k, []).extend(v)
                per_run.append(t)
            loads[nb] = (load0, os.getloadavg()[0])
        blocks[nb], tp_blocks[nb] = (times, per_run), tp
        print(f"  block '{nb}' done (load average {loads[nb][0]:.1f} -> {loads[nb][1]:.1f})", flush=True)
    killed, tp_kill = {}, {}
    if not args.no_killed:
        daemon.send_signal(signal.SIGKILL)  # mid-run: tier's client had a live connection
        daemon.wait()
        for run in range(args.runs):
            for i in range(args.prompts):
                p = prompts.new()
                got = interleave(i + run, [(n, lambda e=eng[n]: e.ttft(p)) for n in ("alone", "tier")])
                for n, s in got.items():
                    killed.setdefault(n, []).append(s)
        throughput(args, eng, ("alone", "tier"), prompts, tp_kill, 0)
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(120)
    return report(args, eng, blocks, tp_blocks, loads, killed, tp_kill, diff, prompt_len)


def profile(args, eng: dict, daemon) -> list[subprocess.Popen]:
    """One ``py-spy record`` per process, with thread names, sampled without pausing the target:
    the daemon on-CPU only (what its copies take from the cores), the engines' scheduler and
    worker processes idle included (``*-wall``: where their wall time goes, waits too)."""
    os.makedirs(args.profile, exist_ok=True)
    targets = {"daemon-cpu": daemon.pid}
    for n in ("alone", "tier", "nodaemon"):
        pids = eng[n].ready["settings"]["pids"]
        targets[f"{n}-scheduler-wall"], targets[f"{n}-worker-wall"] = pids["engine_core"], pids["worker"]
    return [subprocess.Popen([args.py_spy, "record", "--pid", str(pid), "--format", "raw", "--threads",
                              "--nonblocking", "--rate", "100", "-o", os.path.join(args.profile, f"{name}.txt"),
                              *(["--idle"] if name.endswith("-wall") else [])],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(args.profile, f"{name}.log"), "w"))
            for name, pid in targets.items()]


def report(args, eng, blocks, tp_blocks, loads, killed, tp_kill, diff, prompt_len) -> dict:
    headers = ["row", "median ms", "p90 ms", "max ms", "alone median ms", "median ratio", "max / alone median",
               "per-run median ratios"]
    tables, out = [], {"settings": {n: eng[n].ready["settings"] for n in ("alone", "tier", "nodaemon")},
                       "settings_diff": diff, "omp_bind": args.omp_bind, "prompt_tokens": prompt_len,
                       "blocks": {}}

    def ratios(per_run, key, base):
        return [median(r[key]) / median(r[base]) for r in per_run]

    for nb, (times, per_run) in blocks.items():
        rows = [stat_row("miss (daemon up)", times["alone/miss-row"], times["tier/miss-row"],
                         ratios(per_run, "tier/miss-row", "alone/miss-row")),
                stat_row("no daemon", times["alone/miss-row"], times["nodaemon/miss-row"],
                         ratios(per_run, "nodaemon/miss-row", "alone/miss-row")),
                *([stat_row("control: vLLM alone, second process", times["alone/miss-row"],
                            times["control/miss-row"], ratios(per_run, "control/miss-row", "alone/miss-row"))]
                  if "control" in eng else []),
                stat_row("hit (loaded from kvtier)", times["alone/hit-row"], times["tier/hit-row"],
                         ratios(per_run, "tier/hit-row", "alone/hit-row"))]
        tp = tp_blocks[nb]
        for n, label in (("tier", "throughput, miss"), ("nodaemon", "throughput, no daemon"),
                         ("control", "throughput, control")):
            if n not in tp:
                continue
            rows.append([label, "", "", "", "", round(median(tp[n]) / median(tp["alone"]), 3), "",
                         " ".join(f"{a / b:.2f}" for a, b in zip(tp[n], tp["alone"]))])
        title = (f"neighbour: {nb} (load average {loads[nb][0]:.1f} -> {loads[nb][1]:.1f}); {args.runs} runs x "
                 f"{args.prompts} prompts of {prompt_len} tokens; throughput ratio = tokens/s vs alone "
                 f"({median(tp['alone']):.0f} tok/s alone); the hit row's prompt tokens vLLM counted as kvtier "
                 f"hits: {' '.join(f'{h:.0%}' for h in times['hit_tokens'])} per run")
        tables.append(table(headers, rows, title))
        out["blocks"][nb] = {"load": loads[nb], "rows": [dict(zip(headers, r)) for r in rows],
                             "hit_token_share": times["hit_tokens"],
                             "ttft_s": times, "throughput_tok_s": tp}
    if killed:
        rows = [stat_row("daemon killed mid-run", killed["alone"], killed["tier"], [])]
        rows.append(["throughput, daemon killed", "", "", "", "",
                     round(median(tp_kill["tier"]) / median(tp_kill["alone"]), 3), "", ""])
        tables.append(table(headers, rows, "after SIGKILL of the daemon (neighbour: as the last block)"))
        out["killed"] = {"rows": [dict(zip(headers, r)) for r in rows], "ttft_s": killed,
                         "throughput_tok_s": tp_kill}
    m = eng["tier"].call("metrics")
    out["tier_metrics"] = m
    tables.append(f"tier engine counters: {json.dumps(m)}")
    return {**out, "_tables": tables}


if __name__ == "__main__":
    sys.exit(main())
