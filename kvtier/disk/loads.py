"""Loads of disk blocks (the loop thread; ``DiskBridge`` composes one).

A load naming disk blocks the pool lacks allocates slots for them
(invisible, like a store in progress), has the I/O threads read and verify
them, commits the good ones, then runs the load again at the daemon's
dispatch point as an ordinary RAM load. A load needing blocks another load
is reading waits for that read. A load whose reads are not done after
``timeout_s`` is answered without them (those blocks fail; RAM hits are
served); its slots stay reserved until the reads returned. A disk with a
read stuck past ``timeout_s`` takes no new loads until it answers: they fail
at once. Disk blocks are never written back by a load (they are on disk).

Primitives: ``DiskLoads(tier, send, redispatch)``, ``.load(identity, req_id, msg, ns, keys, uid) -> bool``,
``.cancel(identity, req_id) -> bool``, ``.waiting(uid) -> int``, ``.read(job)`` (its reads returned),
``.expired(job)`` (past its deadline), ``.by_request``, ``.waiting_for``.
"""

from __future__ import annotations

import time
from collections import Counter

from ..protocol import messages as m
from ..protocol.arrays import pack_ids
from ..protocol.codec import encode


class PendingLoad:
    """A load waiting for disk reads: its own, and reads other loads started for blocks it needs.
    It counts toward its user's ``max_transfers_per_user`` until answered (``DiskBridge.waiting``)."""
    __slots__ = ("identity", "req_id", "msg", "present", "count", "waits", "uid", "answered", "cancelled")

    def __init__(self, identity, req_id, msg, present, count, waits, uid):
        self.identity, self.req_id, self.msg = identity, req_id, msg
        self.present, self.count, self.waits, self.uid = present, count, waits, uid
        self.answered = self.cancelled = False


