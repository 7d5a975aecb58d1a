#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 17.
"""A public serving trace through real daemons and real engine processes.

    python scripts/bench_trace.py [--trace FILE] [--requests N] [--capacities 0.02,0.05,0.1,0.2,0.4]
                                  [--engines 4] [--scenarios shared-spread,private-spread,...]
                                  [--block-bytes 16KiB] [--disk-x 10] [--no-drain] [--verify-every 8]
                                  [--lookup-index default|on|off|off,on] [--rounds 1] [--json FILE]
                                  [--split K] [--copies N]

Each request of the trace (``../shared/traces/README.md``: one id per
prefix-chained block) goes, in trace order, to one of ``--engines`` engine
processes. The engine does what a serving engine does with kvtier: a lookup
of the request's block keys, a load of the hit prefix into its paged cache
(every ``--verify-every``-th loaded block checked byte for byte against the
bytes its id stands for), then a store of the rest. One trace block is one
kvtier block of ``--block-bytes``. Requests go one at a time (the next is
sent once the last one's store is committed), so a run is deterministic
and comparable with the in-process references computed on the same
sequence (``tracesim.py``): an infinite cache, kvtier's LRU order, and the
offline bound (Belady); for the disk rows, the daemon's RAM-over-disk order
simulated and one LRU of the pool and the disk together.

Capacity is a share of the working set (the distinct blocks the replayed
requests name); each daemon's pool is sized to whole slabs of 16 blocks
and holds the capacity rounded up to 16 (printed). Scenarios:
  shared-spread    one daemon of capacity C; requests round robin over the engines
                   (a load balancer without session affinity)
  private-spread   one daemon of C/E per engine (each engine its own tier), round robin
  shared-sticky    one daemon of C; a request goes to the engine of its first block
                   (prefix-affinity routing: a conversation or document stays on one engine)
  private-sticky   private daemons of C/E, sticky routing
  disk             shared-spread plus the disk tier holding --disk-x times the pool's blocks
                   (its disk_size counts each file's 4 KiB header: at small test blocks a
                   disk_size of 10x the pool's bytes would hold only 5x its 4 KiB blocks);
                   each request waits for the disk's writes to finish (``--no-drain``: not),
                   as the trace's seconds between requests would let it
At scale: ``--split K`` makes each trace block K kvtier blocks (an engine
whose blocks are 512/K tokens: 32 for 16-token blocks), in order, one id
each; ``--copies N`` replays N disjoint copies of the trace at once, copy c
rotated by c/N of its length and the copies interleaved request by request,
each copy the traffic of its own model: its own namespace and engine
(``--engines`` is N then, and routing is by copy). The working set is
N x K x the trace's; the references (LRU sim, bound) are simulated on the
unsplit trace blocks with the pool's blocks / K (a trace block's K blocks go
and come together). The daemon's anon RSS (heap, outside the shared pool)
is printed per block held at the end, next to its RSS before the replay.
``--lookup-index off,on`` runs each scenario with the daemon's lookup mirror
off and on in turn (``--rounds`` times), so both see the same background
load; ``default`` leaves the daemon's own default.
Printed per scenario and capacity: the hit ratio (blocks loaded over blocks
requested), the daemon's own hit count, the references, lookup/load/store
p50/p99 and requests/s. Hit ratios do not depend on the machine (the disk
rows' only with the wait for writes: with ``--no-drain`` a busy machine's
disk falls behind and loses blocks); latencies do (one request at a time,
engines and daemons on the same cores).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import benchlib as bl
import tracesim

SCENARIOS = ("shared-spread", "private-spread", "shared-sticky", "private-sticky", "disk")
SLAB_BLOCKS = 16


def key_of(block_id: int) -> bytes:
    """The kvtier key of a trace block: the same in every engine process."""
    return hashlib.blake2b(block_id.to_bytes(8, "little", signed=True), digest_size=16).digest()


# ---- an engine process ----------------------------------------------------------------
def engine_main(index: int, sockets: list[str], block_bytes: int, max_blocks: int, verify_every: int,
                conn, namespace: str = "bench-trace") -> None:
    """One engine: its own paged cache and client. Commands over ``conn``:
    ("req", ids) -> (hit, verified, bad, lookup_s, load_s, store_s); ("report", None) -> the
    mirror's lookup counts sent to the daemon now (they go at most every 0.2 s with a
    transfer, else on the heartbeat: stats read right after the last request would miss
    the last ones); None to stop."""
    import traceback

    import torch

    from kvtier.client import Client, Namespace, ShmKVCache

    torch.set_num_threads(1)
    try:
        kv = ShmKVCache([(max_blocks, block_bytes // 2)], torch.float16)
        words = kv.tensors[0].view(torch.int64)  # block j of a request lives in engine block j
        client = Client(sockets[index % len(sockets)], name=f"trace-engine-{index}", timeout=60,
                        transfer_timeout=600)
        client.register_kv_cache(kv, [0], Namespace(namespace, "float16", "trace", 512))
        conn.send(("up", None))
        while (cmd := conn.recv()) is not None:
            if cmd[0] == "report":
                client.ping()  # reports the counts (a round trip): by its reply they count
                conn.send(("ok", None))
                continue
            ids = cmd[1]
            keys = [key_of(b) for b in ids]
            t0 = time.perf_counter()
            hit = client.lookup(keys)
            t1 = time.perf_counter()
            verified = bad = 0
            if hit:
                words[:hit].fill_(-1)
                res = client.load(keys[:hit], list(range(hit))).wait()
                if res.failed:  # evicted between lookup and load: the hit ends at the first failure
                    hit = min(res.failed)
                for j in range(0, hit, verify_every):
                    verified += 1
                    bad += int(not bool((words[j] == ids[j]).all()))
            t2 = time.perf_counter()
            for j in range(hit, len(ids)):  # "prefill": the block's bytes stand for its id
                words[j].fill_(ids[j])
            res = client.store(keys[hit:], list(range(hit, len(ids)))).wait() if hit < len(ids) else None
            t3 = time.perf_counter()
            # A request longer than a small private pool stores its head only (no_space): an
            # engine goes on without the rest cached. Anything else is the daemon failing.
            if res is not None and not res.ok and not res.no_space:
                raise RuntimeError(f"store failed: {res}")
            conn.send(("ok", (hit, verified, bad, t1 - t0, t2 - t1 if hit else None,
                              t3 - t2 if res is not None else None)))
        client.close()
        kv.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# ---- one scenario at one capacity ------------------------------------------------------
def route(chains: list[list[int]], engines: int, sticky: bool, copies: int = 1) -> list[int]:
    if copies > 1:  # interleaved copies: request i is copy i % copies, its model's engine
        return [i % copies for i in range(len(chains))]
    if sticky:
        return [int.from_bytes(key_of(c[0])[:4], "little") % engines if c else 0 for c in chains]
    return [i % engines for i in range(len(chains))]


def run_scenario(name: str, chains: list[list[int]], capacity: int, args, mirror: str = "default") -> dict:
    from kvtier.client import Client
    from kvtier.demo.daemon_proc import PrivateDaemon

    private = name.startswith("private")
    sticky = name.endswith("sticky")
    per_daemon = -(-capacity // args.engines) if private else capacity
    slabs = max(1, -(-per_daemon // SLAB_BLOCKS))
    slab = SLAB_BLOCKS * args.block_bytes
    extra, disk_dir = ["--config", os.devnull], None
    if name == "disk":
        disk_dir = tempfile.mkdtemp(prefix="kvtier-trace-disk-")
    daemons, engines, pipes, drain = [], [], [], None
    env = {"OMP_NUM_THREADS": "1"}
    if mirror != "default":
        env["KVTIER_LOOKUP_INDEX"] = "true" if mirror == "on" else "false"
    if disk_dir:
        from kvtier.disk.format import HEADER_BYTES
        disk_blocks = int(args.disk_x * slabs * SLAB_BLOCKS)
        env.update(KVTIER_DISK_PATH=disk_dir,
                   KVTIER_DISK_SIZE=str(max(2**20, disk_blocks * (HEADER_BYTES + args.block_bytes))))
    try:
        for _ in range(args.engines if private else 1):
            daemons.append(PrivateDaemon(pool_size=str(slabs * slab), slab_size=str(slab), extra=tuple(extra),
                                         env=env))
        sockets = [d.socket for d in daemons]
        ctx = mp.get_context("spawn")
        for i in range(args.engines):
            ours, theirs = ctx.Pipe()
            ns = f"bench-trace-{i}" if args.copies > 1 else "bench-trace"  # a model per copy
            p = ctx.Process(target=engine_main, args=(i, sockets, args.block_bytes,
                                                      max(len(c) for c in chains), args.verify_every, theirs, ns),
                            daemon=True)
            p.start()
            engines.append(p)
            pipes.append(ours)
        for conn in pipes:
            _answer(conn)
        hits = verified = bad = 0
        lat = {"lookup": [], "load": [], "store": []}
        drain = Client(sockets[0], heartbeat=False, name="trace-drain") if disk_dir and args.drain else None
        rss0 = [anon_rss(d.proc.pid) for d in daemons]
        t0 = time.perf_counter()
        for ids, e in zip(chains, route(chains, args.engines, sticky, args.copies)):
            pipes[e].send(("req", ids))
            h, v, b, lk, ld, st = _answer(pipes[e])
            if drain is not None:
                _drained(drain)
            hits, verified, bad = hits + h, verified + v, bad + b
            for k, x in (("lookup", lk), ("load", ld), ("store", st)):
                if x is not None:
                    lat[k].append(x)
        wall = time.perf_counter() - t0
        for conn in pipes:  # every hit an engine's mirror answered is in the daemon's counts
            conn.send(("report", None))
            _answer(conn)
        rss1 = [anon_rss(d.proc.pid) for d in daemons]
        daemon_hits = held = 0
        disk: dict = {}
        for d in daemons:
            with Client(d.socket, heartbeat=False, name="trace-stats") as c:
                s = c.stats()
            daemon_hits += s["totals"]["hits"]
            held += sum(ns["blocks"] for ns in s["namespaces"])
            if s.get("disk", {}).get("enabled"):  # what reached the disk, and what did not and why
                disk = {k: v for k, v in s["disk"].items()
                        if k == "not_written" or isinstance(v, (int, float)) and not isinstance(v, bool)}
        refs = tracesim.references(chains)
        row = {"scenario": name, "mirror": mirror, "capacity_blocks": capacity, "daemons": len(daemons),
               "pool_blocks_each": slabs * SLAB_BLOCKS, "hit_ratio": hits / refs, "daemon_hits": daemon_hits,
               "references": refs, "verified_blocks": verified, "bad_blocks": bad, "blocks_held_at_end": held,
               "requests_per_s": len(chains) / wall, "disk": disk, "drained": drain is not None,
               "rss_before_mib": sum(rss0) / 2**20, "rss_after_mib": sum(rss1) / 2**20,
               "rss_per_block_held": (sum(rss1) - sum(rss0)) / held if held else None}
        for k, xs in lat.items():
            row[f"{k}_p50_ms"] = round(bl.pct(xs, 50) * 1e3, 3) if xs else None
            row[f"{k}_p99_ms"] = round(bl.pct(xs, 99) * 1e3, 3) if xs else None
        return row
    finally:
        for conn in pipes:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in engines:
            p.join(30)
            if p.is_alive():
                p.kill()
        if drain is not None:
            drain.close()
        for d in daemons:
            d.stop()
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)


def anon_rss(pid: int) -> int:
    """A daemon's resident memory outside the shared pool (its heap: the index, buffers)."""
    import psutil
    mi = psutil.Process(pid).memory_info()
    return mi.rss - mi.shared


