"""The daemon's side of the disk tier: runs on the poll-loop thread and is the
only part that touches the block index or the disk index for disk work.

Hooks (marked ``# disk tier hook`` where the daemon calls them):

  committed(plan)      an engine's store committed: its new blocks join their tenant's
                       write backlog, and the backlog feeds the write-behind queue
                       (pinned in the pool, at most ``queue_bytes``) tenant by tenant
                       as room frees (schedule.py): nothing is dropped for a full
                       queue, no disk I/O on the store's path, and eviction never
                       waits for the disk
  extend(ns, keys, n)  BlockIndex.lookup's lower tier: how far the chain goes on
                       counting disk blocks (dict lookups, never the disk)
  flushed(ns | None)   BlockIndex.flush's lower tier: a flush empties the disk too
  flush_keys(keys)     a flush of namespaces that may be on disk only (after a restart)
  namespace_keys(), oldest_first(keys), drop_namespaces(keys)
                       max_namespaces_per_user counts disk namespaces too (daemon/sessions.py)
  load(...) -> bool    the load names disk blocks the pool lacks: allocate them
                       (invisible, like a store in progress), read and verify them
                       on the I/O threads, commit the good ones, then run the load
                       again locally; True = the reply comes from that second run
  cancel(...) -> bool  a Cancel names a load waiting on the disk: answered failed now
  poll()               the I/O wakeup fd is readable: finish what completed

The loop thread makes no filesystem call: files are written, read, unlinked
and scanned on the I/O threads. An entry leaves the disk index before its
file is queued for unlinking (a crash in between leaves a file the next scan
indexes or drops again). Making room drops at most ``FIT_BATCH`` entries per
loop turn: a large excess (a start after a ``disk_size`` cut) is dropped in
slices, the loop answering requests between them.

A load whose reads are not done after ``timeout_s`` is answered without them
(those blocks fail, the engine recomputes; RAM hits of the same load are
served); its slots stay reserved until the reads returned. A disk that has
a read stuck past ``timeout_s`` takes no new loads until it answers: they
fail at once. Disk blocks are never written back by a load (they are on disk).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from itertools import islice

from ..pool.index import READY
from ..pool.keys import owner_of, split_key
from ..protocol import messages as m
from ..protocol.arrays import pack_ids
from ..protocol.codec import encode
from .format import HEADER_BYTES, MAX_NS_KEY
from .index import DiskEntry, DiskIndex
from .io import DiskIO
from .schedule import WriteBacklog

log = logging.getLogger("kvtier.disk")
FIT_BATCH = 1024  # index entries dropped per loop turn: ~10 ms at the ~6-21 us each measured


class PendingLoad:
    """A load waiting for disk reads: its own, and reads other loads started for blocks it needs.
    It counts toward its user's ``max_transfers_per_user`` until answered (``DiskBridge.waiting``)."""
    __slots__ = ("identity", "req_id", "msg", "present", "count", "waits", "uid", "answered", "cancelled")

    def __init__(self, identity, req_id, msg, present, count, waits, uid):
        self.identity, self.req_id, self.msg = identity, req_id, msg
        self.present, self.count, self.waits, self.uid = present, count, waits, uid
        self.answered = self.cancelled = False


