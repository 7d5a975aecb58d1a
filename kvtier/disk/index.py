"""What the disk tier holds, in memory (sans-IO, the daemon's loop thread only).

Lookups never touch the disk: they ask this index. An entry is added once
its file is complete (renamed into place) and removed before its file is
unlinked. Space is reserved when a write is queued, so ``used + reserved``
never exceeds ``capacity``: making room drops the least recently used
entries (written, loaded back, or counted by a lookup's disk hit) and
returns them for the caller to unlink. The verbs that make room take a ``limit``: the caller (the
loop thread) drops a large excess (a start after a ``disk_size`` cut) in
slices between requests, so ``used + reserved`` may exceed ``capacity`` for
a few loop turns while ``over`` is true.

Recency order is a heap with lazy deletion, not a list kept sorted: files
found by the start-up scan arrive in directory order, and a million of them
must not be sorted on the loop thread. An entry's ``age`` is its heap key,
first its file's ``seq`` (time-based: earlier daemons' files are older), or
past every other age when written; a use (``touch``: a load read it back,
a lookup counted it) only sets ``used`` to the next tick, an attribute
write a lookup can afford per block. The heap is reordered lazily: a popped
entry used since its key was set goes back in keyed by that use instead of
being dropped, so what is dropped is the least recently used. Items whose
entry was removed or re-keyed since are skipped when popped. When the heap
holds more stale items than live ones it is rebuilt, a slice at a time
(``tidy``, called by the loop between requests): with few live entries a
fresh heap of them is made at once and the old one freed a slice a call;
with many, the old heap's items are read from its end down and the live
ones pushed into a fresh heap, which takes every new item meanwhile, and the
least recently used entry is the older of the two heaps' tops. A rebuild in
one call was O(heap) in one loop turn: ~0.5 s for 10^6 items, which a flush
of 10^6 files leaves stale.

Primitives:
  DiskIndex(capacity, share=1.0, policy="lru")   share < 1: per tenant (shares.py), a write at it drops
                                           its own; policy: the pool's (fifo: uses do not count)
  entries_of(ns_key) -> {key: DiskEntry} | None    what a lookup or load reads
  reserve(nbytes, limit, tenant=None) -> [victims] | None  room for a write (None: it can never fit)
  release(nbytes, tenant=None)             a reserved write ended (added or failed)
  add(entry, found=False) -> [victims]     a complete file (found: by the scan, not fitted yet);
                                           an older copy of its key is a victim
  add_written(ns_key, entries) -> [not kept]  one write job's files at once (not fitted)
  shrink(limit=None) -> [victims]          fit within capacity, at most ``limit`` victims per call
  over -> bool                             more to drop before ``used + reserved`` fits
  remove(entry) -> bool, touch(entry)       touch: a use (O(1); the heap catches up when it pops it)
  pop_lru(heap) -> entry | None             the least recently used entry of a heap (shares.py too)
  drop(ns_keys=None) -> [victims]          every entry of those namespaces at once (None: all)
  hide(ns_keys=None) -> DiskFlush          a flush, phase one: those namespaces' entries vanish
                                           from every reader at once (O(namespaces))
  drain(n) -> [(DiskFlush, victim)]        phase two: free at most n hidden entries, oldest flush first
  tidy(n), tidying -> bool                  rebuild the age heap without its stale items, n at a time
  heap_items -> int                         its items, stale ones included
  by_namespace() -> {ns_key: (blocks, bytes)}, check_integrity(fitted=True)
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from ..pool import shardmap
from .format import file_bytes
from .shares import DiskShares

# The pool's ``policy`` decides the disk's order too: whether a use (a load, a lookup's
# disk hit) makes a file young again (lru) or files go in write order (fifo).
USES_COUNT = {"lru": True, "fifo": False}


class DiskEntry:
    __slots__ = ("ns_key", "key", "seq", "size", "crc", "path", "age", "used", "moved")

    def __init__(self, ns_key: str, key: bytes, seq: int, size: int, crc: int, path: str):
        self.ns_key, self.key, self.seq, self.size, self.crc, self.path = ns_key, key, seq, size, crc, path
        self.age = self.used = seq  # heap key; last use (> age: used since it was keyed)
        self.moved = 0              # the last heap rebuild that carried its item over

    @property
    def file_bytes(self) -> int:
        return file_bytes(self.size)  # whole pages, as the filesystem allocates


class DiskFlush:
    """One flush's hidden namespace maps (``DiskIndex.hide``), freed by ``drain``."""

    def __init__(self, parts: list) -> None:
        self.parts = parts                            # [(ns key, {key: DiskEntry})], freed from the last
        self.hidden = sum(len(h) for _, h in parts)   # entries hidden at its start
        self.only_on_disk = 0                         # freed entries the RAM pool did not hold (the caller counts)

    @property
    def done(self) -> bool:
        return not self.parts


