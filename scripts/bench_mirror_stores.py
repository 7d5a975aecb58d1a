#!/usr/bin/env python3
"""What the lookup mirror costs a store that evicts, RAM only (BENCHMARKS.md 20.4).

Three daemons of this checkout (or of ``--tree``) run side by side, RAM only,
each with a pool that is full after the first stores, so every store evicts
as many blocks as it adds:

  off      ``lookup_index = false``: the engine's lookup is a round trip
  on       ``lookup_index = true``: the lookup is answered from the mirror,
           the client reports its counts to the daemon (``LookupsAnswered``)
  on-quiet the same, with the client's count reports switched off: what
           is left is the daemon's table writes (adds before the store's
           reply, the eviction pass's removals)

Per iteration, in turn on the three: a lookup of a new chain (a miss), then
a store of it, timed (``--blocks`` blocks of ``--block-bytes``). Printed: the
store's p50/p90/p99 per daemon, and in process how often a table of the
pool's size is rehashed under the same churn (tombstones left by removals
fill it).

    python scripts/bench_mirror_stores.py [--stores 2400] [--blocks 24] [--block-bytes 4KiB]
                                          [--tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}.{j}".encode(), digest_size=16).digest() for j in range(n)]


def rehashes(pool_blocks: int, blocks: int, stores: int) -> int:
    """Rehashes of a mirror table of ``pool_blocks`` keys under the daemon's churn: each
    store adds ``blocks`` new keys and its eviction pass removes the oldest ``blocks``."""
    from kvtier.daemon.lookup_index import LookupIndexes
    from kvtier.pool.bucket import Bucket
    from kvtier.pool.shm_index import ShmIndexWriter
    mirrors = LookupIndexes(pool_bytes=pool_blocks * 4096, budget=pool_blocks * 4096 // 16)
    ns = Bucket(id=1, key="bench\x1ffp", block_bytes=4096, cls=0)
    mirrors.segment_for(ns, lambda: [])
    count, orig = [0], ShmIndexWriter._rehash

    def counted(self):
        count[0] += 1
        orig(self)
    ShmIndexWriter._rehash = counted
    try:
        live: list[bytes] = []
        for i in range(stores):
            if len(live) + blocks > pool_blocks:
                with mirrors.batch():
                    for k in live[:blocks]:
                        mirrors.removed(ns, k)
                live = live[blocks:]
            new = keys_of(f"r{i}", blocks)
            mirrors.stored(ns, new)
            live += new
    finally:
        ShmIndexWriter._rehash = orig
        mirrors.close()
    return count[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", type=int, default=2400, help="stores per daemon (the first 200 are not timed)")
    ap.add_argument("--blocks", type=int, default=24, help="blocks per store")
    ap.add_argument("--block-bytes", default="4KiB")
    ap.add_argument("--tree", default=REPO, help="the kvtier checkout whose daemon and client run")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write the full report as JSON to PATH (tables still printed); alone: JSON on stdout only")
    a = ap.parse_args()
    if not os.path.isdir(os.path.join(a.tree, "kvtier")):
        ap.error(f"--tree {a.tree} is not a kvtier checkout")
    # The tree's kvtier first; this checkout's benchlib (which puts REPO first unless it is on the path).
    sys.path[:0] = [os.path.abspath(a.tree), os.path.join(REPO, "scripts")]
    sys.path.append(REPO)
    os.chdir(a.tree)  # the daemons run ``-m kvtier.daemon``, which puts the cwd first on sys.path
    import torch

    from benchlib import emit, machine_notes, parse_size, pct, release, table
    from kvtier.client import Client, Namespace, ShmKVCache
    from kvtier.demo.daemon_proc import PrivateDaemon

    try:
        bb = parse_size(a.block_bytes)
    except ValueError as exc:
        ap.error(f"--block-bytes: {exc}")
    if bb % 256 or not 1 <= a.blocks <= 64 or a.stores < 400:
        ap.error("--block-bytes must be a multiple of 256, --blocks 1-64, --stores at least 400")
    torch.set_num_threads(1)
    pool, slab = max(8 << 20, 256 * bb), max(1 << 20, 16 * bb)
    modes = {"off": "false", "on": "true", "on-quiet": "true"}
    daemons, clients, kvs = {}, {}, []
    lat: dict[str, list[float]] = {m: [] for m in modes}
    load0 = os.getloadavg()
    try:
        for mode, mirror in modes.items():
            daemons[mode] = PrivateDaemon(pool_size=str(pool), slab_size=str(slab), extra=("--config", os.devnull),
                                          env={"OMP_NUM_THREADS": "1", "KVTIER_LOOKUP_INDEX": mirror})
            kv = ShmKVCache([(a.blocks, bb // 2)], torch.float16)
            kvs.append(kv)
            c = Client(daemons[mode].socket, name=f"bench-{mode}", timeout=60, heartbeat=False)
            c.register_kv_cache(kv, [0], Namespace("bench-mirror-stores", "float16", "bench", 16))
            if (c._mirror is not None) != (mirror == "true"):
                raise SystemExit(f"{mode}: the client has {'a' if c._mirror else 'no'} mirror")
            if mode == "on-quiet":
                c.connection.piggyback = lambda *args, **kw: None
            clients[mode] = c
        for i in range(a.stores):
            for mode, c in clients.items():
                keys = keys_of(f"{i}", a.blocks)
                c.lookup(keys)
                t0 = time.perf_counter()
                if not c.store(keys, list(range(a.blocks))).wait().ok:
                    raise SystemExit(f"{mode}: store {i} failed")
                if i >= 200:
                    lat[mode].append(time.perf_counter() - t0)
        evicted = {m: sum(r["evicted"] for r in c.stats()["namespaces"]) for m, c in clients.items()}
    finally:
        release(clients.values(), daemons.values(), kvs)
    load1 = os.getloadavg()
    rows = [[m, *(pct(v, q) * 1e3 for q in (50, 90, 99)), evicted[m]] for m, v in lat.items()]
    off50 = pct(lat["off"], 50) * 1e3
    rows = [r + [r[1] / off50] for r in rows]
    n_rehash = rehashes(pool // bb, a.blocks, a.stores)
    report = {"tree": os.path.abspath(a.tree), "block_bytes": bb, "blocks": a.blocks, "stores": a.stores,
              "pool_blocks": pool // bb, "rows": rows, "rehashes_in_process": n_rehash,
              "load": [load0[0], load1[0]], **machine_notes()}
    title = (f"{a.stores - 200} stores of {a.blocks} x {a.block_bytes} per daemon, each evicting as many "
             f"(pool {pool // bb} blocks), tree {a.tree}; load {load0[0]:.2f} -> {load1[0]:.2f}")
    emit(report, [table(["daemon", "store p50 ms", "p90 ms", "p99 ms", "blocks evicted", "p50 / off"], rows, title),
                  f"In process, a mirror table of {pool // bb} keys under the same churn: "
                  f"{n_rehash} rehashes in {a.stores} stores."], a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
