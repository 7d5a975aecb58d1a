#!/usr/bin/env python
# Feeds BENCHMARKS.md sections 9 and 11.
"""HF continuous batching on kvtier, the fair way: what kvtier costs, what a swap and a hit gain.

    python scripts/bench_hf.py            # the BENCHMARKS.md section 9 tables (~5 min)
    python scripts/bench_hf.py --quick    # a tiny smoke run (tests/e2e)

A random Llama (seeded, no download; ``--hidden``/``--layers`` size it) on CPU,
``--threads`` torch threads in every engine.

Engines alive side by side, one process each, built and warmed before
anything is timed, the same settings (printed, with any difference): plain
HF, HF with kvtier (daemon up), HF with kvtier and no daemon at its socket.
Each run sends the same requests to every engine in turn, the order
rotating, ``--runs`` runs; the ratio is the median of the per-run ratios to
plain HF; as a second reading, which other jobs' load moves less, the engine
process's CPU seconds over plain HF's (the daemon's own CPU not included).
Timed from submitting the requests to the last result, once the engine has
started (HF builds its paged cache and kvtier attaches on the generation
thread after ``start()``: waited for, untimed).

1. No reuse, no cache pressure: ``--requests`` new prompts of
   ``--prompt-min``..``--prompt-max`` tokens, ``--new-tokens`` each, a cache that
   holds them all (kvtier looks up, misses, stores; nothing is swapped):
   generated tokens/s of each engine.
2. Cache pressure: the same kind of workload through ``--blocks`` blocks of 16
   tokens. Plain HF soft-resets (recomputes) preempted requests (its CPU swap
   pool needs pinned memory, which a CPU-only machine does not have); kvtier
   swaps them out and back. The pool is flushed before each kvtier run.
3. Second process: engine A (this process) answers a question about a
   ``--doc``-token document with kvtier, which stores the document's blocks.
   Engine B, a fresh process, then asks other questions: time to first token
   with plain HF vs with kvtier (document loaded from the pool), each question
   on a fresh engine (a cold cache, as a new process has), the two alternating,
   median of ``--questions``.

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

from benchlib import no_system_config  # noqa: E402
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


def started(manager):
    """Wait until HF's generation thread has built its batch processor (the paged
    cache, its static tensors, kvtier's attach): engine start, which HF runs on
    that thread *after* ``start()`` returns, so without this wait it would fall
    inside the timed region (0.3-0.7 s of a ~1.3 s run here)."""
    while getattr(manager, "batch_processor", None) is None:
        if not manager.is_running():
            raise RuntimeError("the generation loop stopped while starting")
        time.sleep(0.002)
    return manager


def plain_hf(model, inputs, blocks, new_tokens=NEW_TOKENS, timestamps=False, one_by_one=False) -> tuple:
    """(outputs, (wall, CPU) seconds from submitting to the last result; engine start/stop excluded)."""
    manager = model.init_continuous_batching(greedy(new_tokens), cb_config(blocks))
    manager.start()
    try:
        started(manager)
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
        started(cb)
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = cb.generate(inputs, max_new_tokens=new_tokens, record_timestamps=timestamps, timeout=1800)
        elapsed = (time.perf_counter() - t0, time.process_time() - c0)
    return outputs, cb.counters, elapsed


def ttft_ms(output) -> float:
    return (output.timestamps[0] - output.created_time) * 1e3


class Side:
    """One engine kept alive in its own process (spawned, model built, warmed once):
    ``plain`` HF, ``tier`` (kvtier, daemon up) or ``nodaemon`` (kvtier, no daemon at its socket)."""

    def __init__(self, kind: str, args, socket: str):
        ctx = mp.get_context("spawn")
        self.kind, self.cmds, self.out = kind, ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_side_main, args=(kind, args.hidden, args.layers, args.threads, socket,
                                                         self.cmds, self.out), daemon=True)
        self.proc.start()

    def settings(self) -> dict:
        return self._get()

    def run(self, inputs, blocks: int, new_tokens: int) -> dict:
        self.cmds.put((inputs, blocks, new_tokens))
        return self._get()

    def _get(self):
        status, value = self.out.get(timeout=1800)
        if status != "ok":
            sys.exit(f"{self.kind} engine failed:\n{value}")
        return value

    def close(self) -> None:
        self.cmds.put(None)
        self.proc.join(60)


def _side_main(kind, hidden, layers, threads, socket, cmds, out) -> None:
    import traceback
    try:
        torch.set_num_threads(threads)
        model = build_model(hidden, layers)
        out.put(("ok", {"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                        "affinity": sorted(os.sched_getaffinity(0)), "page_size": PAGE,
                        "attn": model.config._attn_implementation, "dtype": str(model.dtype),
                        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "KMP_", "MKL_"))}}))
        while (cmd := cmds.get()) is not None:
            inputs, blocks, new = cmd
            if kind == "plain":
                outs, (wall, cpu) = plain_hf(model, inputs, blocks, new_tokens=new)
                counters = {}
            else:
                sock = socket if kind == "tier" else socket + ".absent"
                outs, c, (wall, cpu) = with_kvtier(model, inputs, blocks, sock, new_tokens=new)
                counters = {k: getattr(c, k) for k in ("stored_blocks", "prefix_hits", "offloaded_requests",
                                                         "restored_requests", "soft_resets", "computed_tokens")}
            out.put(("ok", {"wall": wall, "cpu": cpu, "tokens": [o.generated_tokens for o in outs],
                            "counters": counters}))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def side_by_side(args, sides: dict, socket: str, title: str, make_inputs, blocks: int, new: int,
                 flush: bool) -> list[str]:
    """``--runs`` runs; in each, the same requests go to every side in turn (the order rotating).
    Returns printed lines; tokens are checked identical to plain HF's in every run."""
    names = list(sides)
    walls = {n: [] for n in names}
    cpus = {n: [] for n in names}  # this engine process's CPU seconds: other jobs' load moves it less
    last = {}
    load0 = os.getloadavg()[0]
    for run in range(args.runs):
        inputs = make_inputs(run)
        k = run % len(names)
        for n in names[k:] + names[:k]:
            if flush and n == "tier":
                with Client(socket) as client:
                    client.flush()  # a run measures swap, not the prefix hits of an earlier run
            last[n] = sides[n].run(inputs, blocks, new)
            walls[n].append(last[n]["wall"])
            cpus[n].append(last[n]["cpu"])
        for n in names[1:]:
            if last[n]["tokens"] != last["plain"]["tokens"]:
                sys.exit(f"{n}: tokens differ from plain HF")
    generated = len(inputs) * new
    lines = [f"### {title} (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; {args.runs} runs, tokens "
             f"identical to plain HF in every run)", "",
             "| engine | tokens/s median | per run | vs plain HF (median of per-run ratios) "
             "| engine CPU s / plain HF's (median of per-run ratios) | counters (last run) |",
             "|---|---|---|---|---|---|"]
    for n in names:
        ratios = [walls["plain"][i] / walls[n][i] for i in range(args.runs)]
        cpu_ratios = [cpus[n][i] / cpus["plain"][i] for i in range(args.runs)]
        rates = [generated / w for w in walls[n]]
        lines.append(f"| {n} | {statistics.median(rates):.1f} | {' '.join(f'{r:.1f}' for r in rates)} | "
                     f"{statistics.median(ratios):.3f} | {statistics.median(cpu_ratios):.3f} | "
                     f"{last[n]['counters'] or ''} |")
    print("\n".join(lines), flush=True)
    return lines


