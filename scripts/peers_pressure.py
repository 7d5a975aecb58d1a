# Feeds BENCHMARKS.md section 19 (the pressure row; 19.1), run through bench_peers.py --trace.
"""The pressure row of ``scripts/bench_peers.py`` (``--trace EVERY``): a public prefix trace
replayed through every system's engines with stores smaller than its working set.

Which requests: ``../shared/traces/mooncake_synthetic.jsonl`` (512-token prefix-chained
block ids, see its README), the requests whose first block id is a multiple of EVERY
(whole sessions, since the requests of a multi-turn session share their first id),
each cut to its first ``--trace-cut`` ids. With EVERY 32 and a cut of 24: 129 requests,
670 distinct blocks, an infinite cache could serve 0.648 of the block references, an
LRU of 10% / 20% of the working set 0.33 / 0.46. Each block id becomes
``--trace-block`` tokens (default 256, one LMCache chunk, eight vLLM blocks) drawn from
the id, so requests that share ids share token prefixes exactly.

Routing: the systems with a shared store send the requests to engines A and B in turn
(a router balancing load without session affinity, where a node tier's sharing
matters); vLLM alone and the in-process offloaders send all to A. Every engine's own
KV cache is ``--kv-bytes``: set it small, or vLLM's own prefix cache holds the
working set and no tier is asked. Per request: TTFT, prompt tokens served by the
connector (vLLM's external prefix cache hits) and by vLLM's own prefix cache. After
each request the engine runs a short untimed prompt, the step at which vLLM hands the
request's blocks to its connector (an engine under traffic takes it at once).
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict

from benchlib import median, parse_size, pct
from tracesim import DEFAULT_TRACE as TRACE


def trace_requests(every: int, cut: int, path: str = TRACE) -> list[list[int]]:
    with open(path) as f:
        reqs = [json.loads(line)["hash_ids"] for line in f if line.strip()]
    return [ids[:cut] for ids in reqs if ids and ids[0] % every == 0]


def block_tokens(block_id: int, n: int) -> list[int]:
    rng = random.Random(block_id)
    return [rng.randrange(1, 500) for _ in range(n)]


def prompts(requests: list[list[int]], n: int) -> list[list[int]]:
    return [[t for b in ids for t in block_tokens(b, n)] for ids in requests]


def lru_reuse(requests: list[list[int]], capacity_blocks: int) -> float:
    """The share of block references a prefix LRU of ``capacity_blocks`` serves (the
    documented order of kvtier's pool), for the report's offline reference."""
    cache: OrderedDict = OrderedDict()
    hits = refs = 0
    for ids in requests:
        chained = True
        for b in ids:
            refs += 1
            if chained and b in cache:
                hits += 1
            else:
                chained = False
            cache[b] = True
            cache.move_to_end(b)
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hits / max(1, refs)


def replay(bench, shared: tuple[str, ...]) -> None:
    a = bench.args
    reqs = trace_requests(a.trace, a.trace_cut)
    ps = prompts(reqs, a.trace_block)
    turn = {s: 0 for s in bench.engines}
    for i, p in enumerate(ps):
        for s in bench.order(i):
            es = bench.engines[s]
            e = es["AB"[turn[s] % 2]] if s in shared else es["A"]
            turn[s] += 1
            before = e.call("metrics")
            bench.idle()
            bench.record("trace_ttft", s, e.ttft(p))
            after = e.call("metrics")
            for key, name in (("trace_ext", "vllm:external_prefix_cache_hits"), ("trace_local", "vllm:prefix_cache_hits")):
                bench.record(key, s, after.get(name, 0) - before.get(name, 0))
            bench.record("trace_tokens", s, len(p))
            # Untimed: vLLM hands a finished request's stores to its connector at the engine's
            # next step; a serving engine takes that step at once, an idle one at its next
            # request. A short new prompt is that step here, for every system alike.
            e.ttft(bench.prompts.new(40))
        if (i + 1) % 16 == 0 or i + 1 == len(ps):
            bench.load.append(os.getloadavg()[0])
            print(f"  trace: {i + 1}/{len(ps)} requests (load {bench.load[-1]:.1f})", flush=True)
            bench.checkpoint()


def rows(bench, kv_bytes_per_token: int) -> list[list[str]]:
    a, times, systems = bench.args, bench.times, list(bench.engines)
    if "trace_ttft" not in times:
        return []
    ttft, ext, local, tokens = (times[k] for k in ("trace_ttft", "trace_ext", "trace_local", "trace_tokens"))
    base = ttft["alone"]
    reqs = trace_requests(a.trace, a.trace_cut)
    distinct = len({b for ids in reqs for b in ids})
    block_bytes = a.trace_block * kv_bytes_per_token
    stores = {"kvtier": parse_size(a.kvtier_pool), "lmcache-lmcache_driven": int(a.lmcache_l1_gb * 2**30),
              "lmcache-engine_driven": int(a.lmcache_l1_gb * 2**30)}
    share = lambda xs, s: sum(xs[s]) / sum(tokens[s])  # noqa: E731
    out = [[f"trace ({len(reqs)} requests, {distinct} blocks of {a.trace_block} tokens): prompt share served by the "
            "store", *(f"{share(ext, s):.3f}" for s in systems)],
           ["... by vLLM's own prefix cache", *(f"{share(local, s):.3f}" for s in systems)],
           ["... an offline LRU of the store's size on the same requests", *(
               f"{lru_reuse(reqs, stores[s] // block_bytes):.3f} ({stores[s] / (distinct * block_bytes):.0%} "
               "of the working set)" if s in stores else "–" for s in systems)]]
    for q in (50, 99):
        out.append([f"trace TTFT p{q} ms", *(f"{pct(ttft[s], q) * 1e3:,.0f}" + (
            "" if s == "alone" else f" ({pct(ttft[s], q) / pct(base, q):.2f}x)") for s in systems)])
    out.append(["trace TTFT, sum over the requests, s", *(
        f"{sum(ttft[s]):,.1f}" + ("" if s == "alone" else f" ({sum(ttft[s]) / sum(base):.2f}x)") for s in systems)])
    out.append(["trace TTFT, median of per-request ratios to vLLM alone", *(
        "" if s == "alone" else f"{median([x / b for x, b in zip(ttft[s], base)]):.2f}" for s in systems)])
    return out

