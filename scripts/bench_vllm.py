"""vLLM (CPU build) time-to-first-token with and without kvtier on long shared prefixes.

    python scripts/bench_vllm.py [--prefix-tokens 2048] [--prefixes 3] [--layers 8] [--hidden 512]

Three engine processes over the same prompts (each prompt a new prefix of
``--prefix-tokens`` random tokens plus a short suffix), one private daemon:

* ``vllm``  - no kvtier: every prompt prefilled (the baseline);
* ``A``     - kvtier, empty pool: every lookup misses, the prefix is stored
              (A vs baseline = the added cost of a miss);
* ``B``     - kvtier, a new process: the prefix is loaded from kvtier.

Prints per-engine median TTFT (a 1-token generate per prompt), the ratios
against the baseline measured in the same run, and the hit rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import REPO  # noqa: F401  (puts the checkout first on sys.path)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "client"))
import vllm_offline as ex  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = ex.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)
        prompts = [ex.shared_prefix_prompts(args.prefix_tokens, 1, suffix_tokens=32, seed=i)[0]
                   for i in range(args.prefixes)]
        pfile = os.path.join(tmp, "prompts.json")
        json.dump(prompts, open(pfile, "w"))
        socket = os.path.join(tmp, "kvtier.sock")
        daemon = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", socket, "--pool-size", "1GiB"],
                                  env=ex.engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(socket):
                if daemon.poll() is not None:
                    raise SystemExit("kvtier-daemon did not start")
                time.sleep(0.05)
            run = lambda **kw: ex.run_engine_process(ex.engine_command(  # noqa: E731
                model, pfile, max_tokens=1, max_model_len=args.prefix_tokens + 256, **kw))
            res = {"vllm": run(socket=None, kvtier=False), "A": run(socket=socket), "B": run(socket=socket)}
            from kvtier.client import Client
            with Client(socket, name="bench") as c:
                totals = c.stats()["totals"]
        finally:
            daemon.terminate()
            daemon.wait(30)
    med = {k: statistics.median(v["ttft_s"]) for k, v in res.items()}
    b = res["B"]["metrics"]
    prompt_tokens = sum(len(p) for p in prompts)
    summary = {
        "prefix_tokens": args.prefix_tokens, "prefixes": args.prefixes, "layers": args.layers,
        "hidden": args.hidden,
        "ttft_ms": {k: round(v * 1e3, 1) for k, v in med.items()},
        "ttft_all_ms": {k: [round(x * 1e3, 1) for x in v["ttft_s"]] for k, v in res.items()},
        "B_speedup_vs_vllm": round(med["vllm"] / med["B"], 2),
        "A_miss_overhead_vs_vllm": round(med["A"] / med["vllm"] - 1, 3),
        "B_external_hit_tokens": b.get("vllm:external_prefix_cache_hits", 0),
        "B_hit_rate_of_prompt_tokens": round(b.get("vllm:external_prefix_cache_hits", 0) / prompt_tokens, 3),
        "kvtier_hit_rate": totals.get("hit_rate"),
        "B_loaded_bytes": b.get("vllm:kv_offload_load_bytes", 0),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"model: random Llama, {args.layers} layers, hidden {args.hidden}; "
              f"{args.prefixes} prompts of {args.prefix_tokens}+32 tokens, each a new prefix")
        for k, label in (("vllm", "vLLM alone (prefill)"), ("A", "A: kvtier, miss + store"),
                         ("B", "B: kvtier, load")):
            print(f"  {label:28s} TTFT median {med[k] * 1e3:8.1f} ms   {summary['ttft_all_ms'][k]}")
        print(f"  B vs vLLM alone: {summary['B_speedup_vs_vllm']}x faster; "
              f"A (miss) vs vLLM alone: {summary['A_miss_overhead_vs_vllm'] * 100:+.1f}%")
        print(f"  B hit {summary['B_external_hit_tokens']} of {prompt_tokens} prompt tokens "
              f"({summary['B_hit_rate_of_prompt_tokens'] * 100:.1f}%), kvtier hit rate {summary['kvtier_hit_rate']}, "
              f"{summary['B_loaded_bytes'] / 2**20:.1f} MiB loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
