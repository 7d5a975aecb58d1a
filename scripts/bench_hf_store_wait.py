#!/usr/bin/env python
# Feeds BENCHMARKS.md section 11.
"""How long HF's generation thread spends finishing requests with kvtier.

A finished request's full blocks are stored in kvtier. This times HF's
``finish_request`` (where kvtier submits the store) on the generation thread,
per finished request, next to the whole generation step it is part of, for
one engine with kvtier and a private daemon. Run it on two checkouts to
compare them; the step time is the same-run baseline.

    python scripts/bench_hf_store_wait.py [--hidden 1024] [--layers 8] [--requests 16] [--prompt 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvtier.demo.daemon_proc import PrivateDaemon  # noqa: E402
from kvtier.integrations.transformers import KVTierContinuousBatchingManager, KVTierScheduler  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 64, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    blocks = args.requests * (args.prompt // 16 + 1) + 8  # no cache pressure: nothing waits for room
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=blocks, use_cuda_graph=False, use_async_batching=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]

    finish: list[float] = []
    original = KVTierScheduler.finish_request

    def timed(self, request_id):
        t0 = time.perf_counter()
        original(self, request_id)
        finish.append(time.perf_counter() - t0)
    KVTierScheduler.finish_request = timed
    with PrivateDaemon(pool_size="1GiB", slab_size="64MiB") as d:
        with KVTierContinuousBatchingManager(model, gen, cb, model_id="bench-store-wait", socket=d.socket) as m:
            t0 = time.perf_counter()
            m.generate(prompts, timeout=1800)
            wall = time.perf_counter() - t0
        stored = m.counters.stored_blocks  # after the stop: every store has finished
    per_block = args.layers * 2 * args.hidden * 16 * 4
    print(f"model hidden {args.hidden}, {args.layers} layers: {per_block / 2**20:.2f} MiB per 16-token block; "
          f"{args.requests} requests of {args.prompt} tokens, 4 new each ({stored} blocks stored)")
    print(f"finish_request on the generation thread: median {statistics.median(finish) * 1e3:.2f} ms, "
          f"max {max(finish) * 1e3:.2f} ms, total {sum(finish) * 1e3:.1f} ms of {wall * 1e3:.0f} ms generating")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
