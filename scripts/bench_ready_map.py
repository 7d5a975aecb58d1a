#!/usr/bin/env python3
"""A namespace of millions of blocks under churn: the longest store, in process (BENCHMARKS.md 18.12).

The index of ``--tree`` (default: this checkout) over a pool of ``--blocks``
4 KiB slots, one namespace: filled by stores of ``--chain`` new blocks, then
``--churn`` more blocks stored the same way, each store evicting as many as it
adds (the steady state of a full pool). Timed per store (``prepare_store`` +
``complete_store``, ``time.perf_counter``), and per lookup of a stored chain
and per load (``prepare_load`` + ``complete_load``) of it: the p50, p99 and the
longest of each, and how many stores took over 10 ms. CPython's collector is
frozen after the fill, as the daemon's is (``gc_freeze``), so the pauses left
are the index's own.

    python scripts/bench_ready_map.py [--blocks 2097152] [--churn 3000000] [--chain 32] [--tree DIR]
                                      [--split-at N] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2 * 2**20, help="pool slots (4 KiB each)")
    ap.add_argument("--churn", type=int, default=3_000_000, help="blocks stored after the pool is full")
    ap.add_argument("--chain", type=int, default=32, help="blocks per store")
    ap.add_argument("--tree", default=REPO)
    ap.add_argument("--split-at", type=int, default=0,
                    help="shardmap.SPLIT_AT for this run (0: the tree's own; ignored by trees without it)")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH")
    a = ap.parse_args()
    if a.blocks < 1024 or a.churn < 0 or not 1 <= a.chain <= 1024:
        ap.error("--blocks must be at least 1024, --churn at least 0, --chain 1-1024")
    if not os.path.isdir(os.path.join(a.tree, "kvtier")):
        ap.error(f"--tree {a.tree} is not a kvtier checkout")
    sys.path[:0] = [os.path.abspath(a.tree), os.path.join(REPO, "scripts")]
    sys.path.append(REPO)
    from kvtier.pool import BlockIndex, LRUPolicy, SlabAllocator
    if a.split_at:
        try:
            from kvtier.pool import shardmap
            shardmap.SPLIT_AT = a.split_at
        except ImportError:
            pass

    from benchlib import emit, machine_notes, table

    slab = 256 * 4096
    slabs = -(-a.blocks // 256)
    idx = BlockIndex(SlabAllocator(slabs * slab, slab), LRUPolicy())
    ns = idx.namespace("bench\x1fready-map", 4096)
    salt = os.urandom(8)
    counter = iter(range(1 << 62))

    def new_chain() -> list[bytes]:
        return [hashlib.blake2b(next(counter).to_bytes(8, "little"), key=salt, digest_size=16).digest()
                for _ in range(a.chain)]

    def store(keys: list[bytes]) -> float:
        t0 = time.perf_counter()
        idx.complete_store(idx.prepare_store(ns, keys))
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    recent: list[list[bytes]] = []
    while ns.ready_blocks() + a.chain <= slabs * 256:
        c = new_chain()
        store(c)
        recent = (recent + [c])[-64:]
    fill_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()
    stores, lookups, loads = [], [], []
    for i in range(a.churn // a.chain):
        c = new_chain()
        stores.append(store(c))
        recent = (recent + [c])[-64:]
        probe = recent[i % len(recent)]
        t1 = time.perf_counter()
        idx.lookup(ns, probe)
        t2 = time.perf_counter()
        idx.complete_load(idx.prepare_load(ns, probe))
        t3 = time.perf_counter()
        lookups.append(t2 - t1)
        loads.append(t3 - t2)
    idx.check_integrity()

    def row(name: str, xs: list[float]) -> list:
        s = sorted(xs)
        return [name, s[len(s) // 2] * 1e6, s[int(len(s) * 0.99)] * 1e6, s[-1] * 1e3, sum(x > 0.010 for x in s)]

    rows = [row(f"store of {a.chain} (evicts {a.chain})", stores), row(f"lookup of {a.chain}", lookups),
            row(f"load of {a.chain} (pin, unpin)", loads)]
    kind = type(ns.ready_map).__name__
    report = {"tree": os.path.abspath(a.tree), "blocks": ns.ready_blocks(), "churn": a.churn, "chain": a.chain,
              "ready_map": kind, "fill_s": fill_s, "evictions": idx.evictions, "rows": rows, **machine_notes()}
    title = (f"{ns.ready_blocks():,} blocks in one namespace ({kind}), {len(stores):,} stores after the fill "
             f"({idx.evictions:,} evictions); tree {a.tree}")
    emit(report, [table(["op", "p50 us", "p99 us", "longest ms", "over 10 ms"], rows, title)], a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
