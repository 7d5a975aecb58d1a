"""``kvtier demo``: two engine processes share a long document through kvtier.

Engine A answers questions about a document (prompt = document + question)
and offloads the prompt's KV blocks to the daemon. Engine B, a separate
process with its own small KV cache, then gets the same document with other
questions: for each it runs once without the tier (full prefill, the
reference) and once with it (lookup -> load the document blocks -> prefill
only the rest), and checks that tokens, logits and the document's KV bytes
are identical. Each engine's cache holds one request, so nothing survives
between requests inside an engine: every reuse goes through kvtier.

Primitives: ``add_arguments(parser)``, ``run(args) -> int``, ``main(argv)``.
Torch is imported only in the engine processes and ``run``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import traceback


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--socket", help="use this running daemon instead of starting a private one")
    p.add_argument("--doc-tokens", type=int, default=1500, help="document length (tokens)")
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per answer")
    p.add_argument("--questions-a", type=int, default=2, help="questions engine A answers first")
    p.add_argument("--questions-b", type=int, default=3, help="other questions engine B answers")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    return p


def workload(args) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A fixed document and distinct questions (token ids; seeded, no files)."""
    from .config import ModelConfig
    vocab = ModelConfig().vocab
    rng = random.Random(7)
    doc = [rng.randrange(vocab) for _ in range(args.doc_tokens)]
    qs = [[rng.randrange(vocab) for _ in range(args.question_tokens)]
          for _ in range(args.questions_a + args.questions_b)]
    return doc, qs[:args.questions_a], qs[args.questions_a:]


def config(args):
    from .config import ModelConfig
    return ModelConfig(layers=args.layers, dim=args.dim)