def expand(chains: list[list[int]], split: int, copies: int) -> list[list[int]]:
    """``copies`` disjoint copies of the trace interleaved (copy c rotated by c/copies of it),
    each trace block ``split`` kvtier blocks in order."""
    n, span = len(chains), max((b for c in chains for b in c), default=0) + 1
    out = []
    for i in range(n):
        for c in range(copies):
            ids = chains[(i + c * n // copies) % n]
            out.append([(c * span + b) * split + j for b in ids for j in range(split)])
    return out


def _drained(client) -> None:
    """Wait until the disk tier has written every block stored so far. The trace's requests
    come seconds apart; the replay's come back to back, and on a busy machine the write-behind
    falls behind and RAM evicts blocks before their turn (the disk's ``not_written``): a hit
    ratio that measures the machine, not what the tiers keep."""
    while True:
        d = client.stats()["disk"]
        if not d["queued_bytes"] and not d["backlog_blocks"]:
            return
        time.sleep(0.005)  # a stats call takes the loop thread, whose process also runs the writes


def _answer(conn):
    status, value = conn.recv()
    if status == "error":
        raise SystemExit(f"engine process failed:\n{value}")
    return value


def references_for(name: str, chains: list[list[int]], pool_blocks: int, engines: int, disk_x: float,
                   copies: int = 1) -> dict:
    """In-process hit ratios on exactly the sequence(s) the scenario's daemons see,
    with the blocks each daemon's pool really holds (and its disk, for ``disk``)."""
    if copies > 1 and name.startswith("private"):  # a daemon per engine: one per copy
        groups = [[c for i, c in enumerate(chains) if i % copies == e] for e in range(copies)]
    elif not name.startswith("private"):
        groups = [chains]
    else:
        routes = route(chains, engines, name.endswith("sticky"))
        groups = [[c for c, e in zip(chains, routes) if e == i] for i in range(engines)]
    caps = [pool_blocks] * len(groups)
    refs = tracesim.references(chains)
    out = {}
    for policy in ("lru", "belady") + (("ram+disk", "lru-combined") if name == "disk" else ()):
        out[policy] = sum(tracesim.hit_ratio(policy, cap, g, disk_x) * tracesim.references(g)
                          for g, cap in zip(groups, caps)) / refs
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=tracesim.DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
    ap.add_argument("--capacities", default="0.02,0.05,0.1,0.2,0.4")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--block-bytes", type=bl.parse_size, default=16 * 1024)
    ap.add_argument("--disk-x", type=float, default=10.0, help="disk: the disk tier holds this many pools of blocks")
    ap.add_argument("--no-drain", dest="drain", action="store_false",
                    help="disk: send the next request without waiting for the disk's writes to finish")
    ap.add_argument("--verify-every", type=int, default=8)
    ap.add_argument("--lookup-index", default="default",
                    help="the lookup mirror: default, on, off, or a list run in turn (off,on)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every scenario x mirror setting this often")
    ap.add_argument("--split", type=int, default=1, help="kvtier blocks per trace block (32: 16-token blocks)")
    ap.add_argument("--copies", type=int, default=1, help="disjoint copies of the trace at once, a model each")
    bl.add_json_flag(ap)
    args = ap.parse_args(argv)
    if not 0 < args.disk_x < 1e6:
        raise SystemExit(f"--disk-x must be a positive number of pools, not {args.disk_x}")
    bad = [s for s in args.scenarios.split(",") if s not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenarios {bad}; choose from {SCENARIOS}")
    mirrors = args.lookup_index.split(",")
    if not mirrors or any(m not in ("default", "on", "off") for m in mirrors):
        raise SystemExit(f"--lookup-index takes default, on, off or a list of them, not {args.lookup_index!r}")
    if not 1 <= args.rounds <= 100:
        raise SystemExit(f"--rounds must be 1-100, not {args.rounds}")
    if args.block_bytes % 256 or args.block_bytes < 256:
        raise SystemExit("--block-bytes must be a multiple of 256")
    if not 1 <= args.split <= 512 or not 1 <= args.copies <= 64:
        raise SystemExit(f"--split must be 1-512 and --copies 1-64, not {args.split} and {args.copies}")
    if args.copies > 1:
        args.engines = args.copies  # an engine per copy: each copy is a model of its own
    trace = [r["hash_ids"] for r in tracesim.load_trace(args.trace, args.requests)]
    blocks = expand(trace, 1, args.copies)  # what the references simulate: trace blocks
    chains = expand(trace, args.split, args.copies)  # the trace itself when both are 1
    ws = tracesim.working_set(blocks) * args.split
    infinite = tracesim.hit_ratio("infinite", 0, blocks)
    rows = []
    for share in (float(x) for x in args.capacities.split(",")):
        capacity = max(1, int(ws * share))
        for name, mirror in [(n, m) for _ in range(args.rounds) for n in args.scenarios.split(",") for m in mirrors]:
            row = run_scenario(name, chains, capacity, args, mirror)
            refs = references_for(name, blocks, row["pool_blocks_each"] // args.split, args.engines, args.disk_x,
                                  args.copies)
            row.update(capacity=share, infinite=infinite, sim_lru=refs["lru"], sim_belady=refs["belady"],
                       sim_ram_disk=refs.get("ram+disk"), sim_lru_combined=refs.get("lru-combined"))
            tiers = (f", ram+disk sim {refs['ram+disk']:.3f}, one lru of both {refs['lru-combined']:.3f}"
                     if name == "disk" else "")
            rows.append(row)
            rss = (f", daemon heap {row['rss_before_mib']:.0f} -> {row['rss_after_mib']:.0f} MiB: "
                   f"{row['rss_per_block_held']:.0f} B/block held" if row["rss_per_block_held"] else "")
            print(f"{share:>5.0%} {name:<15} mirror {mirror:<7} hit {row['hit_ratio']:.3f} (lru sim {refs['lru']:.3f}, "
                  f"bound {refs['belady']:.3f}, infinite {infinite:.3f}{tiers})  {row['requests_per_s']:.0f} req/s; "
                  f"lookup p50/p99 {row['lookup_p50_ms']}/{row['lookup_p99_ms']} ms, {row['blocks_held_at_end']} "
                  f"blocks held{rss}", file=sys.stderr, flush=True)
    report = {"trace": os.path.basename(args.trace), "requests": len(chains), "working_set_blocks": ws,
              "engines": args.engines, "block_bytes": args.block_bytes, "split": args.split,
              "copies": args.copies, "rows": rows,
              "machine": bl.machine_notes()}
    table = bl.table(
        ["capacity", "scenario", "mirror", "pool blocks", "hit ratio", "LRU sim", "bound", "RAM+disk sim", "LRU of both",
         "daemon hits", "bad",
         "lookup p50/p99 ms", "load p50/p99 ms", "store p50/p99 ms", "req/s"],
        [[f"{r['capacity']:.0%}", r["scenario"], r["mirror"], f"{r['daemons']}x{r['pool_blocks_each']}",
          f"{r['hit_ratio']:.3f}", f"{r['sim_lru']:.3f}", f"{r['sim_belady']:.3f}",
          *(f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("sim_ram_disk", "sim_lru_combined")), r["daemon_hits"],
          r["bad_blocks"], f"{r['lookup_p50_ms']}/{r['lookup_p99_ms']}", f"{r['load_p50_ms']}/{r['load_p99_ms']}",
          f"{r['store_p50_ms']}/{r['store_p99_ms']}", round(r["requests_per_s"])] for r in rows],
        f"{report['trace']}: {len(chains)} requests, working set {ws} blocks of {bl.short_size(args.block_bytes)}, "
        f"{args.engines} engines; infinite-cache hit ratio {infinite:.3f}")
    bl.emit(report, [table], args.json)
    return 1 if any(r["bad_blocks"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