def engines(args, socket: str) -> dict:
    sides = {n: Side(n, args, socket) for n in ("plain", "tier", "nodaemon")}
    got = {n: s.settings() for n, s in sides.items()}
    diff = [k for k in got["plain"] if len({str(g[k]) for g in got.values()}) > 1]
    print(f"engines up: plain HF, kvtier (daemon up), kvtier (no daemon), one process each; settings "
          f"{got['plain']}; differing: {diff or 'none'}", flush=True)
    for s in sides.values():  # warm: one small untimed run each
        s.run(prompts(5, [64, 80]), 64, 4)
    return sides


def no_reuse(args, sides, socket) -> None:
    """No reuse, no cache pressure: every prompt new, the cache holds them all."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g).tolist()
    blocks = sum(-(-(n + args.new_tokens) // PAGE) for n in lengths) + 16
    side_by_side(args, sides, socket, f"no reuse, no cache pressure: {args.requests} new prompts of "
                 f"{args.prompt_min}-{args.prompt_max} tokens, {args.new_tokens} new each, {blocks} blocks",
                 lambda run: prompts(1000 + run, lengths), blocks, args.new_tokens, flush=False)


def pressure(args, sides, socket) -> None:
    """Cache pressure: plain HF soft-resets its victims, kvtier swaps them."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(args.prompt_min, args.prompt_max + 1, (args.requests,), generator=g).tolist()
    demand = sum(-(-(n + args.new_tokens) // PAGE) for n in lengths)
    inputs = prompts(11, lengths)
    side_by_side(args, {n: sides[n] for n in ("plain", "tier")}, socket,
                 f"cache pressure: {args.requests} requests, {sum(lengths)} prompt tokens, {args.new_tokens} new "
                 f"each, {args.blocks} blocks for {demand} of demand", lambda run: inputs, args.blocks,
                 args.new_tokens, flush=True)


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
    ap.add_argument("--blocks", type=int, default=40, help="cache blocks in the pressure row")
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--doc", type=int, default=1024)
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, every engine (1: steadier here)")
    ap.add_argument("--only", choices=["noreuse", "pressure", "ttft"], default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.runs, args.doc, args.questions, args.hidden, args.layers = 6, 2, 128, 2, 128, 2
        args.prompt_min, args.prompt_max, args.new_tokens, args.blocks = 32, 64, 8, 12
    torch.set_num_threads(args.threads)
    print(f"model: random Llama hidden {args.hidden}, {args.layers} layers, float32, CPU "
          f"({args.threads} torch threads in every engine)", flush=True)
    with PrivateDaemon(pool_size="1GiB", slab_size="16MiB", extra=tuple(no_system_config())) as daemon:
        if args.only in (None, "noreuse", "pressure"):
            sides = engines(args, daemon.socket)
            try:
                if args.only in (None, "noreuse"):
                    no_reuse(args, sides, daemon.socket)
                if args.only in (None, "pressure"):
                    pressure(args, sides, daemon.socket)
            finally:
                for side in sides.values():
                    side.close()
        if args.only in (None, "ttft"):
            second_process(args, build_model(args.hidden, args.layers), daemon.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
