# Feeds BENCHMARKS.md section 14.
"""Pool bytes and hits across TP sizes: kvtier's shared TP layout against the per-rank one.

    python scripts/bench_tp_pool.py            (~5 min on 2 cores: 8 engine starts)

For a tiny Llama with 2 KV heads and a tiny DeepSeek-V2-style MLA model
(latent 512 + rope 64, block 16), each under both layouts
(``kvtier_tp_layout``: ``shared``, kvtier's default, and ``per-rank``, one
namespace per TP rank and size as before), on a private daemon per layout:
a TP=2 engine answers a prompt (and stores it), then a TP=1 engine, a new
process, answers the same prompt. Prints the pool bytes the TP=2 store
took (against one copy of the prompt's KV) and the TP=1 engine's hits, and
whether its tokens equal the TP=2 engine's. Both layouts run in the same
invocation, side by side (same model, prompt and machine).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

import benchlib as bl

sys.path.insert(0, os.path.join(bl.REPO, "client"))
import vllm_offline as ex  # noqa: E402
from tests.integrations.vllm_engines import LiveEngine, make_tiny_mla  # noqa: E402  (one engine driver)

LAYOUTS = ("per-rank", "shared")


def one_copy(model: str, tokens: int) -> int:
    """Bytes of one copy of the KV of ``tokens`` full-block tokens (2 layers, bf16)."""
    if model == "mla":
        return tokens // 16 * 2 * 16 * 576 * 2            # latent 512 + rope 64 per token
    return tokens // 32 * 2 * 32 * 2 * 2 * 64 * 2        # 2 KV heads x (K + V) x head 64


def pool_bytes(socket: str) -> int:
    import json
    import subprocess
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--json", "--socket", socket],
                         capture_output=True, text=True, check=True, env=ex.engine_env()).stdout
    return sum(n["bytes"] for n in json.loads(out)["namespaces"])


def pair(name: str, model: str, socks: dict, tmp: str, tp: int, block: int) -> dict:
    engines = {lay: LiveEngine(f"{name}-tp{tp}-{lay}", model, tmp, tp=tp, socket=socks[lay], block_size=block,
                               extra=("--tp-layout", lay)) for lay in LAYOUTS}
    try:
        for e in engines.values():
            e.wait_ready()
        return engines
    except BaseException:
        for e in engines.values():
            e.close()
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    rng = random.Random(7)
    prompt = [[rng.randrange(1, 500) for _ in range(args.prefix_tokens + 8)]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"llama": (ex.make_tiny_llama(os.path.join(tmp, "llama"), hidden=256), 32),
                  "mla": (make_tiny_mla(os.path.join(tmp, "mla")), 16)}
        for name, (model, block) in models.items():
            socks = {lay: os.path.join(tmp, f"{name}-{lay}.sock") for lay in LAYOUTS}
            daemons = [bl.start_daemon(s, "512MiB", env=ex.engine_env()) for s in socks.values()]
            try:
                res = {lay: {} for lay in LAYOUTS}
                for tp in (2, 1):
                    engines = pair(name, model, socks, tmp, tp, block)
                    try:
                        for lay, e in engines.items():
                            res[lay][f"tokens{tp}"] = e.generate(prompt)
                            res[lay][f"hits{tp}"] = int(e.metrics().get("vllm:external_prefix_cache_hits", 0))
                            if tp == 2:
                                res[lay]["bytes"] = pool_bytes(socks[lay])
                    finally:
                        for e in engines.values():
                            e.quit()
                        for e in engines.values():
                            e.close()
                for lay in LAYOUTS:
                    r = res[lay]
                    copy = one_copy(name, len(prompt[0]) - 1)
                    rows.append([name, lay, f"{r['bytes']:,}", f"{r['bytes'] / copy:.2f}x", str(r["hits1"]),
                                 "yes" if r["tokens1"] == r["tokens2"] else "NO"])
            finally:
                for d in daemons:
                    d.terminate()
                    d.wait(30)
    print(f"prompt {len(prompt[0])} tokens; TP=2 engine stores it, then a TP=1 engine (new process) answers it")
    print(bl.table(["model", "layout", "pool bytes after TP=2 store", "vs one copy", "TP=1 hits",
                    "TP=1 tokens == TP=2"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
