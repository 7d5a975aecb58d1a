#!/usr/bin/env python3
# Feeds BENCHMARKS.md sections 7 and 7.1.
"""The remote tier across two nodes, against baselines measured in the same run.

Two private daemons ("nodes" A and B) with ``remote`` pointing at a real Redis
Cluster of three masters on loopback, plus a node C without a remote tier.
One engine (this process) per node, single-tensor (MLA-like) caches of N
blocks.

- load: B loads N blocks that only the cluster holds (B's pool flushed before
  each rep: lookup-free load = fetch, verify, commit, copy to the engine),
  next to B loading the same blocks from its own pool (local), and next to a
  plain redis-py cluster pipeline of N GETs of the same values copied into an
  engine tensor (what an engine talking to Redis itself would do).
- lookup: a lookup whose chain is in neither pool nor cluster, on B (remote
  miss: local index + one pipelined EXISTS) and on C (no remote tier); and a
  lookup B answers from the cluster (remote hit).
- store: A (write-behind on) vs C (off), fresh hashes per rep; and how long
  after A's store returned B's lookup first finds the blocks (visibility).
- ``--backlog [--baseline-tree DIR]``: stores of 1x, 2x, 4x, 8x the write-behind
  allowance (``remote_queue``): the share of their blocks that reaches the
  cluster (counted with EXISTS) and the time from the store's reply until the
  node's write-behind is idle (nothing queued, nothing in its backlog). With a
  baseline tree (a ``git worktree`` of an older commit), a node running that
  tree's daemon is measured in the same run, reps alternating with this tree's.

Needs redis-server/redis-cli on PATH and the redis module; otherwise it
prints why and exits 0.

    python scripts/bench_remote.py [--quick] [--json [PATH]]
    python scripts/bench_remote.py --backlog [--baseline-tree /tmp/kvt-base] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import benchlib as bl


SECRET = bytes(range(32))  # both nodes' remote secret (remote_secret_file)
TEAM = "bench"             # the operator's name for this user's tenant on both nodes

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", type=bl.size_list, default=bl.size_list("256KiB,2MiB"))
    p.add_argument("--batch-bytes", type=bl.parse_size, default=bl.parse_size("32MiB"),
                   help="bytes per load/store call (N = this / block size)")
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of timed work per case")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--lookups", type=int, default=400, help="timed lookups per lookup case")
    p.add_argument("--pool-size", default="512MiB")
    p.add_argument("--quick", action="store_true", help="small sizes, short runs (smoke test)")
    p.add_argument("--backlog", action="store_true", help="only the share of long stores that arrives")
    p.add_argument("--baseline-tree", default="", help="--backlog: also a node running this tree's daemon")
    p.add_argument("--queue", type=bl.parse_size, default=bl.parse_size("4MiB"), help="--backlog: remote_queue")
    p.add_argument("--reps", type=int, default=5, help="--backlog: reps per multiple and tree")
    bl.add_json_flag(p)
    args = p.parse_args(argv)
    # python -m puts the working directory first on the daemons' path: run from inside a tree,
    # every node would run that tree's code whatever PYTHONPATH says.
    if args.baseline_tree and not os.path.isdir(os.path.join(args.baseline_tree, "kvtier")):
        p.error(f"--baseline-tree {args.baseline_tree} has no kvtier/")
    if args.baseline_tree and os.path.isdir(os.path.join(os.getcwd(), "kvtier")):
        p.error("with --baseline-tree, run from a directory without kvtier/ (e.g. cd /tmp)")
    if args.reps < 1:
        p.error("--reps must be at least 1")
    if args.quick:
        args.block_sizes, args.batch_bytes = bl.size_list("64KiB"), bl.parse_size("1MiB")
        args.min_time, args.min_reps, args.max_reps, args.lookups = 0.0, 2, 2, 20
        args.pool_size = "64MiB"
    return args


class Engine:
    """One engine on one node: a cache of ``n`` blocks of ``block`` bytes, one namespace."""

    def __init__(self, daemon, block: int, n: int, fill: int, tag: str):
        import torch
        from kvtier.client import Client, Namespace, ShmKVCache
        self.kv = ShmKVCache([(n, block)], torch.uint8)
        g = torch.Generator().manual_seed(fill)
        self.kv.tensors[0].copy_(torch.randint(0, 256, (n, block), generator=g, dtype=torch.uint8))
        self.ns = Namespace("bench-remote", "uint8", "mla", 16, extra=f"{tag}-b{block}")
        self.c = Client(daemon.socket, name="bench-remote", timeout=60, transfer_timeout=600)
        self.c.register_kv_cache(self.kv, [0], self.ns)
        self.ids, self.n, self.block = list(range(n)), n, block

    def ok(self, result) -> None:
        if not result.ok or result.done != self.n:
            raise RuntimeError(f"kvtier transfer failed: {result}")

    def close(self) -> None:
        self.c.close()
        self.kv.close()


def hashes(n: int) -> list[bytes]:
    raw = os.urandom(16 * n)
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]


def remote(daemon) -> dict:
    from kvtier.client import Client
    with Client(daemon.socket, name="bench-probe", heartbeat=False) as c:
        return c.stats()["remote"]


def wait_written(daemon, at_least: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while remote(daemon)["written"] < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"write-behind stalled: {remote(daemon)}")
        time.sleep(0.01)


def load_point(args, cluster, a, b, block: int) -> dict:
    import numpy as np
    from kvtier.pool.keys import ns_key
    from kvtier.remote import values as v
    n = max(1, args.batch_bytes // block)
    ea = Engine(a, block, n, 1, "load")
    eb = Engine(b, block, n, 2, "load")
    keys = hashes(n)
    written = remote(a)["written"]
    ea.ok(ea.c.store(keys, ea.ids).wait())
    wait_written(a, written + n)
    expected = ea.kv.tensors[0].clone()
    eb.kv.tensors[0].zero_()
    eb.ok(eb.c.load(keys, eb.ids).wait())  # through the cluster, verified once here
    if not bool((eb.kv.tensors[0] == expected).all()):
        raise RuntimeError("remote load returned other bytes than were stored")

    r = cluster.client()
    # The daemon keys a namespace by tenant + fingerprint; this process's user is the tenant.
    codec = v.ValueCodec(SECRET)
    ns = codec.namespace(ns_key(TEAM, ea.ns.fingerprint()))
    rkeys = [codec.key(ns, k) for k in keys]
    arr = eb.kv.tensors[0].numpy()

    def redis_get():
        p = r.pipeline(transaction=False)
        for k in rkeys:
            p.get(k)
        for i, val in enumerate(p.execute()):
            arr[i] = np.frombuffer(val, dtype=np.uint8, offset=v.HEADER_BYTES)  # into the engine's block

    fetched = remote(b)["fetched"]
    times = bl.round_robin({
        "remote": (lambda: eb.ok(eb.c.load(keys, eb.ids).wait()), lambda: eb.c.flush(eb.ns)),
        "local": (lambda: eb.ok(eb.c.load(keys, eb.ids).wait()),
                  lambda: eb.c.lookup(keys) == n or eb.ok(eb.c.load(keys, eb.ids).wait())),
        "redis_get": (redis_get, None),
    }, args.min_time, args.min_reps, args.max_reps)
    if remote(b)["fetched"] - fetched < n * len(times["remote"]):
        raise RuntimeError("a 'remote' rep did not fetch from the cluster")
    nbytes = n * block
    row = {"block_bytes": block, "batch": n, "bytes": nbytes,
           **{f"{k}_gbps": bl.gbps(nbytes, bl.median(t)) for k, t in times.items()},
           "reps": {k: len(t) for k, t in times.items()}}
    row["remote_vs_local"] = row["remote_gbps"] / row["local_gbps"]
    row["remote_vs_redis_get"] = row["remote_gbps"] / row["redis_get_gbps"]
    eb.c.flush(eb.ns)
    ea.c.flush(ea.ns)
    ea.close()
    eb.close()
    r.close()
    return row


def lookup_latency(args, a, b, c) -> dict:
    """Per-lookup latency of an 8-block chain nobody holds (miss), on B and C; and of
    a chain only the cluster holds (B asks it every time: lookups do not fetch)."""
    block = 16 * 1024
    eb, ec, ea = Engine(b, block, 8, 3, "lookup"), Engine(c, block, 8, 4, "lookup"), Engine(a, block, 8, 5, "lookup")
    remote_chain = hashes(8)
    written = remote(a)["written"]
    ea.ok(ea.c.store(remote_chain, ea.ids).wait())
    wait_written(a, written + 8)
    miss = hashes(8)

    def timed(engine, chain, expect):
        out = []
        for _ in range(args.lookups):
            t0 = time.perf_counter()
            hits = engine.c.lookup(chain)
            out.append(time.perf_counter() - t0)
            if hits != expect:
                raise RuntimeError(f"lookup found {hits}, expected {expect}")
        return out

    cases = {"miss_no_remote": (ec, miss, 0), "miss_remote": (eb, miss, 0), "hit_remote": (eb, remote_chain, 8)}
    times = {k: [] for k in cases}
    for _ in range(4):  # alternate so all three see the same background load
        for k, (e, chain, expect) in cases.items():
            times[k] += timed(e, chain, expect)
    for e in (ea, eb, ec):
        e.close()
    row = {f"{k}_{p}_us": bl.pct(t, q) * 1e6 for k, t in times.items() for p, q in (("p50", 50), ("p99", 99))}
    row["added_by_remote_miss_p50_us"] = row["miss_remote_p50_us"] - row["miss_no_remote_p50_us"]
    return row


def store_point(args, a, b, c, block: int) -> dict:
    """Store GB/s with write-behind (A) and without a remote tier (C), fresh hashes per
    rep; then how long until another node's lookup finds a just-stored prefix."""
    n = max(1, args.batch_bytes // block)
    ea, ec = Engine(a, block, n, 6, "store"), Engine(c, block, n, 7, "store")

    def settle():  # flush both; let A's write-behind of the previous rep finish (untimed)
        r = remote(a)
        while r["queued_bytes"]:
            time.sleep(0.005)
            r = remote(a)
        for e in (ea, ec):
            e.c.flush(e.ns)

    times = bl.round_robin({
        "write_behind": (lambda: ea.ok(ea.c.store(hashes(n), ea.ids).wait()), settle),
        "no_remote": (lambda: ec.ok(ec.c.store(hashes(n), ec.ids).wait()), settle),
    }, args.min_time, args.min_reps, args.max_reps)
    eb = Engine(b, block, n, 8, "store")
    visible = []
    for _ in range(max(3, args.min_reps)):
        chain = hashes(n)
        ea.ok(ea.c.store(chain, ea.ids).wait())
        t0 = time.perf_counter()
        while eb.c.lookup(chain) < n:
            pass
        visible.append(time.perf_counter() - t0)
    for e in (ea, eb, ec):
        e.c.flush(e.ns)
        e.close()
    nbytes = n * block
    row = {"block_bytes": block, "batch": n, "bytes": nbytes,
           "write_behind_gbps": bl.gbps(nbytes, bl.median(times["write_behind"])),
           "no_remote_gbps": bl.gbps(nbytes, bl.median(times["no_remote"])),
           "visible_on_b_ms": bl.median(visible) * 1e3}
    row["write_behind_vs_no_remote"] = row["write_behind_gbps"] / row["no_remote_gbps"]
    return row


def idle(daemon, timeout: float = 300.0) -> dict:
    """Poll until the node's write-behind has nothing queued and nothing in its backlog."""
    deadline = time.monotonic() + timeout
    while (r := remote(daemon))["queued_bytes"] or r.get("backlog_blocks", 0):
        if time.monotonic() > deadline:
            raise RuntimeError(f"write-behind never idle: {r}")
        time.sleep(0.002)
    return r


def backlog_rows(args, cluster, nodes: dict, block: int) -> list[dict]:
    """Per multiple of the allowance and node: share of a store's blocks in the cluster
    once the node is idle, and how long after the store's reply that was."""
    from kvtier.pool.keys import ns_key
    from kvtier.remote import values as v
    per = args.queue // block
    codec, r = v.ValueCodec(SECRET), cluster.client()
    engines = {tree: Engine(d, block, 8 * per, 11, f"backlog-{tree}") for tree, d in nodes.items()}
    out = {}
    for m in (1, 2, 4, 8):
        n = m * per
        for _ in range(args.reps):
            for tree, d in nodes.items():  # alternate the trees: both see the same load
                e = engines[tree]
                keys = hashes(n)
                res = e.c.store(keys, e.ids[:n]).wait()
                t0 = time.perf_counter()
                if not res.ok or res.done != n:
                    raise RuntimeError(f"store failed: {res}")
                idle(d)
                took = time.perf_counter() - t0
                ns = codec.namespace(ns_key(TEAM, e.ns.fingerprint()))
                rkeys = [codec.key(ns, k) for k in keys]
                # A baseline tree may write an earlier value version: the same key under its prefix.
                rkeys += [b"kvt2:" + k[len(v.KEY_PREFIX):] for k in rkeys]
                p = r.pipeline(transaction=False)
                for k in rkeys:
                    p.exists(k)
                arrived = sum(p.execute())
                p = r.pipeline(transaction=False)
                for k in rkeys:
                    p.delete(k)  # keep the cluster's memory flat across reps
                p.execute()
                e.c.flush(e.ns)
                row = out.setdefault((m, tree), {"multiple": m, "tree": tree, "blocks": n, "share": [], "ms": []})
                row["share"].append(arrived / n)
                row["ms"].append(took * 1e3)
    for e in engines.values():
        e.close()
    r.close()
    return [{**row, "share_min": min(row["share"]), "share_median": bl.median(row["share"]),
             "ms_median": bl.median(row["ms"]), "ms_max": max(row["ms"])} for row in out.values()]


def backlog_main(args, cluster, env: dict) -> dict:
    from kvtier.demo.daemon_proc import PrivateDaemon
    block = 256 * 1024
    pool = max(64 * 2**20, 32 * args.queue)  # 8x the allowance fits 4 times over; the queue is below pool/4
    env = {**env, "KVTIER_REMOTE_QUEUE": str(args.queue)}
    trees = {"this": {}}
    if args.baseline_tree:
        trees["baseline"] = {"PYTHONPATH": os.path.abspath(args.baseline_tree)}
    nodes = {}
    try:
        for tree, extra in trees.items():
            nodes[tree] = PrivateDaemon(str(pool), "8MiB", env={**env, **extra})
        # Which nodes report a write backlog (only daemons from issue 35 on have one).
        backlogs = {tree: "backlog_blocks" in remote(d) for tree, d in nodes.items()}
        rows = backlog_rows(args, cluster, nodes, block)
    finally:
        for d in nodes.values():
            d.stop()
    report = {"machine": bl.machine_notes(), "queue_bytes": args.queue, "block_bytes": block,
              "baseline_tree": args.baseline_tree, "has_backlog": backlogs, "rows": rows}
    table = bl.table(["x allowance", "blocks", "tree", "share arrived (median)", "min", "ms until idle (median)",
                      "max ms"],
                     [[r["multiple"], r["blocks"], r["tree"], r["share_median"], r["share_min"], r["ms_median"],
                       r["ms_max"]] for r in sorted(rows, key=lambda r: (r["multiple"], r["tree"]))],
                     f"Stores of 1-8x the write-behind allowance ({bl.short_size(args.queue)}, "
                     f"{bl.short_size(block)} blocks)")
    bl.emit(report, [table], args.json)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    from tests.remote.cluster import LocalCluster, why_missing
    why = why_missing()
    if why:
        print(f"bench_remote: skipped: {why}")
        return 0
    from kvtier.demo.daemon_proc import PrivateDaemon
    # Store reps write fresh blocks: cap the masters (LRU) so the run cannot eat the machine's RAM.
    cluster = LocalCluster(maxmemory="512mb", policy="allkeys-lru")
    secret_dir = tempfile.mkdtemp(prefix="kvtier-bench-secret-")
    secret = os.path.join(secret_dir, "remote.secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(f'key = "{SECRET.hex()}"\n')
    env = {"KVTIER_REMOTE": cluster.url, "KVTIER_REMOTE_TTL_S": "600", "KVTIER_REMOTE_SECRET_FILE": secret,
           "KVTIER_TENANTS": f"{TEAM}:{os.geteuid()}"}
    if args.backlog:
        try:
            backlog_main(args, cluster, env)
        finally:
            cluster.close()
            shutil.rmtree(secret_dir, ignore_errors=True)
        return 0
    slab = max(8 * 2**20, max(args.block_sizes))
    daemons = []
    try:
        a, b = (PrivateDaemon(args.pool_size, str(slab), env=env) for _ in range(2))
        daemons += [a, b]
        c = PrivateDaemon(args.pool_size, str(slab))
        daemons.append(c)
        loads = [load_point(args, cluster, a, b, blk) for blk in args.block_sizes]
        lookup = lookup_latency(args, a, b, c)
        stores = [store_point(args, a, b, c, blk) for blk in args.block_sizes]
    finally:
        for d in daemons:
            d.stop()
        cluster.close()
        shutil.rmtree(secret_dir, ignore_errors=True)
    report = {"machine": bl.machine_notes(), "cluster": "3 masters, loopback, redis-server "
              + os.popen("redis-server --version").read().split()[2].split("=")[1],
              "load": loads, "lookup": lookup, "store": stores}
    tables = [
        bl.table(["block", "N", "remote load GB/s", "local load GB/s", "redis GET GB/s", "remote/local",
                  "remote/GET"],
                 [[bl.short_size(r["block_bytes"]), r["batch"], r["remote_gbps"], r["local_gbps"],
                   r["redis_get_gbps"], r["remote_vs_local"], r["remote_vs_redis_get"]] for r in loads],
                 "Load N blocks on node B"),
        bl.table(["case", "p50 us", "p99 us"],
                 [[k, lookup[f"{k}_p50_us"], lookup[f"{k}_p99_us"]]
                  for k in ("miss_no_remote", "miss_remote", "hit_remote")],
                 f"Lookup of an 8-block chain (remote miss adds {lookup['added_by_remote_miss_p50_us']:.0f} us p50)"),
        bl.table(["block", "N", "store GB/s write-behind", "store GB/s no remote", "ratio", "visible on B ms"],
                 [[bl.short_size(r["block_bytes"]), r["batch"], r["write_behind_gbps"], r["no_remote_gbps"],
                   r["write_behind_vs_no_remote"], r["visible_on_b_ms"]] for r in stores],
                 "Store on node A"),
    ]
    bl.emit(report, tables, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
