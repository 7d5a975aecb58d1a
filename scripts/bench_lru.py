#!/usr/bin/env python
# Feeds BENCHMARKS.md section 18.5.
"""The RAM pool's LRU order at millions of entries: what one touch, insert and eviction costs.

    python scripts/bench_lru.py [--entries 2248912] [--rounds 300] [--baseline-tree DIR]

In process, no daemon: an ``LRUPolicy`` filled with ``--entries`` entries in
chains of 1,000, then ``--rounds`` rounds of what a full pool under traffic
does: a touch of a 1,000-entry chain it holds, an insert of 1,000 new
entries, and the eviction of the 1,000 oldest (``candidates()``, then
``remove``). Loop-thread CPU (``thread_time``) per operation, mean and the
longest, and the memory per entry (RSS growth: the tree's own ``Entry``, which
a linked order keeps its links in, and then the policy's fill). With
``--baseline-tree`` (a checkout of an earlier commit) the same runs there
first, in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r"""
import sys, time, random, gc
import psutil
from kvtier.pool.policy import LRUPolicy
N = int(sys.argv[1]); R = int(sys.argv[2])
cpu = time.thread_time
from kvtier.pool.entry import Entry  # the tree's own: a linked order keeps its links in it
def E(i): return Entry(None, i.to_bytes(16, "little"), 0)
p = LRUPolicy()
rss0 = psutil.Process().memory_info().rss
es = [E(i) for i in range(N)]
rss1 = psutil.Process().memory_info().rss
t = cpu()
for i in range(0, N, 1000): p.insert_chain(es[i:i + 1000])
fill = cpu() - t
rss2 = psutil.Process().memory_info().rss
gc.freeze()
rnd = random.Random(1)
live = list(es)  # approximate: chains to touch
nxt = N
worst = {"touch": 0, "insert": 0, "evict": 0}; tot = {"touch": 0, "insert": 0, "evict": 0}
for r in range(R):
    i = rnd.randrange(0, len(live) - 1000)
    chain = live[i:i + 1000]
    t = cpu(); p.touch_chain(chain); d = cpu() - t; worst["touch"] = max(worst["touch"], d); tot["touch"] += d
    new = [E(nxt + j) for j in range(1000)]; nxt += 1000
    t = cpu(); p.insert_chain(new); d = cpu() - t; worst["insert"] = max(worst["insert"], d); tot["insert"] += d
    t = cpu()
    victims = []
    for e in p.candidates():
        victims.append(e)
        if len(victims) == 1000: break
    for e in victims: p.remove(e)
    d = cpu() - t; worst["evict"] = max(worst["evict"], d); tot["evict"] += d
    gone = set(map(id, victims))
    live[i:i + 1000] = [e for e in chain if id(e) not in gone]  # keep the list roughly of live entries
    live.extend(new)
print(f"N={N} fill {fill:.2f} s, entry {(rss1 - rss0) / N:.0f} + policy {(rss2 - rss1) / N:.0f} B/entry; per op of 1000 entries, mean / max ms CPU: " +
      ", ".join(f"{k} {tot[k] / R * 1e3:.3f} / {worst[k] * 1e3:.1f}" for k in tot))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=2_248_912)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--baseline-tree", help="a checkout of an earlier commit, run before this one")
    a = ap.parse_args()
    if a.entries < 2000 or a.rounds < 1:
        raise SystemExit("--entries must be at least 2,000 and --rounds at least 1")
    for name, tree in ([("before", a.baseline_tree)] if a.baseline_tree else []) + [("this tree", REPO)]:
        out = subprocess.run([sys.executable, "-c", CHILD, str(a.entries), str(a.rounds)], check=True,
                             capture_output=True, text=True, cwd=tree, env={**os.environ, "PYTHONPATH": tree})
        print(f"{name:9s} " + out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
