#!/usr/bin/env python
# Feeds BENCHMARKS.md section 12.1.
"""What handing a warm restart's adopted blocks to a lower tier costs, in process.

    python scripts/bench_adopt_requeue.py [--blocks 262144] [--reps 3]

After ``warm.adopt`` the daemon hands every adopted block to the disk and the
remote tier (``DiskBridge.adopted``, ``RemoteBridge.adopted``). Two ways,
interleaved, on the same keys:

- eager (the first version): every block becomes a write-backlog entry at
  once (``WriteBacklog.add`` of all of them; the remote tier also a
  re-check set entry): in the daemon's start (remote) or one loop turn (disk);
- batched (``disk/schedule.Adopted``): a list append per block at start, then
  ``ADOPT_BATCH`` blocks pulled into the backlog when it runs low: the
  largest single step is one batch.

Reported: the start cost per tier, the cost of one batch (median and max, what
one loop turn spends), and both per block.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

from benchlib import add_json_flag, emit, machine_notes, table

from kvtier.disk.schedule import ADOPT_BATCH, Adopted, WriteBacklog
from kvtier.pool.keys import ns_key

BLOCK = 4096  # the scale target: 4 KiB blocks, so an 8 GiB pool is 2M of them


@dataclass(eq=False)
class Bucket:
    key: str
    block_bytes: int = BLOCK


@dataclass
class Entry:
    ns: Bucket
    key: bytes


def eager(entries: list) -> float:
    t0 = time.perf_counter()
    backlog, recheck = WriteBacklog(len(entries) * BLOCK), set()
    ns = entries[0].ns
    keys = [e.key for e in entries]
    recheck.update((ns.key, k) for k in keys)
    backlog.add("team", ns, keys)
    return time.perf_counter() - t0


def batched(entries: list) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    waiting = Adopted()
    waiting.add(entries)
    start = time.perf_counter() - t0
    backlog, turns = WriteBacklog(len(entries) * BLOCK), []
    while waiting.left:
        t0 = time.perf_counter()
        for ns, keys in waiting.pull(ADOPT_BATCH):
            backlog.add("team", ns, keys)
        turns.append(time.perf_counter() - t0)
        while backlog.take(1 << 40) is not None:  # written meanwhile: the next batch finds room
            pass
    return start, turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=262144)
    p.add_argument("--reps", type=int, default=3)
    add_json_flag(p)
    a = p.parse_args()
    ns = Bucket(ns_key("team", "model|float16|flashinfer|bs16|tp0of1"))
    entries = [Entry(ns, os.urandom(16)) for _ in range(a.blocks)]
    eager_s, start_s, turn_p50, turn_max, total = [], [], [], [], []
    for r in range(a.reps):  # interleaved, order alternating
        for way in (("eager", "batched") if r % 2 == 0 else ("batched", "eager")):
            if way == "eager":
                eager_s.append(eager(entries))
            else:
                start, turns = batched(entries)
                start_s.append(start)
                turn_p50.append(statistics.median(turns))
                turn_max.append(max(turns))
                total.append(sum(turns))
    m = statistics.median
    report = {"machine": machine_notes(), "load": os.getloadavg(), "blocks": a.blocks, "batch": ADOPT_BATCH,
              "eager_s": m(eager_s), "batched_start_s": m(start_s), "batch_p50_s": m(turn_p50),
              "batch_max_s": m(turn_max), "batches_s": m(total)}
    n = a.blocks
    t = table(["blocks", "eager: all at once s", "batched: at start s", "batched: all batches s",
               "one batch p50 ms", "one batch max ms", "eager us/block", "batched start us/block"],
              [[n, report["eager_s"], report["batched_start_s"], report["batches_s"], report["batch_p50_s"] * 1e3,
                report["batch_max_s"] * 1e3, report["eager_s"] / n * 1e6, report["batched_start_s"] / n * 1e6]],
              f"Handing adopted blocks to a tier: eager vs batched ({ADOPT_BATCH} a batch), medians of {a.reps}, "
              f"load {report['load'][0]:.1f}")
    emit(report, [t], a.json)


if __name__ == "__main__":
    main()
