"""Eviction policies: which ready prefix-cache entry to drop next.

A policy only orders entries; the index decides which candidates are actually
evictable (unpinned, not being written). Swap entries never enter a policy.

Primitives: ``insert(entry)``, ``touch(entry)``, ``touch_chain(entries)``
and ``insert_chain(entries)`` (head first; the head ends most recent), ``remove(entry)``, ``candidates()``
(oldest first), ``__len__``.
"""

from __future__ import annotations

from itertools import compress, repeat
from typing import Hashable, Iterator, Protocol

COMPACT_MIN = 1 << 16  # stale log slots tolerated before a compaction, at the least


class EvictionPolicy(Protocol):
    def insert(self, entry: Hashable) -> None: ...
    def touch(self, entry: Hashable) -> None: ...
    def touch_chain(self, entries: list) -> None: ...
    def insert_chain(self, entries: list) -> None: ...
    def remove(self, entry: Hashable) -> None: ...
    def candidates(self) -> Iterator[Hashable]: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first, by epoch stamps.

    Every insert or touch appends the entry to a log and stamps it with its
    log position; an older log slot whose entry carries a newer stamp is
    stale and skipped. A chain refresh is then two C-level calls (log
    extend, stamp update) instead of a Python step per entry, and the log is
    compacted (also in C) once stale slots outnumber live ones 3 to 1.

    Callers touch a hash chain so its head ends most recent: under pressure
    suffixes go before the prefix heads that make them reachable (a chain
    without its head is useless).
    """

    def __init__(self) -> None:
        self._stamp: dict[Hashable, int] = {}   # entry -> its live log position (absolute)
        self._log: list = []                     # entries by stamp, from position self._base
        self._base = 0
        self._head = 0                           # log slots before this one are all stale

    def insert(self, entry: Hashable) -> None:
        self._stamp[entry] = self._base + len(self._log)
        self._log.append(entry)
        self._maybe_compact()

    def touch(self, entry: Hashable) -> None:
        if entry in self._stamp:
            self.insert(entry)

    def touch_chain(self, entries: list) -> None:
        """Refresh ``entries`` (all members; a chain head first): the head ends
        most recent, the tail least recent of them."""
        self.insert_chain(entries)

    def insert_chain(self, entries: list) -> None:
        """Insert or refresh ``entries``, a chain head first: the head ends most recent."""
        if not entries:
            return
        order = entries[::-1]
        start = self._base + len(self._log)
        self._log.extend(order)
        self._stamp.update(zip(order, range(start, start + len(order))))
        self._maybe_compact()

    def remove(self, entry: Hashable) -> None:
        self._stamp.pop(entry, None)

    def candidates(self) -> Iterator[Hashable]:
        # Lazy: callers must stop iterating before they remove or touch anything.
        stamp, base, log = self._stamp, self._base, self._log
        head = self._head
        while head < len(log) and stamp.get(log[head]) != base + head:
            head += 1  # each stale slot is skipped here once, not once per eviction
        self._head = head
        for i in range(head, len(log)):
            e = log[i]
            if stamp.get(e) == base + i:
                yield e

    def __len__(self) -> int:
        return len(self._stamp)

    def _maybe_compact(self) -> None:
        if len(self._log) > 4 * len(self._stamp) + COMPACT_MIN:
            self.compact()

    def compact(self) -> None:
        """Drop stale log slots and restamp the live ones, order kept."""
        base, log = self._base, self._log
        live = list(compress(log, map(int.__eq__, map(self._stamp.get, log, repeat(-1)),
                                      range(base, base + len(log)))))
        self._base = base + len(log)
        self._log, self._head = live, 0
        self._stamp = dict(zip(live, range(self._base, self._base + len(live))))


class FIFOPolicy(LRUPolicy):
    """Insertion order; lookups do not refresh. Useful as a baseline."""

    def touch(self, entry: Hashable) -> None:
        pass

    def touch_chain(self, entries: list) -> None:
        pass  # insert_chain (new entries) still orders them


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}
