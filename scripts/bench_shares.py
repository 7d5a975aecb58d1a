# Feeds BENCHMARKS.md section 16.
"""What ``tenant_share`` costs the index: stores that evict, and lookups, share off vs on.

In process (BlockIndex alone, no daemon, no copies): a full pool of 16 KiB
blocks where every store of a 16-block chain makes room by eviction. Cases,
timed in alternation (benchlib.round_robin) so all see the same machine:

  two tenants, off       two tenants alternate stores; share 1.0 (global LRU)
  two tenants, on        the same with share 0.75: both below it, so eviction
                         stays global; the cost is the per-tenant order kept
  flood, off             one tenant stores, the other's blocks sit idle; share 1.0
  flood, on (at share)   the same with share 0.5: every store evicts the
                         flooder's own oldest through its own order
  lookup hit, off / on   a 16-block chain found (refreshes the order(s))

Prints microseconds per store (prepare + complete) or per lookup, median of reps.

``--baseline DIR`` instead compares the "off" cases (the two store cases and
the lookup hit) of this checkout with those of another (a worktree or an
export of an earlier commit: what the accounting costs with the share off),
one process per side, alternating for ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys

from benchlib import add_json_flag, emit, machine_notes, median, round_robin, table

BLOCK, CHAIN = 16 * 1024, 16
SEP = "\x1f"  # kvtier.pool.shares.SEP; a baseline checkout may not have that module


def fresh_keys(counter, n: int) -> list[bytes]:
    return [next(counter).to_bytes(16, "little") for _ in range(n)]


def full_index(pool: int, share: float):
    """An index whose pool is filled half by tenant a, half by tenant b."""
    from kvtier.pool.allocator import SlabAllocator
    from kvtier.pool.index import BlockIndex
    idx = BlockIndex(SlabAllocator(pool, 2**20), **({"share": share} if share < 1 else {}))
    a, b = idx.namespace(f"a{SEP}m", BLOCK), idx.namespace(f"b{SEP}m", BLOCK)
    counter = itertools.count()
    per = pool // BLOCK // 2
    for ns in (a, b):
        for _ in range(per // CHAIN):
            idx.complete_store(idx.prepare_store(ns, fresh_keys(counter, CHAIN)))
    return idx, a, b, counter


def store_case(pool: int, share: float, tenants: str, stores: int):
    idx, a, b, counter = full_index(pool, share)
    order = [a, b] if tenants == "two" else [a]
    batch: list = []

    def setup():
        batch[:] = [fresh_keys(counter, CHAIN) for _ in range(stores)]

    def run():
        for i, keys in enumerate(batch):
            ns = order[i % len(order)]
            plan = idx.prepare_store(ns, keys)
            assert not plan.no_space
            idx.complete_store(plan)
    return (run, setup), idx


def lookup_case(pool: int, share: float, lookups: int):
    idx, a, _, counter = full_index(pool, share)
    keys = fresh_keys(counter, CHAIN)
    idx.complete_store(idx.prepare_store(a, keys))

    def run():
        for _ in range(lookups):
            assert idx.lookup(a, keys) == CHAIN
    return (run, None), idx


def off_only(args) -> int:
    """One side of --baseline: the off cases (stores, a lookup hit) of whichever
    kvtier is first on sys.path."""
    pool = args.pool_mib * 2**20
    cases = {name: store_case(pool, 1.0, tenants, args.stores)[0]
             for name, tenants in (("two tenants, off", "two"), ("flood, off", "one"))}
    cases["lookup hit, off"] = lookup_case(pool, 1.0, args.stores * 10)[0]
    per = {name: args.stores * (10 if name.startswith("lookup") else 1) for name in cases}
    times = round_robin(cases, args.min_time)
    import kvtier.pool.index
    print(json.dumps({name: median(ts) / per[name] * 1e6 for name, ts in times.items()}))
    print(kvtier.pool.index.__file__, file=sys.stderr)  # which checkout was measured
    return 0


def versus(args) -> int:
    me = os.path.abspath(__file__)
    out: dict = {}
    for r in range(args.rounds):
        for side, repo in ((("baseline", args.baseline), ("this", None)) if r % 2 == 0
                           else (("this", None), ("baseline", args.baseline))):
            cmd = [sys.executable, me, "--off-only", "--min-time", str(args.min_time),
                   "--pool-mib", str(args.pool_mib), "--stores", str(args.stores)]
            cmd += ["--kvtier", repo] if repo else []
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            for name, us in got.items():
                out.setdefault(name, {}).setdefault(side, []).append(us)
    # On a busy box the load drifts between rounds: each round's two processes ran
    # back to back, so the median of the per-round ratios is the steadier figure,
    # and the fastest process of each side the least disturbed one.
    rows = [[name, round(median(v["baseline"]), 2), round(median(v["this"]), 2),
             round(median(v["this"]) / median(v["baseline"]), 3),
             round(median([t / b for t, b in zip(v["this"], v["baseline"])]), 3),
             round(min(v["this"]) / min(v["baseline"]), 3)] for name, v in out.items()]
    emit({"machine": machine_notes(), "baseline": args.baseline, "rounds": out},
         [table(["case (share off)", "baseline us/op", "this us/op", "ratio of medians",
                 "median per-round ratio", "ratio of minima"], rows,
                f"tenant_share off vs {args.baseline}, {args.rounds} rounds of alternating processes")],
         args.json)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--stores", type=int, default=200, help="stores per rep")
    p.add_argument("--min-time", type=float, default=3.0, help="seconds of timed work per case")
    p.add_argument("--baseline", metavar="DIR", help="another checkout: compare the off cases with it")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--kvtier", metavar="DIR", help=argparse.SUPPRESS)  # --baseline's child: import from DIR
    p.add_argument("--off-only", action="store_true", help=argparse.SUPPRESS)
    add_json_flag(p)
    args = p.parse_args()
    if args.kvtier:  # benchlib imported this checkout's kvtier already: forget it
        sys.path.insert(0, args.kvtier)
        for name in [m for m in sys.modules if m == "kvtier" or m.startswith("kvtier.")]:
            del sys.modules[name]
    if args.off_only:
        return off_only(args)
    if args.baseline:
        return versus(args)
    logging.getLogger("kvtier").setLevel(logging.ERROR)  # the 'at its share' line, once per case
    pool = args.pool_mib * 2**20
    cases, indexes, per = {}, {}, {}
    for name, share, tenants in (("two tenants, off", 1.0, "two"), ("two tenants, on (0.75)", 0.75, "two"),
                                 ("flood, off", 1.0, "one"), ("flood, on (0.5, at share)", 0.5, "one")):
        cases[name], indexes[name] = store_case(pool, share, tenants, args.stores)
        per[name] = args.stores
    for name, share in (("lookup hit, off", 1.0), ("lookup hit, on (0.5)", 0.5)):
        cases[name], indexes[name] = lookup_case(pool, share, args.stores * 10)
        per[name] = args.stores * 10
    times = round_robin(cases, args.min_time)
    from kvtier.pool.keys import SEP as sep
    assert sep == SEP
    rows, report = [], {"machine": machine_notes(), "pool_bytes": pool, "block_bytes": BLOCK,
                        "chain": CHAIN, "cases": {}}
    for name, ts in times.items():
        us = [t / per[name] * 1e6 for t in ts]
        idx = indexes[name]
        idx.check_integrity()
        own = sum(idx.tenants.own_evictions.values())
        rows.append([name, round(median(us), 2), round(min(us), 2), len(ts), idx.evictions, own])
        report["cases"][name] = {"us_median": median(us), "us_min": min(us), "reps": len(ts),
                                 "evictions": idx.evictions, "own_evictions": own}
    emit(report, [table(["case", "us/op median", "us/op min", "reps", "evicted", "of them own"], rows,
                        f"tenant_share cost, {args.pool_mib} MiB pool, {CHAIN}-block stores of 16 KiB blocks")],
         args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