class DiskBridge:
    def __init__(self, io: DiskIO, dindex: DiskIndex, index, send, redispatch, timeout_s: float,
                 queue_bytes: int, crcs: dict | None = None, backlog_bytes: int | None = None):
        self.io, self.dindex, self.index = io, dindex, index
        self.send = send                # (identity, request id, reply) -> None
        self.redispatch = redispatch    # (identity, frame) -> None: the daemon's dispatch point
        self.timeout_s, self.queue_bytes = timeout_s, queue_bytes
        self.crcs = crcs                # the daemon's checksum table, when checksums are on
        self.journal = None             # warm restart: blocks read back are journaled like stores
        self.counters: Counter = Counter()
        self.queued = 0                 # write-behind bytes held in the pool
        self.backlog = WriteBacklog(backlog_bytes or queue_bytes * 4)  # committed, waiting for queue room
        self.writing: set = set()       # (ns key, block key) being written
        # ns key -> flushes while it had reads or writes in flight (a result finishing after one is
        # dropped); forgotten with its last job, so cycling namespaces leaves nothing behind.
        self.generation: Counter = Counter()
        self.in_flight: Counter = Counter()  # ns key -> blocks being written or read
        self.loads: dict = {}           # read job -> [PendingLoad waiting for it]
        self.reading: dict = {}         # (ns key, block key) -> the read job bringing it into the pool
        self.by_request: dict = {}      # (identity, request id) -> PendingLoad
        self.by_user: Counter = Counter()  # uid -> its loads waiting (admission counts them)
        self.local_only: set = set()    # (identity, request id) of loads being re-run after the reads
        self.scanning = True
        self.scan_started = time.monotonic()
        self.scan_s = 0.0
        self.fit_pending = False        # a ("fit", None) is queued: more entries to drop next turn
        io.scan()

    @property
    def wakeup_fd(self) -> int:
        return self.io.wakeup_fd

    # ---- lookups (BlockIndex's lower tier) ------------------------------------------------
    def extend(self, ns, keys: list, hits: int) -> int:
        on_disk = self.dindex.namespaces.get(ns.fingerprint)
        if on_disk is None:
            return hits
        ready, n = ns.ready_map, hits
        for k in islice(keys, hits, None):
            if k not in on_disk and k not in ready:
                break
            n += 1
        if n > hits:
            ns.stats["disk_hits"] += n - hits
        return n

    def flushed(self, ns) -> None:
        self.flush_keys(None if ns is None else [ns.fingerprint])

    def flush_keys(self, keys: list[str] | None) -> list:
        """Drop these namespaces' blocks (None: all), also those with no bucket in RAM (found
        by the scan after a restart); the entries dropped. A write or read of them that
        finishes later is dropped too (its generation is stale)."""
        for k in list(self.in_flight) if keys is None else keys:
            if self.in_flight[k]:
                self.generation[k] += 1
        for k in self.backlog.namespaces() if keys is None else keys:
            self.backlog.forget(k)  # flushed from every tier: not written, by policy
        victims = self.dindex.drop(keys)
        self._unlink(victims)
        return victims

    def namespace_keys(self) -> list[str]:
        """Namespaces with blocks on disk (tenant SEP fingerprint), in RAM or not."""
        return list(self.dindex.namespaces)

    # ---- write-behind ------------------------------------------------------------------------
    def committed(self, plan) -> None:
        ns = plan.ns
        key = ns.fingerprint
        on_disk = self.dindex.namespaces.get(key, {})
        keys = [e.key for e in plan.entries if e is not None and e.state == READY and ns.entries.get(e.key) is e
                and e.key not in on_disk and (key, e.key) not in self.writing]
        if not keys:
            return
        if len(key.encode()) > MAX_NS_KEY:
            self.counters["write_skipped"] += len(keys)
            self.backlog.lost(owner_of(key), "too_long", len(keys))
            return
        self.backlog.add(owner_of(key), ns, keys)
        self._feed()

    def _feed(self) -> None:
        """Move backlog turns into the write-behind queue while it has room. A block is
        written from the pool if it is still there (pinned from here until written)."""
        while True:
            turn = self.backlog.take(self.queue_bytes - self.queued)
            if turn is None:
                return
            tenant, ns, keys = turn
            key, size = ns.fingerprint, ns.block_bytes
            on_disk = self.dindex.namespaces.get(key, {})
            entries = []
            for k in keys:
                e = ns.entries.get(k)
                if e is None or e.state != READY:  # evicted before its turn
                    self.backlog.lost(tenant, "evicted")
                elif k not in on_disk and (key, k) not in self.writing:
                    entries.append(e)
            if not entries:
                continue
            n = len(entries)
            victims = self.dindex.reserve(n * (HEADER_BYTES + size), FIT_BATCH, tenant)
            if victims is None:  # more than the tenant's share of disk_size (or all of it)
                self.counters["write_skipped"] += n
                self.backlog.lost(tenant, "over_share", n)
                continue
            self._unlink(victims)
            self._fit_later()
            self.index.pin(entries)
            self.queued += n * size
            self.writing.update((key, e.key) for e in entries)
            items = [(key, e.key, self.io.next_seq(), e.offset) for e in entries]
            self.in_flight[key] += n
            self.io.write(items, size, ("write", entries, self.generation[key]))

    def _written(self, job) -> None:
        entries, gen = job.token[1], job.token[2]
        size = job.size
        key = job.items[0][0]
        self.index.unpin(entries)
        self.queued -= len(entries) * size
        self.writing.difference_update((key, e.key) for e in entries)
        self.dindex.release(len(entries) * (HEADER_BYTES + size), owner_of(key))
        stale = gen != self.generation[key]  # flushed while being written
        self._landed(key, len(entries))
        unannounced = []
        for i, crc, path in job.ok:
            _, k, seq, _ = job.items[i]
            entry = DiskEntry(key, k, seq, size, crc, path)
            replaced = [entry] if stale else self.dindex.add(entry, limit=0)  # room: below, in one slice
            if replaced:  # stale, or one of two copies of a block that stays on disk: no event
                unannounced += [v.path for v in replaced]
            else:
                self.index.record("disk_stored", key, k)
        self.counters["write_failed"] += len(job.failed)
        self.backlog.lost(owner_of(key), "failed", len(job.failed))
        self.io.unlink(unannounced, self._emptied([key]))
        self._fit()
        self._feed()  # the queue has room again

    def _fit(self) -> None:
        """Drop one slice of the oldest entries beyond ``disk_size``; the next slice next loop turn."""
        self.fit_pending = False
        self._unlink(self.dindex.shrink(FIT_BATCH))
        self._fit_later()

    def _fit_later(self) -> None:
        # While scanning, found files are not fitted yet (the oldest may not have been found).
        if self.dindex.over and not self.scanning and not self.fit_pending:
            self.fit_pending = True
            self.io.remind("fit")

    def _unlink(self, victims: list) -> None:
        for v in victims:
            self.index.record("disk_removed", v.ns_key, v.key)
        self.io.unlink([v.path for v in victims], self._emptied({v.ns_key for v in victims}))

    def _emptied(self, ns_keys) -> list[str]:
        """Namespaces with nothing left on disk and nothing in flight: their directories go
        once the unlinks queued with them are done (cycling namespaces leaves no directory)."""
        return [k for k in ns_keys if k not in self.dindex.namespaces and not self.in_flight[k]]

    def _landed(self, key: str, n: int) -> None:
        """``n`` blocks of ``key`` written or read: a namespace with none left in flight is forgotten."""
        self.in_flight[key] -= n
        if self.in_flight[key] <= 0:
            del self.in_flight[key]
            self.generation.pop(key, None)

    def drop_namespaces(self, ns_keys: list[str]) -> list:
        """A tenant at ``max_namespaces_per_user`` makes room: these namespaces leave the disk."""
        self.counters["namespaces_dropped"] += len(ns_keys)
        return self.flush_keys(ns_keys)

    def oldest_first(self, ns_keys) -> list[str]:
        """Namespaces on disk, the one written or read least recently first."""
        return sorted((k for k in ns_keys if k in self.dindex.namespaces), key=self.dindex.ns_newest.__getitem__)

    # ---- loads ---------------------------------------------------------------------------------
    def load(self, identity: bytes, req_id: int, msg, ns, keys: list[bytes], uid=None) -> bool:
        """``uid``: the requesting user, whose transfer cap a waiting load counts toward."""
        if (identity, req_id) in self.local_only:
            return False
        fp = ns.fingerprint
        on_disk = self.dindex.namespaces.get(fp)
        if on_disk is None:
            return False
        entries, ready, reading = ns.entries, ns.ready_map, self.reading
        wanted, waits = [], set()  # to read; reads in flight for other loads that this one waits for
        for k in (keys if msg.prefix else dict.fromkeys(keys)):
            job = reading.get((fp, k))
            if job is not None and job.expired:
                # Its read is stuck past the deadline (set by the clock thread; a read of a bool):
                # waiting on it would hold this load until the disk answers, not disk_timeout_s.
                self.counters["fail_fast"] += 1
                if msg.prefix:
                    break
            elif job is not None:
                waits.add(job)
            elif k in on_disk and k not in entries:
                wanted.append(k)
            elif msg.prefix and k not in ready:
                break  # only the chain's prefix is wanted: read the disk blocks in it
        if not wanted and not waits:
            return False
        if wanted and self.io.stalled(self.timeout_s):
            self.counters["fail_fast"] += len(wanted)
            wanted = []
            if not waits:
                return False
        present = [e for e in map(entries.get, keys) if e is not None and e.state == READY]
        # Held so that room made for the blocks read is not taken from this very chain.
        self.index.pin(present)
        if wanted:
            job = self._read_into_pool(ns, on_disk, wanted)
            if job is not None:
                waits.add(job)
        if not waits:
            self.index.unpin(present)
            return False
        p = PendingLoad(identity, req_id, msg, present, len(keys), waits, uid)
        for job in waits:
            self.loads[job].append(p)
        self.by_request[(identity, req_id)] = p
        self.by_user[uid] += 1
        return True

    def waiting(self, uid) -> int:
        """Loads of ``uid`` waiting for disk reads: transfers in flight like its copies."""
        return self.by_user.get(uid, 0)

    def _read_into_pool(self, ns, on_disk: dict, wanted: list):
        """Slots for ``wanted`` (invisible until read and verified) and the job reading them, or None."""
        plan = self.index.prepare_store(ns, wanted)
        got = [i for i, e in enumerate(plan.entries) if e is not None]
        if not got:
            self.index.complete_store(plan, failed=range(len(plan.entries)))
            self.counters["no_room"] += len(wanted)
            return None
        items = [(on_disk[plan.entries[i].key], plan.entries[i].offset) for i in got]
        job = self.io.read(items, ns.block_bytes, (plan, got, self.generation[ns.fingerprint]),
                           time.monotonic() + self.timeout_s)
        self.loads[job] = []
        self.in_flight[ns.fingerprint] += len(got)
        self.reading.update(((ns.fingerprint, plan.entries[i].key), job) for i in got)
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
        self.index.unpin(p.present)
        if p.cancelled:  # the engine may reuse its blocks already: copy nothing into them
            self.send(p.identity, p.req_id, m.TransferDone(0, 0, pack_ids(range(p.count))))
            return
        self.local_only.add((p.identity, p.req_id))
        try:
            self.redispatch(p.identity, encode(p.msg, p.req_id))
        finally:
            self.local_only.discard((p.identity, p.req_id))

    def _read(self, job) -> None:
        """The reads returned: commit what verified, forget files that did not, answer the loads
        that waited for nothing else."""
        plan, got, gen = job.token
        failed = set(job.failed)
        stale = gen != self.generation[plan.ns.fingerprint]
        self._landed(plan.ns.fingerprint, len(got))
        if stale:  # flushed while being read: commit nothing
            failed = set(range(len(got)))
            job.ok = []
        self.index.complete_store(plan, failed=[got[j] for j in failed])
        for i in got:
            self.reading.pop((plan.ns.fingerprint, plan.entries[i].key), None)
        good = [(plan.entries[got[j]].offset, crc) for j, crc in job.ok]
        if self.crcs is not None:
            self.crcs.update(good)
        if self.journal is not None and good:
            self.journal.committed(plan, good)
        for j, _ in job.ok:
            self.dindex.touch(job.items[j][0])
        bad = [job.items[j][0] for j in job.bad]
        for e in bad:
            if self.dindex.remove(e):  # not yet dropped for room or flushed: announce it
                self.index.record("disk_removed", e.ns_key, e.key)
        # Each write's own file (its seq is in the name); its directory too if nothing is left.
        self.io.unlink([e.path for e in bad], self._emptied([plan.ns.fingerprint]))
        waiting = self.loads.pop(job)
        self.counters.update(loaded=len(job.ok), load_failed=len(failed),
                             late=len(job.ok) if job.expired else 0)
        for p in waiting:
            p.waits.discard(job)
            if not p.waits:
                self._answer(p)

    # ---- completions -------------------------------------------------------------------------
    def poll(self) -> None:
        for what, job in self.io.completed():
            if what == "scan":
                self._found(job)
            elif what == "fit":
                self._fit()
            elif what == "scanned":
                self.scanning = False
                self.scan_s = time.monotonic() - self.scan_started
                self._fit()
                log.info("disk tier: %d blocks (%d bytes) found in %s in %.2fs", len(self.dindex),
                         self.dindex.used, self.io.root, self.scan_s)
            elif job.kind == "write":
                self._written(job)
            elif what == "expired":  # the loads waiting for it go on without its blocks
                self.counters["timed_out"] += len(job.items)
                for p in self.loads.get(job, ()):
                    self._answer(p)
            else:
                self._read(job)

    def _found(self, entries: list) -> None:
        """A batch of the start-up scan: indexed (lookups count them now) and announced."""
        extra = []
        for entry in entries:
            if (entry.ns_key, entry.key) in self.writing:  # rewritten now: the new file wins
                extra.append(entry)
                continue
            replaced = self.dindex.add(entry, found=True)  # fitted to disk_size once all are found
            if replaced:  # two files of one block: the older goes, the block stays (announced once)
                extra += replaced
            else:
                self.index.record("disk_stored", entry.ns_key, entry.key)
        self.io.unlink([e.path for e in extra])

    # ---- status ---------------------------------------------------------------------------------
    def stats(self, tenant: str | None = None) -> dict:
        """The ``disk`` section; ``tenant``: only that tenant's namespaces (None: all)."""
        io, errors = self.io.snapshot(tenant)  # a tenant's view names its own files only
        rows, tenants = [], Counter()
        for key, (blocks, nbytes) in sorted(self.dindex.by_namespace().items()):
            owner, fingerprint = split_key(key)
            tenants[owner] += nbytes
            if tenant is None or owner == tenant:
                rows.append({"fingerprint": fingerprint, "blocks": blocks, "bytes": nbytes,
                             **({"tenant": owner} if tenant is None else {})})
        keys = ("written", "written_bytes", "read", "read_bytes", "read_direct", "rejected", "missing", "enospc", "eio",
                "read_errors", "errors", "read_expired", "read_late", "unlinked", "scanned", "scan_rejected")
        out = {"enabled": True, "path": self.io.root, "o_direct": self.io.direct,
               "capacity_bytes": self.dindex.capacity,
               "used_bytes": self.dindex.used, "reserved_bytes": self.dindex.reserved,
               "blocks": len(self.dindex), "dropped": self.dindex.dropped, "queued_bytes": self.queued,
               "queue_bytes": self.queue_bytes, "scanning": self.scanning, "fitting": self.fit_pending,
               "scan_s": round(self.scan_s, 3),
               "loads_waiting": len(self.by_request), "reads_in_flight": len(self.loads), "namespaces": rows,
               "backlog_blocks": self.backlog.blocks if tenant is None else self.backlog.of(tenant),
               "backlog_limit_bytes": self.backlog.limit_bytes, "not_written": self.backlog.not_written(tenant),
               **{k: io.get(k, 0) for k in keys}, **{k: self.counters[k] for k in (
                   "write_skipped", "write_failed", "loaded", "load_failed", "fail_fast",
                   "timed_out", "no_room", "late", "namespaces_dropped")},
               "last_errors": errors}
        shares = self.dindex.shares  # tenant_share of disk_size: a tenant at it dropped its own oldest
        out.update(tenant_share=shares.share, tenant_limit_bytes=shares.limit)
        if tenant is None:
            out["tenants"] = dict(tenants)
            out["own_dropped"] = dict(shares.own_dropped)
        return out

    def check_integrity(self) -> None:
        # Files found are fitted once all are found, a large excess over a few loop turns.
        self.dindex.check_integrity(fitted=not (self.scanning or self.fit_pending))
        problems = self.backlog.problems()
        if not set(self.generation) <= set(self.in_flight) or any(n <= 0 for n in self.in_flight.values()):
            problems.append(f"flush generations {dict(self.generation)} kept past their jobs {dict(self.in_flight)}")
        if problems:
            raise AssertionError(f"disk tier: {problems}")

    def close(self) -> None:
        self.io.close()
