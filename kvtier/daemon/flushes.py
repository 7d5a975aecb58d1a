"""Flush requests in progress: their blocks freed a slice per loop turn, each answered when done.

A flush hides what it names at once (``pool/drain.py``); the loop then calls
``step()`` once per turn, which frees hidden entries for at most ``SLICE_S``
of the loop's time and at most ``SLICE_MAX`` entries, and sends each flush's
``flushed`` reply once all of its blocks are freed (so ``used_bytes`` has
dropped by then). Requests, copies and reaping are served between slices;
the poll does not wait while a flush is pending. The disk tier's part of a
flush (``DiskBridge.flush_keys``: hidden at once too) is freed in the same
slices, before the RAM part, and a flush is answered when both are done
(its count: RAM's blocks plus the files RAM did not hold). After them, in the
same slices, the disk index's age heap is rebuilt without the items its freed
entries left stale (``DiskBridge.tidy``: 10^6 of them took ~0.5 s in one turn).

Primitives: ``Flushes(index, send, counters, disk=None).start(identity, req_id, buckets,
everything, disk_job, note)``, ``.step()``, ``.pending``.
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
TIDY_BATCH = 256   # disk heap items between two looks at the clock (~0.3 ms of CPU at 10^6 items)


class Flushes:
    def __init__(self, index: BlockIndex, send: Callable, counters: Counter, disk=None):
        self.index, self.send, self.counters, self.disk = index, send, counters, disk
        self._waiting: dict = {}  # drain.Flush -> (identity, req_id, disk.DiskFlush | None, note)
        self._finished: list = []  # RAM part done, waiting for the disk part

    @property
    def pending(self) -> bool:
        """Work left for ``step``: a flush to finish, an emptied map to release, flushed
        files to drop (a ``max_namespaces_per_user`` drop too, answered to nobody), or the
        disk's age heap to rebuild."""
        disk = self.disk
        return (self.index.drains.busy or bool(self._finished)
                or (disk is not None and (disk.draining or disk.tidying)))

    @property
    def unanswered(self) -> int:
        """Flush requests started and not yet answered (RAM or disk part still freeing)."""
        return len(self._waiting)

    def start(self, identity: bytes, req_id: int, buckets: list, everything: bool, disk_job,
              note: str) -> None:
        """Hide ``buckets``' blocks now; answer ``identity`` when they are freed.
        ``disk_job``: the disk tier's part (``DiskBridge.flush_keys``, hidden already), or None."""
        job = self.index.start_flush(buckets, everything)
        self._waiting[job] = (identity, req_id, disk_job, note)
        self.counters["flushes"] += 1

    def step(self) -> None:
        """One turn's slice; replies for the flushes it finished."""
        drains, disk = self.index.drains, self.disk
        draining = disk is not None and disk.draining
        tidying = disk is not None and disk.tidying
        if not (drains.busy or draining or tidying or self._finished):
            return
        t0, cpu0, freed, finished = time.perf_counter(), time.thread_time(), 0, self._finished
        self._finished = []
        while (drains.busy or draining or tidying) and freed < SLICE_MAX:
            if draining or not drains.busy:
                if draining:  # a flush's files first: its reply counts those RAM did not hold
                    disk.drain(min(BATCH, SLICE_MAX - freed))
                    draining = disk.draining
                else:  # flushes freed: the disk heap without the items they left stale
                    disk.tidy(TIDY_BATCH)
                    tidying = disk.tidying
                freed += BATCH
                if time.perf_counter() - t0 >= SLICE_S:
                    break
                continue
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
            identity, req_id, disk_job, note = self._waiting[job]
            if disk_job is not None and not disk_job.done:
                self._finished.append(job)  # RAM's part is freed; its files are not yet
                continue
            del self._waiting[job]
            removed = job.removed + (disk_job.only_on_disk if disk_job is not None else 0)
            log.info("%s: %d blocks removed", note, removed)
            self.send(identity, req_id, m.Flushed(removed))
