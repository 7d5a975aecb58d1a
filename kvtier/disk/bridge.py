"""The daemon's side of the disk tier: runs on the poll-loop thread and is the
only part that touches the block index or the disk index for disk work.

Hooks (marked ``# disk tier hook`` where the daemon calls them):

  adopted(entries)     warm restart: the kept blocks the disk lacks (after the start-up
                       scan) join the backlog too, a batch as it runs low; a SIGKILL
                       loses none of them silently
  committed(plan)      an engine's store committed: its new blocks join their tenant's
                       write backlog, and the backlog feeds the write-behind queue
                       (pinned in the pool, at most ``queue_bytes``) tenant by tenant
                       as room frees (schedule.py): nothing is dropped for a full
                       queue, no disk I/O on the store's path, and eviction never
                       waits for the disk
  extend(ns, keys, n)  BlockIndex.lookup's lower tier: how far the chain goes on
                       counting disk blocks (dict lookups, never the disk)
  flushed(ns | None)   BlockIndex.flush's lower tier: a flush empties the disk too
  flush_keys(keys) -> DiskFlush
                       a flush of namespaces that may be on disk only (after a restart):
                       hidden at once (lookups, loads and the mirror see none of it),
                       their files dropped ``drain(n)`` entries per loop turn
                       (daemon/flushes.py); ``draining`` while any are left;
                       then ``tidy(n)`` rebuilds the age heap they left stale (``tidying``)
  namespace_keys(), oldest_first(keys), drop_namespaces(keys)
                       max_namespaces_per_user counts disk namespaces too (daemon/sessions.py)
  load(ns, pending) -> bool  the load names disk blocks the pool lacks (loads.py: read
                       them into the pool, then hand the load back: ``pending.land()``);
                       True = answered later
  cancel(...) -> bool  a Cancel names a load waiting on the disk: answered failed now
  poll()               the I/O wakeup fd is readable: finish what completed
  keys_of(ns_key), on_disk(ns_key, key), keys_on_disk(ns_key)
                       the lookup mirror's lower tier (daemon/lookup_index.py): what the
                       disk holds is a hit too; stored()/removed() keep the mirror in step

The loop thread makes no filesystem call: files are written, read, unlinked
and scanned on the I/O threads. An entry leaves the disk index before its
file is queued for unlinking (a crash in between leaves a file the next scan
indexes or drops again). Making room drops at most ``FIT_BATCH`` entries per
loop turn: a large excess (a start after a ``disk_size`` cut) is dropped in
slices, the loop answering requests between them.

"""

from __future__ import annotations

import logging
import time
from collections import Counter
from itertools import islice

from ..pool.keys import owner_of, split_key
from .format import MAX_NS_KEY, file_bytes
from .index import DiskEntry, DiskFlush, DiskIndex
from .io import DiskIO
from .loads import DiskLoads
from .schedule import ADOPT_BATCH, Adopted, WriteBacklog

log = logging.getLogger("kvtier.disk")
FIT_BATCH = 1024  # index entries dropped per loop turn: ~10 ms at the ~6-21 us each measured


