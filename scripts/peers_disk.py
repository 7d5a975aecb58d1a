# Feeds BENCHMARKS.md section 19 (the disk row; 19.1), run through bench_peers.py --disk.
"""The disk row of ``scripts/bench_peers.py`` (``--disk SIZE``): a hit served from each
system's local disk tier, its RAM tier having dropped the prompt.

kvtier: its daemon's disk tier (``disk_path``, ``disk_size`` SIZE in its config file). LMCache: its
server's file-system L2 adapter (``--l2-adapter '{"type": "fs", "base_path": ...}'``;
it has no size limit, so SIZE does not bound it). Each round: engine A computes a new
prompt (stored in RAM and written behind to disk), then untimed new prompts through A
fill the RAM tier (``--kvtier-pool``, ``--lmcache-l1-gb``) twice over, so the prompt is
on disk only; then engine B, a second process, asks for it: TTFT and the prompt tokens
it got from the connector. vLLM alone: A recomputes it (its prefix cache dropped), the
baseline. Every system's files live under the run's temporary directory: use a pool
small enough to flood, and a directory on the disk you would give the tier.
"""

from __future__ import annotations

import json
import math
import os
import time

from benchlib import median, parse_size

MAX_FLOOD = 400


def kvtier_config(tmp: str, size: str) -> str:
    """The daemon's config file: its disk tier (the daemon has no flag for it)."""
    path = os.path.join(tmp, "kvtier-disk")
    os.makedirs(path, mode=0o700, exist_ok=True)
    config = os.path.join(tmp, "kvtier-disk.toml")
    with open(config, "w") as f:
        # 4 MiB slabs: a pool small enough to flood still holds several (the default is 64 MiB).
        f.write(f"disk_path = {json.dumps(path)}\ndisk_size = {json.dumps(size)}\nslab_size = \"4MiB\"\n")
    return config


def lmcache_flags(tmp: str, mode: str) -> list[str]:
    path = os.path.join(tmp, f"lmcache-disk-{mode}")
    os.makedirs(path, exist_ok=True)
    return ["--l2-adapter", json.dumps({"type": "fs", "base_path": path})]


def ram_bytes(args, system: str) -> int:
    if system == "kvtier":
        return parse_size(args.kvtier_pool)
    return int(args.lmcache_l1_gb * 2**30)


def rounds(bench, shared: tuple[str, ...], kv_bytes_per_token: int) -> None:
    a = bench.args
    n = a.prefix_tokens + a.suffix_tokens
    for r in range(a.disk_rounds):
        p = bench.prompts.new(n)
        for s in bench.order(r):
            bench.idle()
            bench.engines[s]["A"].ttft(p)  # stored: RAM, then written behind to disk
        bench.settle()
        longest = bench.max_len() - 64  # flood with the longest prompts the engines take: fewest calls
        for s in bench.engines:
            if s not in shared:
                continue
            flood = math.ceil(2 * ram_bytes(a, s) / (longest * kv_bytes_per_token))
            if flood > MAX_FLOOD:
                raise SystemExit(f"--disk: flooding {s}'s RAM tier takes {flood} prompts of {longest} tokens; "
                                 "give it a smaller pool (--kvtier-pool, --lmcache-l1-gb)")
            for _ in range(flood):  # untimed: push the prompt out of the RAM tier
                bench.engines[s]["A"].ttft(bench.prompts.new(longest))
        bench.settle()
        wait_for_disk(bench)
        read0 = kvtier_disk(bench).get("loaded", 0)
        for s in bench.order(r):
            e = bench.hit_engine(s)
            before = e.call("metrics").get("vllm:external_prefix_cache_hits", 0)
            bench.idle()
            bench.record("disk_hit", s, e.ttft(p))
            bench.record("disk_hit_tokens", s, e.call("metrics").get("vllm:external_prefix_cache_hits", 0) - before)
        if "kvtier" in bench.services:  # proof the hit came from disk: blocks its disk tier served
            bench.record("disk_loaded_blocks", "kvtier", kvtier_disk(bench).get("loaded", 0) - read0)
        bench.load.append(os.getloadavg()[0])
        print(f"  disk round {r + 1}/{a.disk_rounds} done (load {bench.load[-1]:.1f})", flush=True)
        bench.checkpoint()


def kvtier_disk(bench) -> dict:
    if "kvtier" not in bench.services:
        return {}
    from kvtier.client import Client
    with Client(os.path.join(bench.tmp, "kvtier.sock"), name="bench-disk") as c:
        return c.stats()["disk"]


def wait_for_disk(bench, timeout: float = 120) -> None:
    """kvtier: until its disk tier has nothing queued; LMCache has no such probe (its writes
    get the same idle gaps, and a few seconds more here)."""
    if "kvtier" in bench.services:
        from kvtier.client import Client
        deadline = time.monotonic() + timeout
        with Client(os.path.join(bench.tmp, "kvtier.sock"), name="bench-disk") as c:
            while time.monotonic() < deadline and c.stats()["disk"].get("queued_bytes", 0):
                time.sleep(0.1)
    time.sleep(3)


def rows(bench) -> list[list[str]]:
    times, systems = bench.times, list(bench.engines)
    got, tokens = times.get("disk_hit"), times.get("disk_hit_tokens", {})
    if not got:
        return []
    base = median(got["alone"])
    return [["hit from the local disk tier (RAM tier flooded), TTFT median ms", *(
                f"{median(got[s]) * 1e3:,.0f}" + ("" if s == "alone" else f" ({median(got[s]) / base:.2f}x)")
                for s in systems)],
            ["prompt tokens served on that hit, median", *(
                "–" if s == "alone" else f"{median(tokens[s]):,.0f}" + (
                    f" ({median(times['disk_loaded_blocks'][s]):,.0f} blocks read from disk)"
                    if s in times.get("disk_loaded_blocks", {}) else "") for s in systems)]]
