#!/usr/bin/env python
"""HF continuous batching on kvtier: swap vs soft reset, and a second process's TTFT.

    python scripts/bench_hf.py [--requests 24] [--blocks 40] [--doc 1024] [--reps 2]

A random Llama (seeded, no download; ``--hidden``/``--layers`` size it) on CPU.

1. Cache pressure: ``--requests`` prompts of 64-192 tokens, 32 new tokens
   each, a paged cache of ``--blocks`` blocks of 16 tokens (a fraction of the
   workload). Generated tokens/s of plain HF (its CPU swap pool cannot exist
   on CPU, so preempted requests are soft reset: recomputed) against the same
   run with kvtier as the swap pool. Both in this process, alternating,
   ``--reps`` times each; the best run of each is reported.
2. Second process: engine A (this process) answers a question about a
   ``--doc``-token document with kvtier, which stores the document's blocks.
   Engine B, a fresh process, then asks other questions: time to first token
   with plain HF vs with kvtier (document loaded from the pool), each question
   on a fresh engine (a cold cache, as a new process has), median of
   ``--questions``.

Every kvtier run's tokens are checked against the plain HF run's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from kvtier.client import Client  # noqa: E402
from kvtier.demo.daemon_proc import PrivateDaemon  # noqa: E402
from kvtier.integrations.transformers import KVTierContinuousBatchingManager  # noqa: E402

PAGE = 16
NEW_TOKENS = 32
MODEL_ID = "kvtier-bench/random-llama"


def build_model(hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def greedy(new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def cb_config(blocks: int) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=blocks, use_cuda_graph=False,
                                    use_async_batching=False)


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lengths]


def plain_hf(model, inputs, blocks, new_tokens=NEW_TOKENS, timestamps=False, one_by_one=False) -> tuple:
    """(outputs, (wall, CPU) seconds from submitting to the last result; engine start/stop excluded)."""
    manager = model.init_continuous_batching(greedy(new_tokens), cb_config(blocks))
    manager.start()
    try:
        batches = [[p] for p in inputs] if one_by_one else [inputs]
        ids, done = [], {}
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in batches:
            ids += manager.add_requests(batch, max_new_tokens=new_tokens, record_timestamps=timestamps)
            while len(done) < len(ids):
                out = manager.get_result(timeout=60)
                if out is None:
                    raise RuntimeError("plain HF stalled")
                done[out.request_id] = out
        elapsed = (time.perf_counter() - t0, time.process_time() - c0)
    finally:
        manager.stop(block=True)
        manager.destroy()
    return [done[i] for i in ids], elapsed


def with_kvtier(model, inputs, blocks, socket, new_tokens=NEW_TOKENS, timestamps=False) -> tuple:
    """(outputs, counters, (wall, CPU) seconds from submitting to the last result)."""
    with KVTierContinuousBatchingManager(model, greedy(new_tokens), cb_config(blocks), model_id=MODEL_ID,
                                         socket=socket) as cb:
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = cb.generate(inputs, max_new_tokens=new_tokens, record_timestamps=timestamps, timeout=1800)
        elapsed = (time.perf_counter() - t0, time.process_time() - c0)
    return outputs, cb.counters, elapsed


def ttft_ms(output) -> float:
    return (output.timestamps[0] - output.created_time) * 1e3


def pressure(args, model, socket) -> None:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g).tolist()
    inputs = prompts(11, lengths)
    new = args.new_tokens
    demand = sum(-(-(n + new) // PAGE) for n in lengths)
    print(f"## cache pressure: {args.requests} requests, {sum(lengths)} prompt tokens, {new} new each; "
          f"cache {args.blocks} blocks of {PAGE} tokens for {demand} blocks of demand")
    generated = args.requests * new
    best = {"plain": (float("inf"), 0.0), "kvtier": (float("inf"), 0.0)}
    counters = None
    # What a soft reset costs in compute: the same scheduler with no daemon (every victim recomputed).
    _, recompute, _ = with_kvtier(model, inputs, args.blocks, socket + ".absent", new_tokens=new)
    for rep in range(args.reps):
        ref, elapsed = plain_hf(model, inputs, args.blocks, new_tokens=new)
        best["plain"] = min(best["plain"], elapsed)
        with Client(socket) as client:
            client.flush()  # earlier reps stored these prompts: this part measures swap, not prefix hits
        outs, counters, elapsed = with_kvtier(model, inputs, args.blocks, socket, new_tokens=new)
        best["kvtier"] = min(best["kvtier"], elapsed)
        same = [o.generated_tokens for o in outs] == [r.generated_tokens for r in ref]
        if not same:
            sys.exit("kvtier tokens differ from plain HF")
        print(f"  rep {rep}: plain {generated / best['plain'][0]:.1f} tok/s, kvtier "
              f"{generated / best['kvtier'][0]:.1f} tok/s (best so far); tokens identical: {same}")
    print(f"  soft reset everywhere: {recompute.soft_resets} soft resets, {recompute.computed_tokens} tokens computed")
    print(f"  kvtier counters (last run): offloaded {counters.offloaded_requests}, restored "
          f"{counters.restored_requests}, soft resets {counters.soft_resets}, computed tokens "
          f"{counters.computed_tokens}")
    (plain_s, plain_cpu), (tier_s, tier_cpu) = best["plain"], best["kvtier"]
    print(f"  engine CPU seconds in the best runs: plain {plain_cpu:.2f}, kvtier {tier_cpu:.2f}")
    print(f"  RESULT soft reset (plain HF): {generated / plain_s:.1f} tok/s   kvtier swap: {generated / tier_s:.1f} "
          f"tok/s   ratio {plain_s / tier_s:.2f}x")


def second_engine(hidden, layers, threads, doc, questions, blocks, socket, queue) -> None:
    """Engine B in a fresh process: each question on a cold engine, both ways."""
    torch.set_num_threads(threads)
    model = build_model(hidden, layers)
    plain, tier, hits = [], [], 0
    for q in questions:
        ref = plain_hf(model, [doc + q], blocks, new_tokens=4, timestamps=True)[0][0]
        outs, counters, _ = with_kvtier(model, [doc + q], blocks, socket, new_tokens=4, timestamps=True)
        if outs[0].generated_tokens != ref.generated_tokens:
            queue.put(("error", "kvtier tokens differ from plain HF"))
            return
        plain.append(ttft_ms(ref))
        tier.append(ttft_ms(outs[0]))
        hits += counters.loaded_tokens
    # The floor: the same questions on one warm engine that computed the document itself.
    warm, _ = plain_hf(model, [doc + q for q in questions], blocks, new_tokens=4, timestamps=True, one_by_one=True)
    queue.put(("ok", (plain, tier, hits, [ttft_ms(o) for o in warm[1:]])))


def second_process(args, model, socket) -> None:
    doc = prompts(21, [args.doc])[0]
    questions = prompts(22, [16] * args.questions)
    blocks = -(-(args.doc + 16 + 4) // PAGE) + 8
    print(f"## second process: a {args.doc}-token document, {args.questions} questions of 16 tokens, "
          f"cache {blocks} blocks")
    _, counters, _ = with_kvtier(model, [doc + prompts(23, [16])[0]], blocks, socket, new_tokens=4)
    print(f"  engine A stored {counters.stored_blocks} blocks")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=second_engine,
                       args=(args.hidden, args.layers, args.threads, doc, questions, blocks, socket, queue))
    proc.start()
    status, result = queue.get(timeout=1800)
    proc.join()
    if status != "ok":
        sys.exit(result)
    plain, tier, loaded, warm = result
    p, t, w = statistics.median(plain), statistics.median(tier), statistics.median(warm)
    print(f"  plain HF TTFT ms: {' '.join(f'{x:.1f}' for x in plain)}")
    print(f"  kvtier   TTFT ms: {' '.join(f'{x:.1f}' for x in tier)}  ({loaded // len(tier)} prompt tokens "
          f"loaded per request)")
    print(f"  warm    TTFT ms: {' '.join(f'{x:.1f}' for x in warm)}  (one engine that computed the "
          f"document: HF's in-process prefix hit, the floor)")
    print(f"  RESULT second-process TTFT median: plain HF {p:.1f} ms   kvtier prefix {t:.1f} ms   "
          f"speedup {p / t:.1f}x   (in-process hit floor {w:.1f} ms)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--doc", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--only", choices=["pressure", "ttft"], default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_model(args.hidden, args.layers)
    print(f"model: random Llama hidden {args.hidden}, {args.layers} layers, float32, CPU "
          f"({torch.get_num_threads()} threads)")
    with PrivateDaemon(pool_size="1GiB", slab_size="16MiB") as daemon:
        if args.only in (None, "pressure"):
            pressure(args, model, daemon.socket)
        if args.only in (None, "ttft"):
            second_process(args, model, daemon.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
