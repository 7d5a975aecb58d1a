# Feeds BENCHMARKS.md section 19 (the disk row; 19.1), run through bench_peers.py --disk.
"""The disk row of ``scripts/bench_peers.py`` (``--disk SIZE``): a hit served from each
system's local disk tier, its RAM tier having dropped the prompt.

kvtier: its daemon's disk tier (``disk_path``, ``disk_size`` SIZE in its config file). LMCache: its
server's file-system L2 adapter (``--l2-adapter '{"type": "fs", "base_path": ...}'``;
it has no size limit, so SIZE does not bound it). Each round: engine A computes a new
prompt (stored in RAM and written behind to disk), then untimed new prompts through A
fill the RAM tier (``--kvtier-pool``, ``--lmcache-l1-gb``) twice over, so the prompt is
on disk only; then engine B, a second process, asks for it: TTFT and the prompt tokens
it got from the connector. Then each store's service restarts (SIGTERM, started again
with the same settings and directories) and B asks once more: what a restart keeps. vLLM alone: A recomputes it (its prefix cache dropped), the
baseline. Every system's files live under the run's temporary directory: use a pool
small enough to flood, and a directory on the disk you would give the tier.
"""

from __future__ import annotations

import json
import math
import os
import time

import peers_systems as ps
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
        if r == a.disk_rounds - 1:  # the services restart once, at the end (see after_restart)
            after_restart(bench, r, p, shared)
        bench.load.append(os.getloadavg()[0])
        print(f"  disk round {r + 1}/{a.disk_rounds} done (load {bench.load[-1]:.1f})", flush=True)
        bench.checkpoint()


def after_restart(bench, r: int, p: list[int], shared: tuple[str, ...]) -> None:
    """What a restart keeps: each store's service is stopped (SIGTERM) and started again
    with the same settings, socket or port and disk directory; B, its own prefix cache
    dropped, asks for the prompt again: TTFT and the prompt tokens it got. Once, after the
    last round: with LMCache 0.5.6 the next disk hit after its server's restart ended
    engine B (vLLM's scheduler asserting on a transfer of a request it does not know)."""
    a = bench.args
    for s in bench.order(r):
        if s not in shared:
            continue
        old = bench.services[s]
        old.stop()
        if s == "kvtier":
            bench.services[s], _ = ps.start_kvtier(bench.tmp, a.kvtier_pool, bench.env(),
                                                   kvtier_config(bench.tmp, a.disk))
        else:
            mode = s.split("-", 1)[1]
            bench.services[s], _ = ps.start_lmcache(bench.tmp, mode, a.lmcache_l1_gb, bench.env(),
                                                    lmcache_flags(bench.tmp, mode), port=old.port)
    time.sleep(5)  # engines reconnect (kvtier's client: its keeper; LMCache's: ZeroMQ to the same port)
    wait_for_disk(bench)  # kvtier's start-up scan of its disk directory
    for s in bench.order(r):
        e = bench.hit_engine(s)
        e.call("reset")  # B served the prompt a moment ago: its own prefix cache must not
        before = e.call("metrics").get("vllm:external_prefix_cache_hits", 0)
        bench.idle()
        bench.record("restart_hit", s, e.ttft(p))
        bench.record("restart_hit_tokens", s, e.call("metrics").get("vllm:external_prefix_cache_hits", 0) - before)


def kvtier_disk(bench) -> dict:
    if "kvtier" not in bench.services:
        return {}
    from kvtier.client import Client
    with Client(os.path.join(bench.tmp, "kvtier.sock"), name="bench-disk") as c:
        return c.stats()["disk"]


def wait_for_disk(bench, timeout: float = 120) -> None:
    """kvtier: until its disk tier has nothing queued and its start-up scan ended; LMCache has
    no such probe (its writes get the same idle gaps, and a few seconds more here)."""
    if "kvtier" in bench.services:
        from kvtier.client import Client
        deadline = time.monotonic() + timeout
        with Client(os.path.join(bench.tmp, "kvtier.sock"), name="bench-disk") as c:
            while time.monotonic() < deadline and (c.stats()["disk"].get("queued_bytes", 0)
                                                   or c.stats()["disk"].get("scanning")):
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
                    if s in times.get("disk_loaded_blocks", {}) else "") for s in systems)],
            *restart_rows(times, systems, base)]


def restart_rows(times: dict, systems: list[str], base: float) -> list[list[str]]:
    got, tokens = times.get("restart_hit"), times.get("restart_hit_tokens", {})
    if not got:
        return []
    return [["the same prompt after the store's service restarted, TTFT median ms", *(
                f"{median(got[s]) * 1e3:,.0f}" + ("" if s == "alone" else f" ({median(got[s]) / base:.2f}x)")
                for s in systems)],
            ["prompt tokens served after the restart, median", *(
                "–" if s == "alone" else f"{median(tokens[s]):,.0f}" for s in systems)]]
