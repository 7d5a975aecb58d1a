"""What the remote tier's threads work on, and the clock that answers
lookups the store did not answer in time.

A ``Job`` is reported exactly once: by the thread that ran it, or, for a
probe, by ``Deadlines`` when the store has not answered by the job's
deadline (a hung server: connected but silent, e.g. SIGSTOPped, holds a
socket read for up to ``timeout_s`` per node the client tries, seconds in
all). The late answer is dropped. So a lookup that asks the store is
answered within ``timeout_s`` whatever the store does, and a probe queued
behind a hung one is answered by its own deadline too.

Primitives: ``Job``, ``Deadlines(expire)`` with ``.add(job)``, ``.close()``,
``more_writes(q, first, batch_bytes)`` (write jobs batched into one pipeline).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .values import NamespaceDigest


@dataclass(eq=False)
class Job:
    kind: str                    # "probe" | "fetch" | "write" | "healed" (the breaker closed again)
    token: Any                   # the caller's, handed back untouched
    ns: NamespaceDigest
    keys: list
    offsets: list = field(default_factory=list)
    size: int = 0
    deadline: float = 0.0        # probe: answered by then (time.monotonic), with or without the store
    cancelled: bool = False      # fetch: set by the loop thread; the fetch stops at its next batch
    started: bool = False        # guarded by the tier's lock: a thread took it (it may touch the pool)
    reported: bool = False       # guarded by the tier's lock: a job is handed back once
    # results, set by the tier's thread before the job is reported
    hits: int = 0                # probe: remote blocks continuing the chain
    failed: list = field(default_factory=list)   # fetch: indices not fetched intact; write: not written
                                                 # because the store was unreachable (the caller may retry)
    dropped: dict = field(default_factory=dict)  # write: why -> blocks not written for good (budget, rejected)
    if_missing: bool = False     # write: SET only the blocks the store lacks (warm restart's re-queue)
    present: list = field(default_factory=list)  # write, if_missing: indices the store held already
    crcs: list = field(default_factory=list)     # fetch: (offset, checksum as pool/checksum.py keeps it)
    error: str = ""              # why the store could not be asked ("" = it answered)
    tenant: str = ""             # probe, fetch: whose turn it takes (turns.py)


class Deadlines:
    """One thread that calls ``expire(job)`` at each added job's deadline;
    ``expire`` reports the job unless its thread already did."""

    def __init__(self, expire: Callable[[Job], None], clock=time.monotonic):
        self._expire, self._clock = expire, clock
        self._heap: list = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-remote-deadlines", daemon=True)
        self._thread.start()

    def add(self, job: Job) -> None:
        with self._cv:
            heapq.heappush(self._heap, (job.deadline, next(self._seq), job))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > self._clock()):
                    self._cv.wait(self._heap[0][0] - self._clock() if self._heap else None)
                if self._closed:
                    return
                job = heapq.heappop(self._heap)[2]
            self._expire(job)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5)


def more_writes(q: queue.Queue, first: Job, batch_bytes: int) -> list[Job]:
    """Write jobs queued behind ``first``, batched into one pipeline up to ``batch_bytes``
    (a None stop marker met on the way stays queued for the thread's loop)."""
    jobs, nbytes = [], len(first.keys) * first.size
    while nbytes < batch_bytes:
        try:
            job = q.get_nowait()
        except queue.Empty:
            break
        if job is None:
            q.put(None)
            break
        jobs.append(job)
        nbytes += len(job.keys) * job.size
    return jobs
