"""Flush requests in progress: their blocks freed a slice per loop turn, each answered when done.

A flush hides what it names at once (``pool/drain.py``); the loop then calls
``step()`` once per turn, which frees hidden entries for at most ``SLICE_S``
of the loop's time and at most ``SLICE_MAX`` entries, and sends each flush's
``flushed`` reply once all of its blocks are freed (so ``used_bytes`` has
dropped by then). Requests, copies and reaping are served between slices;
the poll does not wait while a flush is pending.

Primitives: ``Flushes(index, send, counters).start(identity, req_id, buckets,
everything, on_disk, note)``, ``.step()``, ``.pending``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable

from ..pool.index import BlockIndex
from ..protocol import messages as m

log = logging.getLogger("kvtier.daemon")
SLICE_S = 0.003    # loop time one turn spends freeing flushed blocks (10^6 blocks: ~1,800 turns, BENCHMARKS 18)
SLICE_MAX = 4096   # entries one turn frees at most, however fast the machine
BATCH = 64         # entries between two looks at the clock (a batch costs ~0.3 ms of CPU)


class Flushes:
    def __init__(self, index: BlockIndex, send: Callable, counters: Counter):
        self.index, self.send, self.counters = index, send, counters
        self._waiting: dict = {}  # drain.Flush -> (identity, req_id, on_disk, note)

    @property
    def pending(self) -> bool:
        """Work left for ``step``: a flush to finish, or an emptied map to release."""
        return self.index.drains.busy

    def start(self, identity: bytes, req_id: int, buckets: list, everything: bool, on_disk: int,
              note: str) -> None:
        """Hide ``buckets``' blocks now; answer ``identity`` when they are freed.
        ``on_disk``: blocks the disk tier removed that were not in RAM (counted in the reply)."""
        job = self.index.start_flush(buckets, everything)
        self._waiting[job] = (identity, req_id, on_disk, note)
        self.counters["flushes"] += 1

    def step(self) -> None:
        """One turn's slice; replies for the flushes it finished."""
        drains = self.index.drains
        if not drains.busy:
            return
        t0, cpu0, freed, finished = time.perf_counter(), time.thread_time(), 0, []
        while drains.busy and freed < SLICE_MAX:
            releasing = drains.releasing
            finished += drains.step(min(BATCH, SLICE_MAX - freed))
            freed += BATCH
            # An emptied map is freed in a turn of its own (a million entries: ~40 MB to unmap).
            if releasing or drains.releasing or time.perf_counter() - t0 >= SLICE_S:
                break
        # What this turn held the loop: wall time (with the waits of a loaded machine) and the
        # loop thread's own CPU time (what the slice costs wherever it runs).
        took_us, cpu_us = int((time.perf_counter() - t0) * 1e6), int((time.thread_time() - cpu0) * 1e6)
        c = self.counters
        c["flush_turns"] += 1
        c["flush_longest_turn_us"] = max(c["flush_longest_turn_us"], took_us)
        c["flush_longest_turn_cpu_us"] = max(c["flush_longest_turn_cpu_us"], cpu_us)
        for job in finished:
            identity, req_id, on_disk, note = self._waiting.pop(job)
            removed = job.removed + on_disk
            log.info("%s: %d blocks removed", note, removed)
            self.send(identity, req_id, m.Flushed(removed))
