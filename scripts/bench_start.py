#!/usr/bin/env python
# Feeds BENCHMARKS.md section 18.10 and docs/SCALE.md (cold start).
"""A daemon's cold start: spawn to its first answered ``stats``, this tree and another in turn.

    python scripts/bench_start.py [--pools 2GiB,8GiB] [--reps 3] [--baseline-tree DIR] [--json PATH]

Real daemons (``python -m kvtier.daemon``, no warm restart), one at a time,
also timed to the whole pool in (``faulting_bytes`` 0: with ``prefault = background``
the first answer comes before),
each stopped (SIGTERM) before the next starts: per pool size, this tree and
``--baseline-tree`` alternate (A, B, A, B...), so a busy moment hits both.
What a start costs besides the pool (the interpreter, torch, the sockets) is
the 64 MiB pool's row, measured the same way.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import benchlib as bl
from kvtier.pool.sizes import parse_size

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_start(tree: str, pool: int) -> tuple[float, float]:
    """(spawn to the first answered stats, spawn to the whole pool in): the second is the
    first where the pool is faulted in before the daemon serves (a tree before
    ``prefault = background``, whose stats have no ``faulting_bytes``)."""
    from kvtier.client import Client
    sock = os.path.join(tempfile.mkdtemp(prefix="kvtier-start-"), "d.sock")
    t0 = time.perf_counter()
    proc = bl.start_daemon(sock, pool, cwd=tree, timeout=1800, ready=bl.answers_stats)
    took = time.perf_counter() - t0
    with Client(sock, name="probe", timeout=60) as c:
        while c.stats()["pool"].get("faulting_bytes"):
            time.sleep(0.02)
    whole = time.perf_counter() - t0
    bl.stop_daemon(proc)
    return took, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", default="64MiB,2GiB,8GiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline-tree", help="another checkout, started in turn with this one")
    bl.add_json_flag(ap)
    args = ap.parse_args()
    trees = {"this tree": HERE, **({"baseline": os.path.abspath(args.baseline_tree)} if args.baseline_tree else {})}
    rows, report = [], {"machine": bl.machine_notes(), "starts": {}}
    for pool in [parse_size(p) for p in args.pools.split(",")]:
        took = {name: [] for name in trees}
        whole = {name: [] for name in trees}
        for _ in range(args.reps):
            for name, tree in trees.items():
                first, all_in = one_start(tree, pool)
                took[name].append(first)
                whole[name].append(all_in)
        for name, xs in took.items():
            report["starts"][f"{bl.short_size(pool)} {name}"] = xs
            report.setdefault("whole_pool_in", {})[f"{bl.short_size(pool)} {name}"] = whole[name]
            rows.append([bl.short_size(pool), name, f"{min(xs):.2f}", f"{bl.median(xs):.2f}", f"{max(xs):.2f}",
                         f"{bl.median(xs) / (pool / 2**30):.2f}" if pool >= 2**30 else "-",
                         f"{bl.median(whole[name]):.2f}"])
    bl.emit(report, [bl.table(["pool", "tree", "min s", "median s", "max s", "median s/GiB", "whole pool in, median s"],
                              rows, f"cold start, spawn to first stats ({args.reps} each, in turn)")], args.json)


if __name__ == "__main__":
    main()