class DiskLoads:
    def __init__(self, tier, send, redispatch):
        # tier: the DiskBridge: its io, dindex, index, timeout_s, counters, crcs, journal, and the
        # per-namespace flight bookkeeping shared with writes (generation, in_flight, landed, emptied).
        self.tier, self.send, self.redispatch = tier, send, redispatch
        self.waiting_for: dict = {}     # read job -> [PendingLoad waiting for it]
        self.reading: dict = {}         # (ns key, block key) -> the read job bringing it into the pool
        self.by_request: dict = {}      # (identity, request id) -> PendingLoad
        self.by_user: Counter = Counter()  # uid -> its loads waiting (admission counts them)
        self.local_only: set = set()    # (identity, request id) of loads being re-run after the reads

    def load(self, identity: bytes, req_id: int, msg, ns, keys: list[bytes], uid=None) -> bool:
        """``uid``: the requesting user, whose transfer cap a waiting load counts toward."""
        if (identity, req_id) in self.local_only:
            return False
        fp = ns.key
        on_disk = self.tier.dindex.entries_of(fp)
        if on_disk is None:
            return False
        index, reading = self.tier.index, self.reading
        wanted, waits = [], set()  # to read; reads in flight for other loads that this one waits for
        for k in (keys if msg.prefix else dict.fromkeys(keys)):
            job = reading.get((fp, k))
            if job is not None and job.expired:
                # Its read is stuck past the deadline (set by the clock thread; a read of a bool):
                # waiting on it would hold this load until the disk answers, not disk_timeout_s.
                self.tier.counters["fail_fast"] += 1
                if msg.prefix:
                    break
            elif job is not None:
                waits.add(job)
            elif k in on_disk and not index.holds(fp, k):
                wanted.append(k)
            elif msg.prefix and index.ready_entry(ns, k) is None:
                break  # only the chain's prefix is wanted: read the disk blocks in it
        if not wanted and not waits:
            return False
        if wanted and self.tier.io.stalled(self.tier.timeout_s):
            self.tier.counters["fail_fast"] += len(wanted)
            wanted = []
            if not waits:
                return False
        present = index.ready_entries(ns, keys)
        # Held so that room made for the blocks read is not taken from this very chain.
        self.tier.index.pin(present)
        if wanted:
            job = self._read_into_pool(ns, on_disk, wanted)
            if job is not None:
                waits.add(job)
        if not waits:
            self.tier.index.unpin(present)
            return False
        p = PendingLoad(identity, req_id, msg, present, len(keys), waits, uid)
        for job in waits:
            self.waiting_for[job].append(p)
        self.by_request[(identity, req_id)] = p
        self.by_user[uid] += 1
        return True

    def waiting(self, uid) -> int:
        """Loads of ``uid`` waiting for disk reads: transfers in flight like its copies."""
        return self.by_user.get(uid, 0)

    def _read_into_pool(self, ns, on_disk: dict, wanted: list):
        """Slots for ``wanted`` (invisible until read and verified) and the job reading them, or None."""
        plan = self.tier.index.prepare_store(ns, wanted)
        got = [i for i, e in enumerate(plan.entries) if e is not None]
        if not got:
            self.tier.index.complete_store(plan, failed=range(len(plan.entries)))
            self.tier.counters["no_room"] += len(wanted)
            return None
        items = [(on_disk[plan.entries[i].key], plan.entries[i].offset) for i in got]
        job = self.tier.io.read(items, ns.block_bytes, (plan, got, self.tier.generation[ns.key]),
                           time.monotonic() + self.tier.timeout_s)
        self.waiting_for[job] = []
        self.tier.in_flight[ns.key] += len(got)
        self.reading.update(((ns.key, plan.entries[i].key), job) for i in got)
        return job

    def cancel(self, identity: bytes, req_id: int) -> bool:
        """The client cancels a load waiting on the disk: answered failed now, nothing copied."""
        p = self.by_request.get((identity, req_id))
        if p is None:
            return False
        p.cancelled = True
        self._answer(p)
        return True

    def _answer(self, p: PendingLoad) -> None:
        if p.answered:
            return
        p.answered = True
        self.by_request.pop((p.identity, p.req_id), None)
        self.by_user[p.uid] -= 1  # before the re-run below is admitted: it takes this load's place
        if not self.by_user[p.uid]:
            del self.by_user[p.uid]
        self.tier.index.unpin(p.present)
        if p.cancelled:  # the engine may reuse its blocks already: copy nothing into them
            self.send(p.identity, p.req_id, m.TransferDone(0, 0, pack_ids(range(p.count))))
            return
        self.local_only.add((p.identity, p.req_id))
        try:
            self.redispatch(p.identity, encode(p.msg, p.req_id))
        finally:
            self.local_only.discard((p.identity, p.req_id))

    def read(self, job) -> None:
        """The reads returned: commit what verified, forget files that did not, answer the loads
        that waited for nothing else."""
        plan, got, gen = job.token
        failed = set(job.failed)
        stale = gen != self.tier.generation[plan.ns.key]
        self.tier.landed(plan.ns.key, len(got))
        if stale:  # flushed while being read: commit nothing
            failed = set(range(len(got)))
            job.ok = []
        self.tier.index.complete_store(plan, failed=[got[j] for j in failed])
        for i in got:
            self.reading.pop((plan.ns.key, plan.entries[i].key), None)
        good = [(plan.entries[got[j]].offset, crc) for j, crc in job.ok]
        if self.tier.crcs is not None:
            self.tier.crcs.update(good)
        if self.tier.journal is not None and good:
            self.tier.journal.committed(plan, good)
        for j, _ in job.ok:
            self.tier.dindex.touch(job.items[j][0])
        bad = [job.items[j][0] for j in job.bad]
        for e in bad:
            if self.tier.dindex.remove(e):  # not yet dropped for room or flushed: announce it
                self.tier.index.record("disk_removed", e.ns_key, e.key)
        # Each write's own file (its seq is in the name); its directory too if nothing is left.
        self.tier.io.unlink([e.path for e in bad], self.tier.emptied([plan.ns.key]))
        waiting = self.waiting_for.pop(job)
        self.tier.counters.update(loaded=len(job.ok), load_failed=len(failed),
                             late=len(job.ok) if job.expired else 0)
        for p in waiting:
            p.waits.discard(job)
            if not p.waits:
                self._answer(p)

    def expired(self, job) -> None:
        """Its reads are past the deadline: the loads waiting for it go on without its blocks."""
        self.tier.counters["timed_out"] += len(job.items)
        for p in self.waiting_for.get(job, ()):
            self._answer(p)
