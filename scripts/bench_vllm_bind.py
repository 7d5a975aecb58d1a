# Feeds BENCHMARKS.md section 8.
"""Why a vLLM CPU engine with kvtier's connector prefilled faster than vLLM alone: the OpenMP binding.

    python scripts/bench_vllm_bind.py [--prompts 8] [--binds 0 0,1]       (~4 min)

vLLM's CPU build binds its worker's OpenMP team itself
(``VLLM_CPU_OMP_THREADS_BIND=auto``) and reserves cores for the engine's
other threads: one per worker, plus one more when *any* KV connector is
configured (``vllm/utils/ompmultiprocessing.py``, meant for NIXL). On a
2-core machine that is 1 reserved core without a connector (1 compute
thread) but 2 with one, which is every core, so vLLM reserves none and runs
2 compute threads. kvtier changes nothing else.

This A/B changes one thing at a time. Four engines alive side by side, the
same prompts interleaved: vLLM alone and vLLM with kvtier (each its own
private daemon, so every lookup misses), each once with vLLM's automatic
binding and once with every ``--binds`` value pinned. A table of median TTFT
per engine, its compute threads, and where its KV cache lives.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from vllm_procs import Engine, Prompts, ex, interleave
from benchlib import median, pct, start_daemon, table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--binds", nargs="*", default=["0", "0,1"], help="pinned VLLM_CPU_OMP_THREADS_BIND values")
    args = ap.parse_args(argv)
    daemons = []
    with tempfile.TemporaryDirectory() as tmp:
        model = ex.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)

        def daemon() -> str:  # one per kvtier engine: no engine ever hits another's prompts
            sock = os.path.join(tmp, f"d{len(daemons)}.sock")
            daemons.append(start_daemon(sock, "1GiB", env=ex.engine_env()))
            return sock

        eng = {}
        try:
            for bind in ["auto", *args.binds]:  # two at a time: six starting at once time out on 2 cores
                args.omp_bind = bind
                pair = (Engine(f"alone-{bind}", model, args, [], tmp),
                        Engine(f"kvtier-{bind}", model, args, ["--kvtier", "--socket", daemon()], tmp))
                eng[f"alone, bind {bind}"], eng[f"kvtier, bind {bind}"] = pair
                for e in pair:
                    e.wait_ready()
            prompts = Prompts(args.prefix_tokens + 32, seed=3)
            for e in eng.values():
                e.call("touch_kv")
                e.ttft(prompts.new())
                e.ttft(prompts.new())
            times: dict[str, list[float]] = {n: [] for n in eng}
            load0 = os.getloadavg()[0]
            for i in range(args.prompts):
                p = prompts.new()
                for n, s in interleave(i, [(n, lambda e=e: e.ttft(p)) for n, e in eng.items()]).items():
                    times[n].append(s)
            load1 = os.getloadavg()[0]
            base = median(times["alone, bind auto"])
            rows = []
            for n, e in eng.items():
                s = e.ready["settings"]
                rows.append([n, s["torch_threads"], s["env"].get("GOMP_CPU_AFFINITY", "-"),
                             s["kv_cache"]["mapping"]["names"][0].split(":")[0],
                             round(median(times[n]) * 1e3, 1), round(pct(times[n], 90) * 1e3, 1),
                             round(median(times[n]) / base, 3)])
        finally:
            for e in eng.values():
                e.close()
            for d in daemons:
                d.terminate()
                d.wait(30)
    print(table(["engine", "OMP threads", "GOMP_CPU_AFFINITY", "KV memory", "TTFT median ms", "p90 ms",
                 "vs alone (auto)"], rows,
                f"{args.prompts} new prompts of {args.prefix_tokens}+32 tokens, interleaved; load average "
                f"{load0:.1f} -> {load1:.1f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
