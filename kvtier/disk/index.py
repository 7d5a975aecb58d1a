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
entry was removed or re-keyed since are skipped when popped, and the heap
is rebuilt when it holds more stale items than live ones.

Primitives:
  DiskIndex(capacity, share=1.0, policy="lru")   share < 1: per tenant (shares.py), a write at it drops
                                           its own; policy: the pool's (fifo: uses do not count)
  entries_of(ns_key) -> {key: DiskEntry} | None    what a lookup or load reads
  reserve(nbytes, limit, tenant=None) -> [victims] | None  room for a write (None: it can never fit)
  release(nbytes, tenant=None)             a reserved write ended (added or failed)
  add(entry, found=False) -> [victims]     a complete file (found: by the scan, not fitted yet);
                                           an older copy of its key is a victim
  shrink(limit=None) -> [victims]          fit within capacity, at most ``limit`` victims per call
  over -> bool                             more to drop before ``used + reserved`` fits
  remove(entry) -> bool, touch(entry)       touch: a use (O(1); the heap catches up when it pops it)
  pop_lru(heap) -> entry | None             the least recently used entry of a heap (shares.py too)
  drop(ns_keys=None) -> [victims]          every entry of those namespaces at once (None: all)
  hide(ns_keys=None) -> DiskFlush          a flush, phase one: those namespaces' entries vanish
                                           from every reader at once (O(namespaces))
  drain(n) -> [(DiskFlush, victim)]        phase two: free at most n hidden entries, oldest flush first
  by_namespace() -> {ns_key: (blocks, bytes)}, check_integrity(fitted=True)
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from .format import file_bytes
from .shares import DiskShares

# The pool's ``policy`` decides the disk's order too: whether a use (a load, a lookup's
# disk hit) makes a file young again (lru) or files go in write order (fifo).
USES_COUNT = {"lru": True, "fifo": False}


class DiskEntry:
    __slots__ = ("ns_key", "key", "seq", "size", "crc", "path", "age", "used")

    def __init__(self, ns_key: str, key: bytes, seq: int, size: int, crc: int, path: str):
        self.ns_key, self.key, self.seq, self.size, self.crc, self.path = ns_key, key, seq, size, crc, path
        self.age = self.used = seq  # heap key; last use (> age: used since it was keyed)

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
            entry = self.pop_lru(self._heap)
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
            if old.seq >= entry.seq:
                return [entry]
            self.remove(old)  # may forget the namespace's map: taken again below
        self.namespaces.setdefault(entry.ns_key, {})[entry.key] = entry
        self.ns_bytes[entry.ns_key] += entry.size
        self.count += 1
        self.used += entry.file_bytes
        self.shares.added(entry)
        if found:
            self._push(entry, entry.seq)
            return [old] if old is not None else []
        self._push(entry, max(self._newest + 1, entry.seq))
        return ([old] if old is not None else []) + self.shrink(limit)

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
        self._compact()

    def touch(self, entry: DiskEntry) -> None:
        """A use: O(1) (a lookup touches every disk block it counts); the heap catches up in pop_lru.
        Under ``fifo`` nothing: files go in write order, as RAM's entries go in insert order."""
        if entry.age >= 0 and self._uses_count:
            self._newest += 1
            entry.used = self._newest
            self._aged(entry)

    def pop_lru(self, heap: list) -> DiskEntry | None:
        """Pop ``heap``'s least recently used live entry (None: nothing live left). An entry
        used since it was keyed goes back keyed by that use (``_push``: into every heap)."""
        while heap:
            age, _, entry = heapq.heappop(heap)
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
        self._compact()

    def _aged(self, entry: DiskEntry) -> None:
        """The namespace's newest age, for a visible entry only (a flush's hidden entries
        may still be used or re-keyed; their namespace is gone from the order)."""
        if self.hidden and self.namespaces.get(entry.ns_key, {}).get(entry.key) is not entry:
            return
        if entry.used > self.ns_newest.get(entry.ns_key, -1):
            self.ns_newest[entry.ns_key] = entry.used

    def _compact(self) -> None:
        # Amortized O(1): at least half the items go. But a rebuild is O(heap) in one loop
        # turn (87 ms for 200k items here), and a flush draining makes half the heap stale
        # halfway through: not while one drains (its batches stay ~1.6 ms); the first call
        # after it rebuilds once (docs/DISK_TIER.md, "Not done").
        if len(self._heap) > 2 * self.count + 64 and not self.flushes:
            self._heap[:] = [item for item in self._heap if item[2].age == item[0]]  # in place: pop_lru holds it
            heapq.heapify(self._heap)
            self.shares.compact(self._heap)

    # ---- accounting ------------------------------------------------------------------
    def by_namespace(self) -> dict[str, tuple[int, int]]:
        return {k: (len(v), self.ns_bytes[k]) for k, v in self.namespaces.items()}

    def check_integrity(self, fitted: bool = True) -> None:
        flat = [e for v in self.namespaces.values() for e in v.values()]
        hidden = [e for f in self.flushes for _, h in f.parts for e in h.values()]
        flat_bytes = {k: sum(e.size for e in v.values()) for k, v in self.namespaces.items()}
        live = [item[2] for item in self._heap if item[2].age == item[0]]
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
        problems += self.shares.problems(flat)
        if problems:
            raise AssertionError(f"disk index: {problems}")
