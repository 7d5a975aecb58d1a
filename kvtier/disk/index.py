"""What the disk tier holds, in memory (sans-IO, the daemon's loop thread only).

Lookups never touch the disk: they ask this index. An entry is added once
its file is complete (renamed into place) and removed before its file is
unlinked. Space is reserved when a write is queued, so ``used + reserved``
never exceeds ``capacity``: making room drops the oldest entries (by write
order, refreshed when a block is loaded back) and returns them for the
caller to unlink.

Primitives:
  DiskIndex(capacity)
  entries_of(ns_key) -> {key: DiskEntry} | None    what a lookup or load reads
  reserve(nbytes) -> [victims] | None      room for a write (None: it can never fit)
  release(nbytes)                          a reserved write ended (added or failed)
  add(entry, shrink=True) -> [victims]     a complete file; an older copy of its key is a victim
  resort(), shrink() -> [victims]          after the start-up scan: age by write order, then fit
  remove(entry) -> bool, touch(entry)
  drop(ns_keys=None) -> [victims]          flush: every entry of those namespaces (None: all)
  by_namespace() -> {ns_key: (blocks, bytes)}, check_integrity()
"""

from __future__ import annotations

from collections import OrderedDict

from .format import HEADER_BYTES


class DiskEntry:
    __slots__ = ("ns_key", "key", "seq", "size", "crc", "path")

    def __init__(self, ns_key: str, key: bytes, seq: int, size: int, crc: int, path: str):
        self.ns_key, self.key, self.seq, self.size, self.crc, self.path = ns_key, key, seq, size, crc, path

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.size


class DiskIndex:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0          # bytes of indexed files (headers included)
        self.reserved = 0      # bytes of writes queued or running
        self.namespaces: dict[str, dict[bytes, DiskEntry]] = {}
        self._order: OrderedDict = OrderedDict()  # entry -> None, oldest first
        self.dropped = 0       # entries dropped to make room (the disk's evictions)

    def entries_of(self, ns_key: str) -> dict | None:
        return self.namespaces.get(ns_key)

    def __len__(self) -> int:
        return len(self._order)

    # ---- space -----------------------------------------------------------------------
    def reserve(self, nbytes: int) -> list[DiskEntry] | None:
        if nbytes > self.capacity - self.reserved:
            return None
        victims = []
        while self.used + self.reserved + nbytes > self.capacity and self._order:
            victims.append(self._pop_oldest())
        self.dropped += len(victims)
        self.reserved += nbytes
        return victims

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def shrink(self) -> list[DiskEntry]:
        """Victims that bring ``used`` within capacity (files found at start may exceed it)."""
        victims = []
        while self.used + self.reserved > self.capacity and self._order:
            victims.append(self._pop_oldest())
        self.dropped += len(victims)
        return victims

    # ---- entries ----------------------------------------------------------------------
    def add(self, entry: DiskEntry, shrink: bool = True) -> list[DiskEntry]:
        """Index a complete file. Of two copies of one block the newer stays; the
        other is returned for unlinking (a write racing the start-up scan).
        ``shrink=False``: files found at start, in no order yet (see ``resort``)."""
        old = self.namespaces.get(entry.ns_key, {}).get(entry.key)
        if old is not None:
            if old.seq >= entry.seq:
                return [entry]
            self.remove(old)  # may forget the namespace's map: taken again below
        self.namespaces.setdefault(entry.ns_key, {})[entry.key] = entry
        self._order[entry] = None
        self.used += entry.file_bytes
        return ([old] if old is not None else []) + (self.shrink() if shrink else [])

    def resort(self) -> None:
        """Age order = write order (``seq``), once the start-up scan found every file."""
        self._order = OrderedDict.fromkeys(sorted(self._order, key=lambda e: e.seq))

    def remove(self, entry: DiskEntry) -> bool:
        entries = self.namespaces.get(entry.ns_key)
        if entries is None or entries.get(entry.key) is not entry:
            return False  # already gone (dropped for room, flushed, replaced)
        del entries[entry.key]
        if not entries:
            del self.namespaces[entry.ns_key]
        del self._order[entry]
        self.used -= entry.file_bytes
        return True

    def touch(self, entry: DiskEntry) -> None:
        if entry in self._order:
            self._order.move_to_end(entry)

    def drop(self, ns_keys=None) -> list[DiskEntry]:
        keys = list(self.namespaces) if ns_keys is None else [k for k in ns_keys if k in self.namespaces]
        victims = [e for k in keys for e in list(self.namespaces[k].values())]
        for e in victims:
            self.remove(e)
        return victims

    def _pop_oldest(self) -> DiskEntry:
        entry = next(iter(self._order))
        self.remove(entry)
        return entry

    # ---- accounting ------------------------------------------------------------------
    def by_namespace(self) -> dict[str, tuple[int, int]]:
        return {k: (len(v), sum(e.size for e in v.values())) for k, v in self.namespaces.items()}

    def check_integrity(self, fitted: bool = True) -> None:
        flat = [e for v in self.namespaces.values() for e in v.values()]
        problems = []
        if len(flat) != len(self._order) or set(flat) != set(self._order):
            problems.append("namespace maps and age order disagree")
        if sum(e.file_bytes for e in flat) != self.used:
            problems.append(f"used {self.used} != sum of entries")
        if fitted and self.used + self.reserved > self.capacity:
            problems.append(f"used {self.used} + reserved {self.reserved} > capacity {self.capacity}")
        if any(not v for v in self.namespaces.values()):
            problems.append("empty namespace kept")
        if problems:
            raise AssertionError(f"disk index: {problems}")