class DiskIndex:
    slack = 64  # stale heap items tolerated beyond the live ones before a rebuild is due
    direct_max = 4096  # at most this many live entries: a rebuild makes their heap at once (~2 ms)

    def __init__(self, capacity: int, share: float = 1.0, policy: str = "lru"):
        if policy not in USES_COUNT:
            raise ValueError(f"disk order follows policy: {policy!r} is not one of {sorted(USES_COUNT)}")
        self.capacity = capacity
        self._uses_count = USES_COUNT[policy]
        self.shares = DiskShares(capacity, share)
        self.used = 0          # bytes of indexed files (headers included, rounded to pages)
        self.reserved = 0      # bytes of writes queued or running
        self.namespaces: dict[str, dict[bytes, DiskEntry]] = {}
        self.ns_bytes: Counter = Counter()  # payload bytes per namespace (stats read it every 0.5 s)
        self.ns_newest: dict[str, int] = {}  # ns key -> its newest entry's age (which namespace is oldest)
        self.count = 0
        self.dropped = 0       # entries dropped to make room (the disk's evictions)
        self._heap: list = []  # (age, n, entry), stale items included
        self._old: list = []   # a rebuild's heap still to go through (``tidy``); empty: none
        self._scan = -1        # the next index of ``_old`` to look at (downwards)
        self._rebuilds = 0     # rebuilds begun (``DiskEntry.moved``: carried over by which)
        self._dead: list = []  # heaps a rebuild replaced at once: lists to free a slice at a time
        # Flushes in progress: their maps are out of ``namespaces`` (no reader sees them) while
        # their entries still count in ``count``/``used`` (the files exist until unlinked).
        self.flushes: list[DiskFlush] = []
        self.hidden = 0        # entries in those maps
        self._n = itertools.count()
        self._newest = 0

    def entries_of(self, ns_key: str) -> dict | None:
        return self.namespaces.get(ns_key)

    def has_namespace(self, ns_key: str) -> bool:
        return ns_key in self.namespaces

    def namespace_keys(self) -> list[str]:
        return list(self.namespaces)

    def __len__(self) -> int:
        """Entries a reader can see (a flush's hidden ones not included)."""
        return self.count - self.hidden

    def hiding(self, ns_key: str) -> bool:
        """A flush still has entries of ``ns_key`` to free (its directory is not empty yet)."""
        return any(k == ns_key for f in self.flushes for k, _ in f.parts)

    # ---- space -----------------------------------------------------------------------
    @property
    def over(self) -> bool:
        return self.used + self.reserved > self.capacity and self.count > 0

    def reserve(self, nbytes: int, limit: int | None = None, tenant: str | None = None) -> list[DiskEntry] | None:
        if nbytes > self.capacity - self.reserved:
            return None
        own = self.shares.make_room(self, tenant, nbytes) if tenant is not None else []
        if own is None:  # more than the tenant's whole share
            return None
        self.dropped += len(own)
        self.reserved += nbytes
        if tenant is not None:
            self.shares.reserved(tenant, nbytes)
        return own + self.shrink(limit)

    def release(self, nbytes: int, tenant: str | None = None) -> None:
        self.reserved -= nbytes
        if tenant is not None:
            self.shares.reserved(tenant, -nbytes)

    def shrink(self, limit: int | None = None) -> list[DiskEntry]:
        """Victims, oldest first, that bring ``used + reserved`` within capacity
        (at most ``limit`` of them: ``over`` says whether more must go)."""
        victims = []
        while self.used + self.reserved > self.capacity and self.count and (limit is None or len(victims) < limit):
            entry = self.pop_lru(self._heap, self._old)
            if entry is not None and self.remove(entry):
                victims.append(entry)
        self.dropped += len(victims)
        return victims

    # ---- entries ----------------------------------------------------------------------
    def add(self, entry: DiskEntry, found: bool = False, limit: int | None = None) -> list[DiskEntry]:
        """Index a complete file. Of two copies of one block the newer stays; the
        other is returned for unlinking (a write racing the start-up scan).
        ``found``: by the start-up scan, aged by its seq and not fitted yet (``shrink``)."""
        old = self.namespaces.get(entry.ns_key, {}).get(entry.key)
        if old is not None:
            if old.path == entry.path:  # the scan found a file this daemon had indexed already
                return []
            if old.seq >= entry.seq:
                return [entry]
            self.remove(old)  # may forget the namespace's map: taken again below
        entries = self.namespaces.get(entry.ns_key)
        if entries is None:
            entries = self.namespaces[entry.ns_key] = {}
        entries[entry.key] = entry
        self.namespaces[entry.ns_key] = shardmap.grown(entries)  # in shards: no insert rebuilds it all
        self.ns_bytes[entry.ns_key] += entry.size
        self.count += 1
        self.used += entry.file_bytes
        self.shares.added(entry)
        if found:
            self._push(entry, entry.seq)
            return [old] if old is not None else []
        self._push(entry, max(self._newest + 1, entry.seq))
        return ([old] if old is not None else []) + self.shrink(limit)

    def add_written(self, ns_key: str, entries: list[DiskEntry]) -> list[DiskEntry]:
        """``add`` for one write job's files (one namespace, one size, written by this daemon:
        newer than any other), the bookkeeping once per job rather than per file (the write
        completions were most of what a disk tier cost the loop). Not fitted: the caller drops
        what exceeds capacity a slice at a time (``shrink``). Returns the copies not kept."""
        m = self.namespaces.get(ns_key)
        if m is None:
            m = self.namespaces[ns_key] = {}
        heap, push, count, pushed = self._heap, heapq.heappush, self._n, self.shares.pushed
        out, fresh, newest = [], 0, self._newest
        for entry in entries:
            if entry.key in m:  # another copy (a rewrite racing the scan): the general path decides
                self._newest = newest
                out += self.add(entry, limit=0)
                newest = self._newest
                m = self.namespaces[ns_key]  # (a removal of the last entry may have made it anew)
                continue
            m[entry.key] = entry
            newest = max(newest + 1, entry.seq)
            entry.age = entry.used = newest
            item = (newest, next(count), entry)
            push(heap, item)
            pushed(entry, item)
            fresh += 1
        self._newest = newest
        if fresh:
            size = entries[0].size
            self.namespaces[ns_key] = shardmap.grown(m)
            self.ns_bytes[ns_key] += fresh * size
            self.count += fresh
            self.used += fresh * file_bytes(size)
            self.shares.added_bytes(ns_key, fresh * file_bytes(size))
            if newest > self.ns_newest.get(ns_key, -1):
                self.ns_newest[ns_key] = newest
        return out

    def remove(self, entry: DiskEntry) -> bool:
        entries = self.namespaces.get(entry.ns_key)
        if entries is None or entries.get(entry.key) is not entry:
            # Not visible: hidden by a flush (making room may take it first), or already gone
            # (dropped for room, flushed, replaced).
            return self._unhide(entry)
        del entries[entry.key]
        if not entries:
            del self.namespaces[entry.ns_key]
            del self.ns_newest[entry.ns_key]
        self.ns_bytes[entry.ns_key] -= entry.size
        if not self.ns_bytes[entry.ns_key]:
            del self.ns_bytes[entry.ns_key]
        self._forget(entry)
        return True

    def _unhide(self, entry: DiskEntry) -> bool:
        if entry.age < 0 or not self.hidden:
            return False
        for f in self.flushes:
            for k, hidden in f.parts:
                if k == entry.ns_key and hidden.get(entry.key) is entry:
                    del hidden[entry.key]
                    if not hidden:  # that part is done: ``hiding`` says so now, and its directory may go
                        f.parts = [p for p in f.parts if p[1] is not hidden]
                        if f.done:
                            self.flushes.remove(f)
                    self.hidden -= 1
                    self._forget(entry)
                    return True
        return False

    def _forget(self, entry: DiskEntry) -> None:
        """Space and order bookkeeping of an entry leaving the index (visible or hidden)."""
        self.count -= 1
        self.used -= entry.file_bytes
        self.shares.removed(entry)
        entry.age = -1  # its heap item is stale now

    def touch(self, entry: DiskEntry) -> None:
        """A use: O(1) (a lookup touches every disk block it counts); the heap catches up in pop_lru.
        Under ``fifo`` nothing: files go in write order, as RAM's entries go in insert order."""
        if entry.age >= 0 and self._uses_count:
            self._newest += 1
            entry.used = self._newest
            self._aged(entry)

    def pop_lru(self, heap: list, old: list | None = None) -> DiskEntry | None:
        """Pop the least recently used live entry of ``heap`` and ``old``, the heap a rebuild is
        emptying (None: nothing live left). An entry used since it was keyed goes back keyed by
        that use (``_push``: into every heap)."""
        while heap or old:
            # Items are (age, n, entry) with n unique: tuples compare on age, then n.
            src = old if old and (not heap or old[0] < heap[0]) else heap
            age, _, entry = heapq.heappop(src)
            if entry.age != age:
                continue  # removed, or re-keyed since: a newer item stands for it
            if entry.used > age:
                self._push(entry, entry.used)
                continue
            return entry
        return None

    def drop(self, ns_keys=None) -> list[DiskEntry]:
        """Every entry of these namespaces, at once (O(entries)): the daemon flushes with hide/drain."""
        job = self.hide(ns_keys)
        victims = self._free(job, job.hidden)
        if job in self.flushes:
            self.flushes.remove(job)
        return victims

    def hide(self, ns_keys=None) -> DiskFlush:
        """A flush, phase one: the namespaces' maps leave ``namespaces`` (an O(1) move each), so
        no lookup, load, mirror or write-behind check sees any of their entries from now on and
        no chain is ever seen half removed; a write landing later starts a fresh map."""
        keys = list(self.namespaces) if ns_keys is None else [k for k in dict.fromkeys(ns_keys) if k in self.namespaces]
        parts = []
        for k in keys:
            parts.append((k, self.namespaces.pop(k)))
            del self.ns_newest[k]
            del self.ns_bytes[k]
        job = DiskFlush(parts)
        self.hidden += job.hidden
        if parts:
            self.flushes.append(job)
        return job

    def drain(self, n: int) -> list[tuple[DiskFlush, DiskEntry]]:
        """Phase two: free at most ``n`` hidden entries (oldest flush first, ``popitem``: no
        snapshot of a million entries); the caller unlinks their files."""
        out = []
        while self.flushes and n > len(out):
            job = self.flushes[0]
            out += [(job, e) for e in self._free(job, n - len(out))]
            if job.done:
                self.flushes.pop(0)
        return out

    def _free(self, job: DiskFlush, n: int) -> list[DiskEntry]:
        """At most ``n`` of ``job``'s hidden entries leave the index (newest part first)."""
        out = []
        while job.parts and n > len(out):
            _, hidden = job.parts[-1]
            for _ in range(min(n - len(out), len(hidden))):
                e = hidden.popitem()[1]
                self.hidden -= 1
                self._forget(e)
                out.append(e)
            if not hidden:
                job.parts.pop()
        return out

    def _push(self, entry: DiskEntry, age: int) -> None:
        entry.age = entry.used = age
        self._newest = max(self._newest, age)
        self._aged(entry)
        item = (age, next(self._n), entry)
        heapq.heappush(self._heap, item)
        self.shares.pushed(entry, item)

    def _aged(self, entry: DiskEntry) -> None:
        """The namespace's newest age, for a visible entry only (a flush's hidden entries
        may still be used or re-keyed; their namespace is gone from the order)."""
        if self.hidden and self.namespaces.get(entry.ns_key, {}).get(entry.key) is not entry:
            return
        if entry.used > self.ns_newest.get(entry.ns_key, -1):
            self.ns_newest[entry.ns_key] = entry.used

    # ---- the age heap's stale items ------------------------------------------------------
    @property
    def tidying(self) -> bool:
        """A rebuild of the age heap is due or under way: the loop should call ``tidy``."""
        return bool(self._old) or bool(self._dead) or self._stale()

    @property
    def heap_items(self) -> int:
        """Items of the age heap, stale ones included (a rebuild's old heap too)."""
        return len(self._heap) + len(self._old)

    def _stale(self) -> bool:
        # More stale items than live ones: at least half the items go. Not while a flush drains
        # (its hidden entries are still live: copied, they would be stale a moment later).
        return len(self._heap) > 2 * self.count + self.slack and not self.flushes

    def tidy(self, n: int) -> None:
        """One slice of a rebuild, started here when one is due; at most ``n`` items a call.
        Few live entries (a flush of nearly all): a fresh heap of them at once, the old one
        freed a slice a call. Else the old heap stays the one ``pop_lru`` also pops from while
        its items are looked at from its end down and the live ones pushed into the fresh heap,
        which takes every new item meanwhile; then it is freed a slice a call."""
        if self._dead:  # nothing in it is live: freed from its end, in no order
            dead = self._dead[-1]
            del dead[-n:]
            if not dead:
                self._dead.pop()
            return
        if not self._old:
            if not self._stale():
                return
            if self.count <= self.direct_max:
                # O(live) now: walking a heap of 10^6 stale items for 2,048 live ones took ~0.3 s.
                fresh = [(e.age, next(self._n), e) for v in self.namespaces.values() for e in v.values()]
                heapq.heapify(fresh)
                self._dead = [self._heap, *self.shares.rebuilt(fresh)]
                self._heap = fresh
                return
            self._old, self._heap = self._heap, []  # O(1): the fresh heap takes new items now
            self._scan = len(self._old) - 1
            self._rebuilds += 1
            self.shares.begin_rebuild()
        # Between two calls pop_lru only pops from the old heap, and a pop moves no item to a
        # higher index than it had but the old heap's last one (to the root, then down): looked
        # at from the end down, no live item is missed. One moved up past the scan may be seen
        # twice: ``moved`` says it was carried over already.
        old, heap, push, moved, rebuild = self._old, self._heap, heapq.heappush, self.shares.moved, self._rebuilds
        top = min(self._scan, len(old) - 1)
        stop = max(top - n, -1)
        for j in range(top, stop, -1):
            item = old[j]
            e = item[2]
            if e.age == item[0] and e.moved != rebuild:
                e.moved = rebuild
                push(heap, item)
                moved(item)
        self._scan = stop
        if stop < 0:  # every live item is in the fresh heaps: the old ones are garbage now
            self._dead = [old, *self.shares.end_rebuild()]
            self._old = []

    # ---- accounting ------------------------------------------------------------------
    def by_namespace(self) -> dict[str, tuple[int, int]]:
        return {k: (len(v), self.ns_bytes[k]) for k, v in self.namespaces.items()}

    def check_integrity(self, fitted: bool = True) -> None:
        flat = [e for v in self.namespaces.values() for e in v.values()]
        hidden = [e for f in self.flushes for _, h in f.parts for e in h.values()]
        flat_bytes = {k: sum(e.size for e in v.values()) for k, v in self.namespaces.items()}
        live = [item[2] for h in (self._heap, self._old) for item in h if item[2].age == item[0]]
        if self._old:  # while a rebuild runs, a live item carried over is in both heaps
            live = list({id(e): e for e in live}.values())
        problems = []
        if len(hidden) != self.hidden or any(f.done for f in self.flushes):
            problems.append(f"hidden {self.hidden} != {len(hidden)} entries in flushes' maps")
        flat += hidden
        if len(flat) != self.count or sorted(map(id, live)) != sorted(map(id, flat)):
            problems.append("namespace maps and age heap disagree")
        if sum(e.file_bytes for e in flat) != self.used:
            problems.append(f"used {self.used} != sum of entries")
        if flat_bytes != dict(self.ns_bytes):
            problems.append("per-namespace bytes are wrong")
        if fitted and self.used + self.reserved > self.capacity:
            problems.append(f"used {self.used} + reserved {self.reserved} > capacity {self.capacity}")
        if any(not v for v in self.namespaces.values()):
            problems.append("empty namespace kept")
        if self.ns_newest.keys() != self.namespaces.keys():
            problems.append("namespace ages kept for namespaces not on disk")
        problems += self.shares.problems(flat, rebuilding=bool(self._old))
        if problems:
            raise AssertionError(f"disk index: {problems}")
