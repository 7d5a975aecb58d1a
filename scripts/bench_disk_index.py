#!/usr/bin/env python
# Feeds BENCHMARKS.md section 18.4 and docs/DISK_TIER.md.
"""The disk index after a flush of many files: how long one call holds the loop.

    python scripts/bench_disk_index.py [--files 1000000] [--baseline-tree DIR] [--rounds 2]

In process, no files: a ``DiskIndex`` holding ``--files`` entries of one
namespace (as a restart's scan leaves them), next to 1 or ``--files / 2``
entries of another namespace that stay, is flushed the way the daemon does it (``hide``, then ``drain`` 64 entries a batch), then one file is
written. Each call is timed in the loop thread's CPU time (``thread_time``,
what it costs wherever it runs). Before the sliced rebuild the write after the
flush rebuilt the age heap of stale items in one call; after it, the write is
cheap and the daemon's turns call ``tidy`` 256 items a batch (at most ~3 ms of
batches a turn, ``daemon/flushes.py``). Printed per round: the longest drain
batch, the write, the longest tidy batch and the daemon turn they make up,
and the rebuild's whole CPU. With ``--baseline-tree`` (a checkout of an
earlier commit) each round runs both trees in turn, in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
from kvtier.disk.index import DiskEntry, DiskIndex
n, kept = int(sys.argv[1]), int(sys.argv[2])
idx = DiskIndex(capacity=(n + kept + 10) * 8192)
for k in range(n):  # found by a restart's scan: directory order, keyed by seq
    idx.add(DiskEntry("a", k.to_bytes(16, "little"), (k * 7919) % n, 100, 0, ""), found=True)
for k in range(kept):  # another namespace's, written since: not flushed
    idx.add(DiskEntry("b", k.to_bytes(16, "little"), n + k, 100, 0, ""))
cpu = time.thread_time
idx.hide(["a"])
longest_drain = 0.0
while idx.flushes:
    t = cpu(); idx.drain(64); longest_drain = max(longest_drain, cpu() - t)
t = cpu(); idx.add(DiskEntry("b", b"x" * 16, n + 1, 100, 0, "")); write = cpu() - t
out = {"drain_batch_ms": longest_drain * 1e3, "write_ms": write * 1e3, "heap_after_write": len(idx._heap)}
if hasattr(idx, "tidy"):
    batches, longest, turn, longest_turn, total = 0, 0.0, 0.0, 0.0, 0.0
    while idx.tidying:
        t = cpu(); idx.tidy(256); dt = cpu() - t
        batches += 1; total += dt; longest = max(longest, dt); turn += dt
        if turn >= 0.003:  # the daemon's slice: a turn ends past 3 ms of batches
            longest_turn, turn = max(longest_turn, turn), 0.0
    out.update(tidy_batches=batches, tidy_batch_ms=longest * 1e3,
               tidy_turn_ms=max(longest_turn, turn) * 1e3, tidy_total_ms=total * 1e3,
               heap_after=idx.heap_items)
idx.check_integrity()
print(json.dumps(out))
"""


def run(tree: str, files: int, kept: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", CHILD, str(files), str(kept)], env=env, capture_output=True,
                         text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--baseline-tree", help="a checkout of an earlier commit, run in turn with this one")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    trees = ([("before", a.baseline_tree)] if a.baseline_tree else []) + [("this tree", REPO)]
    for r in range(a.rounds):
        for kept in (1, a.files // 2):
            for name, tree in trees:
                res = run(tree, a.files, kept)
                load = os.getloadavg()[0]
                print(f"round {r + 1} kept {kept:>7} {name:9s} load {load:.1f}: " + ", ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
