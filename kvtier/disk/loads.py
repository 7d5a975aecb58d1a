"""Loads of disk blocks (the loop thread; ``DiskBridge`` composes one).

A load naming disk blocks the pool lacks allocates slots for them
(invisible, like a store in progress), has the I/O threads read and verify
them, commits the good ones, then hands the load back to the path that asked
(``PendingLoad.land``: the remote tier next, then a copy from RAM). A load needing blocks another load
is reading waits for that read. A load whose reads are not done after
``timeout_s`` is answered without them (those blocks fail; RAM hits are
served); its slots stay reserved until the reads returned. A disk with a
read stuck past ``timeout_s`` takes no new loads until it answers: they fail
at once. Disk blocks are never written back by a load (they are on disk).

Primitives: ``DiskLoads(tier)``, ``.load(ns, pending) -> bool``,
``.cancel(identity, req_id) -> bool``, ``.waiting(uid) -> int``, ``.read(job)`` (its reads returned),
``.expired(job)`` (past its deadline), ``.by_request``, ``.waiting_for``.
"""

from __future__ import annotations

import time
from collections import Counter


class DiskWait:
    """A load waiting for disk reads: its own, and reads other loads started for blocks it needs.
    It counts toward its user's ``max_transfers_per_user`` until answered (``DiskBridge.waiting``)."""
    __slots__ = ("load", "present", "waits", "answered")

    def __init__(self, load, present, waits):
        self.load, self.present, self.waits = load, present, waits  # load: the daemon's PendingLoad
        self.answered = False


class DiskLoads:
    def __init__(self, tier):
        # tier: the DiskBridge: its io, dindex, index, timeout_s, counters, crcs, journal, and the
        # per-namespace flight bookkeeping shared with writes (generation, in_flight, landed, emptied).
        self.tier = tier
        self.waiting_for: dict = {}     # read job -> [DiskWait waiting for it]
        self.reading: dict = {}         # (ns key, block key) -> the read job bringing it into the pool
        self.by_request: dict = {}      # (identity, request id) -> DiskWait
        self.by_user: Counter = Counter()  # uid -> its loads waiting (admission counts them)

    def load(self, ns, pending) -> bool:
        """Read the disk blocks of ``pending``'s chain the pool lacks; True when it waits for them.
        ``pending.uid``: the requesting user, whose transfer cap a waiting load counts toward."""
        keys, prefix = pending.keys, pending.prefix
        fp = ns.key
        on_disk = self.tier.dindex.entries_of(fp)
        if on_disk is None:
            return False
        index, reading = self.tier.index, self.reading
        wanted, waits = [], set()  # to read; reads in flight for other loads that this one waits for
        for k in (keys if prefix else dict.fromkeys(keys)):
            job = reading.get((fp, k))
            if job is not None and job.expired:
                # Its read is stuck past the deadline (set by the clock thread; a read of a bool):
                # waiting on it would hold this load until the disk answers, not disk_timeout_s.
                self.tier.counters["fail_fast"] += 1
                if prefix:
                    break
            elif job is not None:
                waits.add(job)
            elif k in on_disk and not index.holds(fp, k):
                wanted.append(k)
            elif prefix and index.ready_entry(ns, k) is None:
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
        w = DiskWait(pending, present, waits)
        for job in waits:
            self.waiting_for[job].append(w)
        self.by_request[(pending.identity, pending.req_id)] = w
        self.by_user[pending.uid] += 1
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
        w = self.by_request.get((identity, req_id))
        if w is None:
            return False
        w.load.cancel()
        self._answer(w)
        return True

    def _answer(self, w: DiskWait) -> None:
        if w.answered:
            return
        w.answered = True
        p = w.load
        self.by_request.pop((p.identity, p.req_id), None)
        self.by_user[p.uid] -= 1  # before the load goes on and is admitted: it takes this wait's place
        if not self.by_user[p.uid]:
            del self.by_user[p.uid]
        self.tier.index.unpin(w.present)
        p.land()  # the load path goes on (or answers a cancelled load failed)

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
        # Not yet dropped for room or flushed: announced, and out of the lookup mirror.
        self.tier.removed([e for e in bad if self.tier.dindex.remove(e)])
        # Each write's own file (its seq is in the name); its directory too if nothing is left.
        self.tier.io.unlink([e.path for e in bad], self.tier.emptied([plan.ns.key]))
        waiting = self.waiting_for.pop(job)
        self.tier.counters.update(loaded=len(job.ok), load_failed=len(failed),
                             late=len(job.ok) if job.expired else 0)
        for w in waiting:
            w.waits.discard(job)
            if not w.waits:
                self._answer(w)

    def expired(self, job) -> None:
        """Its reads are past the deadline: the loads waiting for it go on without its blocks."""
        self.tier.counters["timed_out"] += len(job.items)
        for w in self.waiting_for.get(job, ()):
            self._answer(w)
