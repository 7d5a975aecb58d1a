"""Per-tenant shares of ``disk_size`` (``tenant_share``), kept with the disk index.

Blocks go to disk as the RAM pool evicts them, so without a limit one tenant
storing without end fills ``disk_size`` with its own and drops every other
tenant's files. With ``share`` < 1, a tenant's files plus its writes in flight
may take at most ``share`` of ``disk_size``: a write that would pass it first
drops that tenant's own least recently used files (its own heap, lazily cleaned like
the index's), never another's; a write larger than the share is skipped.
Below its share a write makes room by the global age order as before. Files
found by the start-up scan count against their tenant but are not dropped
for its share (the global fit runs once all are found).

A namespace key is ``tenant SEP fingerprint`` (``pool.keys``).

Primitives (sans-IO; DiskIndex calls them):
  DiskShares(capacity, share)     .on, .limit
  added(entry) / removed(entry) / pushed(entry, item)
  begin_rebuild() / moved(item) / end_rebuild()   the index's heap rebuild, a slice at a time:
                                   the tenants' heaps are rebuilt with it
  rebuilt(items) -> [old heaps]    or at once, from the live entries' items
  make_room(index, tenant, nbytes) -> [victims] | None   before a reservation
  reserved(tenant, nbytes)         +/-: a write queued or ended
  usage() -> {tenant: bytes}, problems(entries) -> [str]
"""

from __future__ import annotations

import heapq
from collections import Counter

from ..pool.keys import owner_of


class DiskShares:
    def __init__(self, capacity: int, share: float = 1.0):
        if not 0 < share <= 1:
            raise ValueError("tenant share must be in (0, 1]")
        self.share, self.on = share, share < 1
        self.limit = int(capacity * share)
        self.used: Counter = Counter()      # tenant -> bytes of its indexed files (headers included)
        self.pending: Counter = Counter()   # tenant -> bytes of its writes queued or running
        self.own_dropped: Counter = Counter()
        self._heaps: dict[str, list] = {}   # tenant -> (age, n, entry), stale items included
        self._old: dict[str, list] = {}     # the heaps before the index's rebuild began (until it ends)

    def added(self, entry) -> None:
        self.used[owner_of(entry.ns_key)] += entry.file_bytes

    def added_bytes(self, ns_key: str, nbytes: int) -> None:
        """``added`` for files of one namespace together (``DiskIndex.add_written``)."""
        self.used[owner_of(ns_key)] += nbytes

    def removed(self, entry) -> None:
        t = owner_of(entry.ns_key)
        self.used[t] -= entry.file_bytes
        if not self.used[t]:
            del self.used[t]

    def pushed(self, entry, item) -> None:
        if self.on:
            heapq.heappush(self._heaps.setdefault(owner_of(entry.ns_key), []), item)

    def begin_rebuild(self) -> None:
        """The index's heap is rebuilt from its live items (``moved``): so are the tenants'.
        Until it ends, a tenant's oldest is the older of its old and fresh heaps' tops."""
        if self.on:
            self._old, self._heaps = self._heaps, {}

    def moved(self, item) -> None:
        """A live item the index's rebuild carried over (it is in the old tenant heap too:
        whichever copy is popped first, the other is stale by then or pops the same entry,
        which is not live any more)."""
        if self.on:
            heapq.heappush(self._heaps.setdefault(owner_of(item[2].ns_key), []), item)

    def rebuilt(self, items: list) -> list[list]:
        """The index made its heap anew from ``items`` (every live entry's): the tenants' heaps
        too. Returns the lists they replace, for the index to free a slice at a time."""
        if not self.on:
            return []
        old, self._heaps = list(self._heaps.values()), {}
        for item in items:
            self._heaps.setdefault(owner_of(item[2].ns_key), []).append(item)
        for h in self._heaps.values():
            heapq.heapify(h)
        return old

    def end_rebuild(self) -> list[list]:
        """Every live item is in the fresh heaps now (moved, or pushed since it began): the
        old heaps are returned for the index to free a slice at a time."""
        old, self._old = list(self._old.values()), {}
        return old

    def make_room(self, index, tenant: str, nbytes: int) -> list | None:
        """The tenant's own oldest entries to drop so ``nbytes`` more fit its share
        (removed from ``index`` already), or None: it cannot fit at all."""
        if not self.on:
            return []
        if nbytes > self.limit - self.pending[tenant]:
            return None
        victims = []
        # The heap is fetched each time: a re-keyed entry may have made the index compact (new lists).
        while self.used[tenant] + self.pending[tenant] + nbytes > self.limit and (
                self._heaps.get(tenant) or self._old.get(tenant)):
            # setdefault: an entry re-keyed while popping is pushed into this very list.
            entry = index.pop_lru(self._heaps.setdefault(tenant, []), self._old.get(tenant))
            if entry is not None and index.remove(entry):
                victims.append(entry)
        # All its files gone, pending + nbytes <= limit fits (checked above).
        if victims:
            self.own_dropped[tenant] += len(victims)
        return victims

    def reserved(self, tenant: str, nbytes: int) -> None:
        self.pending[tenant] += nbytes
        if not self.pending[tenant]:
            del self.pending[tenant]

    def usage(self) -> dict:
        return {t: b for t, b in self.used.items() if b}

    def problems(self, entries: list, rebuilding: bool = False) -> list[str]:
        truth: Counter = Counter()
        for e in entries:
            truth[owner_of(e.ns_key)] += e.file_bytes
        out = []
        if +truth != +self.used or any(b < 0 for b in self.used.values()):
            out.append(f"tenant bytes {dict(self.used)} != files {dict(truth)}")
        if any(b < 0 for b in self.pending.values()):
            out.append(f"negative tenant reservations {dict(self.pending)}")
        if self.on:
            heaps = [*self._heaps.values(), *self._old.values()]
            live = sorted(id(i[2]) for h in heaps for i in h if i[2].age == i[0])
            # While the index rebuilds, a live item may be in a tenant's old and fresh heaps both.
            if (sorted(set(live)) if rebuilding else live) != sorted(map(id, entries)):
                out.append("tenant age heaps disagree with the entries")
        return out
