#!/usr/bin/env python
# Feeds BENCHMARKS.md section 18.14 and docs/SCALE.md.
"""The prefix index in process: heap per block and CPU per operation, compiled and pure Python.

    python scripts/bench_index.py [--blocks 1000000] [--reps 2] [--chain 1000] [--map-entries 1000000]
                                  [--json PATH]

No daemon: a ``BlockIndex`` over a bookkeeping-only slab allocator of ``--blocks``
4 KiB slots (no pool memory), filled with chains of ``--chain`` blocks, each
stored and committed. Each rep runs two fresh processes in turn (reversed every
other rep): this tree's compiled index (``kvtier/pool/_native.c``) and the same
tree with ``KVTIER_PURE_PYTHON=1`` (Python entries in dicts, the index before it).

- heap per block: RSS growth of the process from the empty index to the full one,
  divided by the blocks (what the daemon's anon RSS grows by per block);
- CPU per operation of one chain (``thread_time``), over 200 chains of a full
  index: a lookup that hits all of it, a load (prepare + complete), a store of new
  blocks that evicts as many (prepare + complete), and a lookup that misses;
- one namespace map of ``--map-entries`` entries (wall time): its longest insert while it grows
  (a doubling rebuilds it), and its longest removal + insert at that steady size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import gc, json, sys, time
import psutil
from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.entry import NATIVE
N, C, M = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
BLOCK, SLAB = 4096, 4 << 20
def keys(tag, start, n): return [(tag << 64 | i).to_bytes(16, "little") for i in range(start, start + n)]
gc.disable()  # the daemon freezes its survivors (daemon/tenure.py): no full pass walks the entries there either
proc = psutil.Process()
idx = BlockIndex(SlabAllocator(-(-N * BLOCK // SLAB) * SLAB, SLAB))  # whole slabs: N blocks fit
ns = idx.namespace("t\x1fmodel", BLOCK)
rss0 = proc.memory_info().rss
for s in range(0, N, C):
    idx.complete_store(idx.prepare_store(ns, keys(1, s, min(C, N - s))))
rss1 = proc.memory_info().rss
assert ns.ready_blocks() == N and idx.evictions == 0, (ns.ready_blocks(), idx.evictions)
idx.complete_store(idx.prepare_store(ns, keys(4, 0, idx.alloc_.free_bytes // BLOCK)))  # full: stores evict
cpu = time.thread_time
ops = {"lookup_hit": [], "load": [], "store_evicting": [], "lookup_miss": []}
for r in range(200):
    chain = keys(1, (r * 7919 * C) % N // C * C, C)
    idx.complete_store(idx.prepare_store(ns, chain))  # what earlier stores evicted of it, back
    t = cpu(); hits = idx.lookup(ns, chain); ops["lookup_hit"].append(cpu() - t)
    if hits != C: raise SystemExit(f"a chain the index holds hit {hits} of {C}")
    t = cpu(); idx.complete_load(idx.prepare_load(ns, chain)); ops["load"].append(cpu() - t)
    fresh = keys(2, r * C, C)
    t = cpu(); idx.complete_store(idx.prepare_store(ns, fresh)); ops["store_evicting"].append(cpu() - t)
    t = cpu(); idx.lookup(ns, keys(3, r * C, C)); ops["lookup_miss"].append(cpu() - t)
idx.check_integrity()
del idx, ns
# One map of a million entries: the longest insert while it grows (a doubling), then the
# longest removal + insert at that steady size (a dict rebuilds about every n inserts there).
from kvtier.pool.entry import Entry, new_map
wall = time.perf_counter
ks = [(i * 0x9E3779B97F4A7C15 % 2**128).to_bytes(16, "little") for i in range(2 * M)]
m, grow, churn = new_map(), 0.0, 0.0
for i in range(M):
    e = Entry(None, ks[i], i); t = wall(); m[ks[i]] = e; grow = max(grow, wall() - t)
for i in range(M):
    e = Entry(None, ks[M + i], i); t = wall(); m.pop(ks[i]); m[e.key] = e; churn = max(churn, wall() - t)
assert len(m) == M
print(json.dumps({"native": NATIVE, "blocks": N, "heap_per_block": (rss1 - rss0) / N,
                  "ops_us": {k: 1e6 * sum(v) / len(v) for k, v in ops.items()},
                  "map_longest_insert_ms": grow * 1e3, "map_churn_longest_ms": churn * 1e3}))
"""


def child(native: bool, blocks: int, chain: int, entries: int) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, KVTIER_PURE_PYTHON="0" if native else "1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(blocks), str(chain), str(entries)], env=env,
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"the {'native' if native else 'python'} run failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r["native"] != native:
        raise SystemExit("the compiled index is not built: pip install -e . (a C compiler) first")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--chain", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--map-entries", type=int, default=1_000_000, help="the one map's size (growth, churn)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if min(a.blocks, a.chain, a.reps, a.map_entries) < 1 or a.chain > a.blocks:
        ap.error("--blocks, --chain, --reps and --map-entries must be positive, --chain at most --blocks")
    runs: dict = {"native": [], "python": []}
    for rep in range(a.reps):
        order = [True, False] if rep % 2 == 0 else [False, True]
        for native in order:
            r = child(native, a.blocks, a.chain, a.map_entries)
            runs["native" if native else "python"].append(r)
            ops = " ".join(f"{k} {v:.0f}" for k, v in r["ops_us"].items())
            print(f"rep {rep} {'native' if native else 'python'}: {r['heap_per_block']:.0f} B/block; "
                  f"us per {a.chain}-block op: {ops}; a map's longest insert growing "
                  f"{r['map_longest_insert_ms']:.1f} ms, under churn {r['map_churn_longest_ms']:.2f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