class DiskBridge:
    def __init__(self, io: DiskIO, dindex: DiskIndex, index, timeout_s: float, queue_bytes: int,
                 crcs: dict | None = None, backlog_bytes: int | None = None, journal=None):
        self.io, self.dindex, self.index = io, dindex, index
        self.timeout_s, self.queue_bytes = timeout_s, queue_bytes
        self.crcs = crcs                # the daemon's checksum table, when checksums are on
        self.journal = journal          # warm restart: blocks read back are journaled like stores
        self.counters: Counter = Counter()
        self.queued = 0                 # write-behind bytes held in the pool
        self.backlog = WriteBacklog(backlog_bytes or queue_bytes * 4)  # committed, waiting for queue room
        self.writing: dict = {}         # ns key -> {block key} being written (forgotten when none are)
        # ns key -> flushes while it had reads or writes in flight (a result finishing after one is
        # dropped); forgotten with its last job, so cycling namespaces leaves nothing behind.
        self.generation: Counter = Counter()
        self.in_flight: Counter = Counter()  # ns key -> blocks being written or read
        self.loads = DiskLoads(self)    # loads waiting for disk reads (loads.py)
        self.load, self.cancel, self.waiting = self.loads.load, self.loads.cancel, self.loads.waiting
        self.scanning = True
        self.scan_started = time.monotonic()
        self.scan_s = 0.0
        self.fit_pending = False        # a ("fit", None) is queued: more entries to drop next turn
        self.adopted_blocks = Adopted()  # warm restart: kept blocks to check, a batch at a time
        self.requeue_pending = False    # a ("requeue", None) is queued: the next batch next turn
        io.scan()

    @property
    def wakeup_fd(self) -> int:
        return self.io.wakeup_fd

    # ---- lookups (BlockIndex's lower tier) ------------------------------------------------
    def extend(self, ns, keys: list, hits: int) -> int:
        on_disk = self.dindex.entries_of(ns.key)
        if on_disk is None:
            return hits
        ready, n, touch = self.index.ready_entry, hits, self.dindex.touch
        for k in islice(keys, hits, None):
            e = on_disk.get(k)
            if e is not None:
                touch(e)  # a disk hit is a use: the disk drops least recently used files first
            elif ready(ns, k) is None:
                break
            n += 1
        return n  # the index counts the disk hits

    def flushed(self, ns) -> None:
        self.flush_keys(None if ns is None else [ns.key])

    def flush_keys(self, keys: list[str] | None) -> DiskFlush:
        """Drop these namespaces' blocks (None: all), also those with no bucket in RAM (found
        by the scan after a restart). Hidden now, in O(namespaces): no lookup, load or mirror
        reader sees any of them from here on; their files go ``drain`` slices later (a flush of
        10^6 files in one turn held the loop). A write or read of them that finishes later is
        dropped too (its generation is stale)."""
        for k in list(self.in_flight) if keys is None else keys:
            if self.in_flight[k]:
                self.generation[k] += 1
        for k in self.backlog.namespaces() if keys is None else keys:
            self.backlog.forget(k)  # flushed from every tier: not written, by policy
        self.adopted_blocks.forget(None if keys is None else set(keys))  # the same for adopted ones
        job = self.dindex.hide(keys)
        for ns_key, _ in job.parts:  # the mirror holds RAM and disk: a flush empties both at once
            self.index.lower_cleared(ns_key)
        return job

    @property
    def draining(self) -> bool:
        """Flushed files are left to drop (``drain``)."""
        return bool(self.dindex.flushes)

    @property
    def tidying(self) -> bool:
        """The index's age heap is due a rebuild, or one is under way (``tidy``)."""
        return self.dindex.tidying

    def tidy(self, n: int) -> None:
        """One slice of that rebuild: at most ``n`` heap items (``DiskIndex.tidy``)."""
        self.dindex.tidy(n)

    def drain(self, n: int) -> None:
        """One slice of a flush: at most ``n`` hidden entries leave the index, their files are
        queued for unlinking (the I/O threads) and announced ``disk_removed``; a flush's reply
        counts those the RAM pool did not hold."""
        freed = self.dindex.drain(n)
        holds = self.index.holds
        for job, v in freed:
            if not holds(v.ns_key, v.key):
                job.only_on_disk += 1
        self._unlink([v for _, v in freed])

    def namespace_keys(self) -> list[str]:
        """Namespaces with blocks on disk (tenant SEP fingerprint), in RAM or not."""
        return self.dindex.namespace_keys()

    # ---- write-behind ------------------------------------------------------------------------
    def committed(self, plan) -> None:
        ns = plan.ns
        key = ns.key
        on_disk = self.dindex.entries_of(key) or ()
        writing = self.writing.get(key, ())
        is_ready = self.index.is_ready
        keys = [e.key for e in plan.entries if e is not None and is_ready(e)
                and e.key not in on_disk and e.key not in writing]
        if keys and self._enqueue(ns, keys):
            self._feed()  # in memory (pins, a queued job): under 1% of a store's samples (docs/DISK_TIER.md)

    def _enqueue(self, ns, keys: list) -> bool:
        """``keys`` of ``ns`` (committed, not on disk) join their tenant's backlog; False when
        they never can (a namespace key too long for a header: counted)."""
        if len(ns.key.encode()) > MAX_NS_KEY:
            self.counters["write_skipped"] += len(keys)
            self.backlog.lost(owner_of(ns.key), "too_long", len(keys))
            return False
        self.backlog.add(owner_of(ns.key), ns, keys)
        return True

    def adopted(self, entries: list) -> None:
        """Warm restart (daemon/warm.py): the blocks the last daemon committed, oldest first.
        A SIGKILL leaves some of them unwritten (in its backlog, or its queue); those the disk
        lacks join the backlog a batch at a time once the start-up scan has said what the disk
        holds (before it, every kept block would look unwritten and be written again)."""
        self.counters["warm_adopted"] += self.adopted_blocks.add(entries)
        self._feed()

    def _pull_adopted(self) -> None:
        """``ADOPT_BATCH`` adopted blocks: each is on disk, re-queued, or counted ``evicted`` (it
        left RAM before its batch; a flush meanwhile took it out, by policy). The next batch comes
        when the backlog runs low again, at the latest next loop turn: a kept pool of millions is
        checked between requests, not in one turn."""
        for ns, keys in self.adopted_blocks.pull(ADOPT_BATCH):
            on_disk = self.dindex.entries_of(ns.key) or {}
            missing = [k for k in keys if k not in on_disk]
            ready = [k for k in missing if self.index.ready_entry(ns, k) is not None]
            self.counters["warm_on_disk"] += len(keys) - len(missing)
            self.backlog.lost(owner_of(ns.key), "evicted", len(missing) - len(ready))
            if ready and self._enqueue(ns, ready):
                self.counters["warm_requeued"] += len(ready)
        if self.adopted_blocks.left and self.backlog.blocks < ADOPT_BATCH and not self.requeue_pending:
            self.requeue_pending = True
            self.io.remind("requeue")

    def _feed(self) -> None:
        """Move backlog turns into the write-behind queue while it has room. A block is
        written from the pool if it is still there (pinned from here until written)."""
        if self.adopted_blocks.left and not self.scanning and self.backlog.blocks < ADOPT_BATCH:
            self._pull_adopted()
        self.io.hurry(self.backlog.urgent(self.io.urgent))
        while True:
            turn = self.backlog.take(self.queue_bytes - self.queued)
            if turn is None:
                return
            tenant, ns, keys = turn
            key, size = ns.key, ns.block_bytes
            on_disk = self.dindex.entries_of(key) or ()
            writing = self.writing.get(key, ())
            ready = self.index.ready_entries(ns, keys)
            self.backlog.lost(tenant, "evicted", len(keys) - len(ready))  # (or flushed) before its turn
            entries = [e for e in ready if e.key not in on_disk and e.key not in writing]
            if not entries:
                continue
            n = len(entries)
            victims = self.dindex.reserve(n * file_bytes(size), FIT_BATCH, tenant)
            if victims is None:  # more than the tenant's share of disk_size (or all of it)
                self.counters["write_skipped"] += n
                self.backlog.lost(tenant, "over_share", n)
                continue
            self.removed(victims)
            dirs = self.emptied({v.ns_key for v in victims} - {key})  # not the one this job writes into
            self.io.unlink([v.path for v in victims if v.size != size], dirs)
            self._fit_later()
            self.index.pin(entries)
            self.queued += n * size
            self.writing.setdefault(key, set()).update(e.key for e in entries)
            items = [(key, e.key, seq, e.offset) for e, seq in zip(entries, self.io.next_seqs(n))]
            self.in_flight[key] += n
            # the files of this size evicted for it are overwritten by it (DiskIO.write)
            self.io.write(items, size, ("write", entries, self.generation[key]),
                          [v.path for v in victims if v.size == size], dirs)

    def _written(self, job) -> None:
        entries, gen = job.token[1], job.token[2]
        size = job.size
        key = job.items[0][0]
        self.index.unpin(entries)
        self.queued -= len(entries) * size
        writing = self.writing[key]
        writing.difference_update(e.key for e in entries)
        if not writing:
            del self.writing[key]
        self.dindex.release(len(entries) * file_bytes(size), owner_of(key))
        stale = gen != self.generation[key]  # flushed while being written
        self.landed(key, len(entries))
        items = job.items
        files = [DiskEntry(key, items[i][1], items[i][2], size, crc, path) for i, crc, path in job.ok]
        if stale:
            unannounced = [v.path for v in files]
        else:  # one job's files at once; room: below, in one slice
            dropped = self.dindex.add_written(key, files)
            unannounced = [v.path for v in dropped]  # one of two copies of a block that stays on disk: no event
            twice = {v.key for v in dropped}
            self.stored(key, [v.key for v in files if v.key not in twice])
        self.counters["write_failed"] += len(job.failed)
        self.backlog.lost(owner_of(key), "failed", len(job.failed))
        self.io.unlink(unannounced, self.emptied([key]))
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
        self.removed(victims)
        self.io.unlink([v.path for v in victims], self.emptied({v.ns_key for v in victims}))

    # ---- what the disk holds changed: block events and the lookup mirror ----------------------
    def stored(self, ns_key: str, keys: list) -> None:
        self.index.lower_stored(ns_key, keys)

    def removed(self, entries: list) -> None:
        """Entries that left the disk index: announced, and out of the mirror unless ready in RAM
        (or on disk again: a flushed entry freed after the block was written anew)."""
        by_ns: dict = {}
        for v in entries:
            if v.key not in (self.dindex.entries_of(v.ns_key) or ()):
                by_ns.setdefault(v.ns_key, []).append(v.key)
        for ns_key, keys in by_ns.items():
            self.index.lower_removed(ns_key, keys)

    def keys_of(self, ns_key: str) -> list:
        """The namespace's blocks on disk (a new mirror starts with them)."""
        return list(self.dindex.entries_of(ns_key) or ())

    def on_disk(self, ns_key: str, key: bytes) -> bool:
        return key in (self.dindex.entries_of(ns_key) or ())

    def keys_on_disk(self, ns_key: str):
        """The namespace's blocks on disk, to test many keys against (read-only; () if none)."""
        return self.dindex.entries_of(ns_key) or ()

    def emptied(self, ns_keys) -> list[str]:
        """Namespaces with nothing left on disk and nothing in flight: their directories go
        once the unlinks queued with them are done (cycling namespaces leaves no directory)."""
        return [k for k in ns_keys if not self.dindex.has_namespace(k) and not self.in_flight[k]
                and not self.dindex.hiding(k)]

    def landed(self, key: str, n: int) -> None:
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
        return sorted(filter(self.dindex.has_namespace, ns_keys), key=self.dindex.ns_newest.__getitem__)

    # ---- completions -------------------------------------------------------------------------
    def poll(self) -> None:
        for what, job in self.io.completed():
            if what == "scan":
                self._found(job)
            elif what == "fit":
                self._fit()
            elif what == "requeue":
                self.requeue_pending = False
                self._feed()
            elif what == "scanned":
                self.scanning = False
                self.scan_s = time.monotonic() - self.scan_started
                self._fit()
                log.info("disk tier: %d blocks (%d bytes) found in %s in %.2fs", len(self.dindex),
                         self.dindex.used, self.io.root, self.scan_s)
                self._feed()  # adopted blocks the disk lacks: their batches start now
            elif job.kind == "write":
                self._written(job)
            elif what == "expired":  # the loads waiting for it go on without its blocks
                self.loads.expired(job)
            else:
                self.loads.read(job)

    def _found(self, entries: list) -> None:
        """A batch of the start-up scan: indexed (lookups count them now) and announced."""
        extra, added = [], {}
        for entry in entries:
            if entry.key in self.writing.get(entry.ns_key, ()):  # rewritten now: the new file wins
                extra.append(entry)
                continue
            replaced = self.dindex.add(entry, found=True)  # fitted to disk_size once all are found
            if replaced:  # two files of one block: the older goes, the block stays (announced once)
                extra += replaced
            else:
                added.setdefault(entry.ns_key, []).append(entry.key)
        for ns_key, keys in added.items():
            self.stored(ns_key, keys)
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
        keys = ("written", "written_bytes", "written_direct", "read", "read_bytes", "read_direct", "rejected", "missing", "enospc", "eio",
                "read_errors", "errors", "read_expired", "read_late", "unlinked", "recycled", "scanned",
                "scan_rejected")
        out = {"enabled": True, "path": self.io.root, "o_direct": self.io.direct, "writer": self.io.writer_state(),
               "capacity_bytes": self.dindex.capacity,
               "used_bytes": self.dindex.used, "reserved_bytes": self.dindex.reserved,
               "blocks": len(self.dindex), "dropped": self.dindex.dropped, "queued_bytes": self.queued,
               # the age heap's items, stale ones included (rebuilt a slice per turn past 2x blocks)
               "heap_items": self.dindex.heap_items, "heap_rebuilding": self.dindex.tidying,
               "queue_bytes": self.queue_bytes, "scanning": self.scanning, "fitting": self.fit_pending,
               "scan_s": round(self.scan_s, 3),
               "loads_waiting": len(self.loads.by_request), "reads_in_flight": len(self.loads.waiting_for), "namespaces": rows,
               "backlog_blocks": self.backlog.blocks if tenant is None else self.backlog.of(tenant),
               "warm_waiting": self.adopted_blocks.left,
               "backlog_limit_bytes": self.backlog.limit_bytes, "not_written": self.backlog.not_written(tenant),
               **{k: io.get(k, 0) for k in keys}, **{k: self.counters[k] for k in (
                   "write_skipped", "write_failed", "loaded", "load_failed", "fail_fast",
                   "timed_out", "no_room", "late", "namespaces_dropped",
                   "warm_adopted", "warm_on_disk", "warm_requeued")},
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
