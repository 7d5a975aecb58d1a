"""Tables and JSON of ``scripts/bench_peers.py``: each row per system, its median and the
ratio to vLLM alone in the same run (the median's ratio, then each round's)."""

from __future__ import annotations

import json
import os
import subprocess

import peers_disk
import peers_pressure
from peers_systems import kv_bytes_per_token
from benchlib import REPO, median, pct, table

ROWS = (("miss", "(a) TTFT of a new prompt (miss), median ms", 1e3),
        ("hit", "(b) TTFT of that prompt in a second engine process (hit), median ms", 1e3),
        ("tok_s", "(c) batched tokens/s, every lookup missing", 1))


def versions(python: str) -> dict:
    code = ("import json, torch, vllm\nfrom importlib import metadata as m\nv = {'torch': torch.__version__, "
            "'vllm': vllm.__version__}\ntry: v['lmcache'] = m.version('lmcache')\nexcept Exception: pass\n"
            "print(json.dumps(v))")
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    out = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-300:]}
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out["kvtier"] = rev.stdout.strip()
    return out


def cell(xs: list[float], base: list[float] | None, scale: float) -> str:
    m = median(xs) * scale
    text = f"{m:,.0f}" if m >= 100 else f"{m:.1f}"
    return text if base is None else f"{text} ({median(xs) / median(base):.2f}x)"


def per_round(xs: list[float], base: list[float]) -> str:
    return " ".join(f"{x / b:.2f}" for x, b in zip(xs, base))


def report(bench, settings: dict, footprint: dict) -> tuple[dict, list[str]]:
    a, times, systems = bench.args, bench.times, list(bench.engines)
    ver = versions(a.python)
    head = ["row", *systems]
    rows, ratio_rows = [], []
    tags = [("", a.prefix_tokens + a.suffix_tokens), *((f"@{n}", n) for n in a.long)]
    for tag, n in tags:
        for key, label, scale in ROWS:
            got = times.get(key + tag)
            if not got:
                continue
            base = got["alone"]
            label = label if not tag else label.replace("(a) ", "").replace("(b) ", "") + f", {n} tokens"
            rows.append([label, *(cell(got[s], None if s == "alone" else base, scale) for s in systems)])
            ratio_rows.append([label, *("" if s == "alone" else per_round(got[s], base) for s in systems)])
        hits = times.get("hit_tokens" + tag, {})
        if hits:
            rows.append([f"prompt tokens served on a hit ({n}-token prompt), median",
                         *(("–" if s == "alone" else f"{median(hits[s]):,.0f}") for s in systems)])
    rows.extend(peers_pressure.rows(bench, kv_bytes_per_token(a)))
    rows.extend(peers_disk.rows(bench))
    rows.append(["service CPU s over the timed rounds", *(
        f"{bench.service_cpu[s]:.2f}" if s in bench.service_cpu else "–" for s in systems)])
    conc = times.get("concurrent", {})
    if conc:
        solo = median(times["miss"]["alone"])
        rows.append([f"{a.concurrent} engines ask for one stored prompt at once: TTFT p50 / max ms", *(
            f"{pct(sum(conc[s], []), 50) * 1e3:,.0f} / {max(sum(conc[s], [])) * 1e3:,.0f} "
            f"({pct(sum(conc[s], []), 50) / solo:.2f}x)" if s in conc else "–" for s in systems)])
    load = bench.load
    title = (f"{a.rounds} rounds x {a.prefix_tokens + a.suffix_tokens}-token prompts, {a.layers}-layer tiny Llama "
             f"(bfloat16, hidden {a.hidden}), VLLM_CPU_OMP_THREADS_BIND={a.omp_bind}; load average "
             f"{min(load):.1f}-{max(load):.1f}; {json.dumps(ver)}; ratio = system / vLLM alone, same run")
    tables = [table(head, rows, title),
              table(head, ratio_rows, "per-round ratios to vLLM alone (round 1 first)"),
              table(["system", "adds to vLLM (packages, MiB)", "service RSS / PSS MiB", "engine RSS / PSS MiB",
                     "service start s", "engine start s"],
                    [[s, _installed(f.get("installed")), _mem(f.get("service")), _mem(f.get("engine")),
                      f.get("service_start_s", "–"), f.get("engine_start_s", "–")] for s, f in footprint.items()],
                    "footprint (after the timed rounds)")]
    if bench.skipped:
        tables.append("left out (the exception vLLM or the service raised):\n" +
                      "\n".join(f"- {s}: {why}" for s, why in bench.skipped.items()))
    out = {"versions": ver, "args": {k: v for k, v in vars(a).items()}, "systems": systems,
           "skipped": bench.skipped, "settings": settings, "load": load, "times": times,
           "service_cpu_s": bench.service_cpu, "footprint": footprint, "machine_cpus": os.cpu_count()}
    return out, tables


def _installed(f: dict | None) -> str:
    if not f:
        return "–"
    if "error" in f:
        return f"? ({f['error']})"
    return f"{f['packages']}, {f['mib']:,.1f}"


def _mem(m: dict | None) -> str:
    return "–" if not m else f"{m['rss_mib']:,} / {m['pss_mib']:,}"
