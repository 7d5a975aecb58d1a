#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 10 and docs/GPU.md (GPU runs only).
"""A cross-process prefix hit on the GPU: time to first token loading a prefix vs prefilling it.

    python scripts/bench_gpu_prefix.py [--prefix 1024] [--questions 3] [--hidden 4096 --layers 8]
                                       [--device cuda] [--out results.json]

HF continuous batching with a random Llama (seeded, no download; Llama-3-8B's
width, 8 of its 32 layers by default, bfloat16, built on the device) whose
paged cache is on ``--device``. ``--prefix 2048 --layers 32`` is the whole
8B shape (minutes more on a GPU node; the acceptance runs the default). Engine A
(this process) answers one question about a ``--prefix``-token document with
kvtier, which stores the document's blocks in the daemon's pool. Engine B,
a fresh process, then asks other questions, each on a cold engine, both ways
alternately: plain HF (prefills the whole prompt) and with kvtier (loads the
document, prefills the question). Reported: median time to first token of
each and their ratio (target on a GPU: the hit costs < 10% of the prefill).
Tokens of every kvtier run are checked against plain HF's.

``--device cpu --hidden 256 --layers 2 --prefix 256`` is a smoke run of the
plumbing on a machine without a GPU (no figure from it means anything here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvtier.demo.daemon_proc import PrivateDaemon  # noqa: E402
from kvtier.integrations.transformers import KVTierContinuousBatchingManager  # noqa: E402

PAGE, VOCAB = 16, 32000
MODEL_ID = "kvtier-bench/random-llama-gpu-prefix"


def build_model(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=int(args.hidden * 3.5),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                         num_key_value_heads=max(1, args.hidden // 512), max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    # Built where it runs, in the dtype it runs in: built on the CPU in fp32 first,
    # Llama-3-8B's shape takes ~32 GB and minutes of random init per process.
    # Same seed, same device, same ops: every process gets the same weights.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def settings(blocks: int):
    gen = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    return gen, ContinuousBatchingConfig(page_size=PAGE, num_blocks=blocks, use_cuda_graph=False,
                                         use_async_batching=False)


def wait_pinned(socket: str) -> None:
    """Measure once the whole pool is pinned (it pins in the background)."""
    from kvtier.client import Client
    with Client(socket, heartbeat=False) as c:
        while c.stats()["pool"]["pinning"]:
            time.sleep(0.2)


def ttft_ms(out) -> float:
    return (out.timestamps[0] - out.created_time) * 1e3


def plain(model, prompt, blocks):
    gen, cb = settings(blocks)
    manager = model.init_continuous_batching(gen, cb)
    manager.start()
    try:
        (rid,) = manager.add_requests([prompt], max_new_tokens=2, record_timestamps=True)
        out = manager.get_result(request_id=rid, timeout=600)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return out


def with_kvtier(model, prompt, blocks, socket):
    gen, cb = settings(blocks)
    with KVTierContinuousBatchingManager(model, gen, cb, model_id=MODEL_ID, socket=socket) as m:
        (out,) = m.generate([prompt], max_new_tokens=2, record_timestamps=True, timeout=600)
        if m.tier is None:  # the paged cache exists once the first batch ran
            raise SystemExit("kvtier did not attach to the paged cache (see the log)")
    return out, m.counters


def engine_b(args, doc, questions, blocks, socket, queue) -> None:
    model = build_model(args)
    plain_ms, tier_ms, loaded = [], [], 0
    plain(model, doc + questions[0], blocks)  # warm-up (kernels, allocator), not measured
    for q in questions:
        ref = plain(model, doc + q, blocks)
        out, counters = with_kvtier(model, doc + q, blocks, socket)
        if out.generated_tokens != ref.generated_tokens:
            queue.put(("error", "kvtier tokens differ from plain HF"))
            return
        plain_ms.append(ttft_ms(ref))
        tier_ms.append(ttft_ms(out))
        loaded += counters.loaded_tokens
    queue.put(("ok", (plain_ms, tier_ms, loaded)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_prefix: needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(21)
    doc = torch.randint(3, VOCAB, (args.prefix,), generator=g).tolist()
    questions = [torch.randint(3, VOCAB, (16,), generator=g).tolist() for _ in range(args.questions + 1)]
    blocks = -(-(args.prefix + 16 + 2) // PAGE) + 8
    gpu = "on" if args.device == "cuda" else "off"
    with PrivateDaemon(pool_size="1GiB" if gpu == "on" else "512MiB", slab_size="64MiB",
                       extra=["--gpu", gpu, "--config", "/dev/null"]) as daemon:  # not the host's config
        wait_pinned(daemon.socket)
        _, counters = with_kvtier(build_model(args), doc + questions[0], blocks, daemon.socket)
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=engine_b, args=(args, doc, questions[1:], blocks, daemon.socket, queue))
        proc.start()
        status, result = queue.get(timeout=3600)
        proc.join()
    if status != "ok":
        sys.exit(result)
    plain_ms, tier_ms, loaded = result
    p, t = statistics.median(plain_ms), statistics.median(tier_ms)
    doc_out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "prefix_tokens": args.prefix, "hidden": args.hidden,
               "layers": args.layers, "stored_blocks": counters.stored_blocks,
               "loaded_tokens_per_request": loaded // len(tier_ms), "plain_ttft_ms": plain_ms,
               "kvtier_ttft_ms": tier_ms, "median_plain_ms": p, "median_kvtier_ms": t, "ratio": t / p,
               "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc_out, f, indent=2)
    print(f"{args.prefix}-token prefix from another process, {doc_out['device']}: TTFT plain HF "
          f"{p:.1f} ms, kvtier {t:.1f} ms ({loaded // len(tier_ms)} tokens loaded per request): "
          f"{t / p:.1%} of the prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
