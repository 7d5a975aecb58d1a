"""Tenants take turns at the remote tier: bounded probe slots and round-robin queues.

A lookup whose local prefix ends early waits on a probe slot (``max_probes`` in
all); a load naming blocks the pool lacks waits on the fetch thread. Both were
one pool and one FIFO for every tenant, so one tenant's flood of lookups took
every slot (other tenants' lookups answered from local blocks only) and its
hundreds of queued fetches ran before another tenant's one. Here each tenant
holds at most ``per_tenant`` probe slots, and each queue serves tenants in
turn: a tenant's own jobs keep their order, and another tenant's job waits
behind at most one job of each tenant with work queued, not behind all of them.
The write-behind queue needs neither: its backlog already takes tenant turns
(kvtier.disk.schedule.WriteBacklog).

Primitives:
  Slots(total, per_tenant)   .take(tenant) -> "" | "full" | "tenant"  (why not), .give(tenant), .held
                             not locked: the tier calls it under its own lock
  TurnQueue()                a ``queue.Queue`` stand-in for one consumer thread:
                             .put(job) (job.tenant picks its lane; None: stop once drained),
                             .get(timeout=None) (raises queue.Empty), .get_nowait(), .qsize()
"""

from __future__ import annotations

import queue
import threading

from ..lanes import Lanes


class Slots:
    def __init__(self, total: int, per_tenant: int):
        self.total, self.per_tenant = total, per_tenant
        self.held = 0
        self.of: dict[str, int] = {}  # tenant -> slots held (no entry at 0; a dict: ~5x cheaper than a Counter)

    def take(self, tenant: str) -> str:
        if self.held >= self.total:
            return "full"
        n = self.of.get(tenant, 0)
        if n >= self.per_tenant:
            return "tenant"
        self.held += 1
        self.of[tenant] = n + 1
        return ""

    def give(self, tenant: str) -> None:
        self.held -= 1
        n = self.of[tenant] - 1
        if n:
            self.of[tenant] = n
        else:
            del self.of[tenant]


class TurnQueue:
    def __init__(self):
        self._cv = threading.Condition()
        self._lanes = Lanes()  # tenant -> its jobs, in turn
        self._stop = False

    def put(self, job) -> None:
        with self._cv:
            if job is None:  # as a FIFO's marker: what was queued before it still runs
                self._stop = True
            else:
                self._lanes.push(job.tenant, job)
            self._cv.notify()

    def get(self, timeout: float | None = None):
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._lanes) or self._stop, timeout):
                raise queue.Empty
            return self._next()

    def get_nowait(self):
        with self._cv:
            if not len(self._lanes) and not self._stop:
                raise queue.Empty
            return self._next()

    def qsize(self) -> int:
        return len(self._lanes)

    def _next(self):
        return self._lanes.pop()[1] if len(self._lanes) else None  # None: stopped and drained