def engine_blocks(args, cfg) -> int:
    """Room for exactly one request: the document cannot stay resident."""
    return -(-(args.doc_tokens + args.question_tokens + args.new_tokens) // cfg.block_size)


# ---- engine processes ----------------------------------------------------------------
def engine_a(socket: str, args) -> list[dict]:
    """Answer A's questions with the tier on; the first one fills the tier."""
    import torch
    from ..client import Client
    from .engine import Engine
    torch.set_num_threads(args.threads)
    cfg = config(args)
    doc, questions, _ = workload(args)
    with Client(socket, name="demo-engine-a", timeout=30) as c:
        eng = Engine(cfg, engine_blocks(args, cfg), c)
        try:
            return [summary(eng.generate(doc + q, args.new_tokens, use_tier=True)) for q in questions]
        finally:
            eng.close()


def engine_b(socket: str, args) -> list[dict]:
    """Other questions, each run without and with the tier; outputs must match exactly."""
    import torch
    from ..client import Client
    from .engine import Engine
    torch.set_num_threads(args.threads)
    cfg = config(args)
    doc, _, questions = workload(args)
    doc_blocks = args.doc_tokens // cfg.block_size
    rows = []
    with Client(socket, name="demo-engine-b", timeout=30) as c:
        eng = Engine(cfg, engine_blocks(args, cfg), c)
        try:
            for q in questions:
                ref = eng.generate(doc + q, args.new_tokens, use_tier=False, snapshot_blocks=doc_blocks)
                got = eng.generate(doc + q, args.new_tokens, use_tier=True, snapshot_blocks=doc_blocks)
                h = got.hit_blocks
                row = summary(got)
                row.update(ref_ttft_ms=ref.ttft_s * 1e3, ref_tokens=ref.tokens,
                           identical_tokens=ref.tokens == got.tokens,
                           identical_logits=bool(torch.equal(ref.logits, got.logits)),
                           max_logit_diff=float((ref.logits - got.logits).abs().max()),
                           identical_kv=all(torch.equal(a[:h], b[:h]) for a, b in zip(ref.snapshot, got.snapshot)))
                rows.append(row)
        finally:
            eng.close()
    return rows


def summary(g) -> dict:
    return {"tokens": g.tokens, "ttft_ms": g.ttft_s * 1e3, "prompt_blocks": g.prompt_blocks,
            "hit_blocks": g.hit_blocks, "loaded_bytes": g.loaded_bytes, "stored_blocks": g.stored_blocks,
            "prefilled_tokens": g.prefilled_tokens, "lookup_ms": g.lookup_s * 1e3, "load_ms": g.load_s * 1e3}


def _child(target, q, socket, args) -> None:
    try:
        q.put(("ok", target(socket, args)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def in_process(target, socket: str, args):
    """Run an engine in a fresh spawned process (its own address space)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(target, q, socket, args))
    p.start()
    status, value = q.get(timeout=600)
    p.join(60)
    if status != "ok":
        raise RuntimeError(f"{target.__name__} failed:\n{value}")
    return value


# ---- orchestration -------------------------------------------------------------------
def run(args) -> int:
    from ..client import Client
    from .daemon_proc import PrivateDaemon
    daemon = None if args.socket else PrivateDaemon("256MiB", "8MiB")
    socket = args.socket or daemon.socket
    try:
        a_rows = in_process(engine_a, socket, args)
        b_rows = in_process(engine_b, socket, args)
        with Client(socket, name="kvtier-demo", heartbeat=False) as c:
            stats = c.stats()
    finally:
        if daemon is not None:
            daemon.stop()
    report = build_report(args, a_rows, b_rows, stats)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0 if report["identical_tokens"] and report["identical_logits"] and report["hit_blocks"] > 0 else 1


def build_report(args, a_rows: list[dict], b_rows: list[dict], stats: dict) -> dict:
    cfg = config(args)
    ns = [n for n in stats["namespaces"] if n["fingerprint"] == cfg.namespace().fingerprint()]
    hit_blocks = sum(r["hit_blocks"] for r in b_rows)
    prompt_blocks = sum(r["prompt_blocks"] for r in b_rows)
    ttft_with = sorted(r["ttft_ms"] for r in b_rows)
    ttft_without = sorted(r["ref_ttft_ms"] for r in b_rows)
    mid = len(b_rows) // 2
    return {
        "model": f"{cfg.layers} layers x {cfg.dim} dim, {cfg.heads} heads, float32, seed {cfg.seed}",
        "engine_kv_blocks": engine_blocks(args, cfg), "block_tokens": cfg.block_size,
        "block_bytes": cfg.layers * 2 * cfg.block_size * cfg.dim * 4,
        "doc_tokens": args.doc_tokens, "engine_a": a_rows, "engine_b": b_rows,
        "identical_tokens": all(r["identical_tokens"] for r in b_rows),
        "identical_logits": all(r["identical_logits"] for r in b_rows),
        "identical_kv": all(r["identical_kv"] for r in b_rows),
        "hit_blocks": hit_blocks, "hit_rate": hit_blocks / prompt_blocks if prompt_blocks else 0.0,
        "ttft_ms_without": ttft_without[mid], "ttft_ms_with": ttft_with[mid],
        "ttft_speedup": ttft_without[mid] / ttft_with[mid],
        "lookup_ms": sorted(r["lookup_ms"] for r in b_rows)[mid], "load_ms": sorted(r["load_ms"] for r in b_rows)[mid],
        "bytes_loaded": stats["totals"]["load_bytes"], "bytes_stored": stats["totals"]["store_bytes"],
        "daemon_hit_rate": ns[0]["hits"] / max(1, ns[0]["hits"] + ns[0]["misses"]) if ns else 0.0,
    }


def render(r: dict) -> str:
    from ..pool.sizes import format_size
    lines = [f"kvtier demo: tiny transformer ({r['model']}), {r['doc_tokens']}-token document",
             f"engine KV cache: {r['engine_kv_blocks']} blocks of {r['block_tokens']} tokens "
             f"({format_size(r['block_bytes'])} each) = room for one request, so reuse must go through kvtier",
             "", f"{'engine':<8}{'question':>9}{'hit blocks':>12}{'prefilled':>11}{'TTFT ms':>10}"
             f"{'(load ms)':>10}{'TTFT no tier':>14}{'tokens equal':>14}{'logits equal':>14}"]
    for i, a in enumerate(r["engine_a"]):
        lines.append(f"{'A':<8}{i + 1:>9}{a['hit_blocks']:>7}/{a['prompt_blocks']:<4}{a['prefilled_tokens']:>11}"
                     f"{a['ttft_ms']:>10.1f}{a['load_ms']:>10.1f}{'-':>14}{'-':>14}{'-':>14}")
    for i, b in enumerate(r["engine_b"]):
        lines.append(f"{'B':<8}{i + 1:>9}{b['hit_blocks']:>7}/{b['prompt_blocks']:<4}{b['prefilled_tokens']:>11}"
                     f"{b['ttft_ms']:>10.1f}{b['load_ms']:>10.1f}{b['ref_ttft_ms']:>14.1f}"
                     f"{str(b['identical_tokens']):>14}{str(b['identical_logits']):>14}")
    lines += ["",
              f"engine B: identical tokens {r['identical_tokens']}, identical logits {r['identical_logits']}, "
              f"identical document KV {r['identical_kv']}",
              f"engine B hit rate {r['hit_rate']:.1%} of prompt blocks; TTFT median {r['ttft_ms_with']:.1f} ms "
              f"with kvtier (lookup {r['lookup_ms']:.1f} ms, load {r['load_ms']:.1f} ms) vs "
              f"{r['ttft_ms_without']:.1f} ms without ({r['ttft_speedup']:.1f}x)",
              f"daemon: {format_size(r['bytes_stored'])} stored, {format_size(r['bytes_loaded'])} loaded, "
              f"lookup hit rate {r['daemon_hit_rate']:.1%}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="kvtier demo", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
