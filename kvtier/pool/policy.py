"""Eviction policies: which ready prefix-cache entry to drop next.

A policy only orders entries; the index decides which candidates are actually
evictable (unpinned, not being written). Swap entries never enter a policy.
``EvictionPolicy`` is the whole seam: the index (and its per-tenant split,
shares.SplitPolicy) calls these methods and nothing else, and nothing outside
kvtier/pool touches a policy. A second policy implements it, takes no
constructor arguments (the split makes one per tenant) and is named in
``POLICIES`` (config ``policy``); the index does not change.

Primitives: ``insert(entry)``, ``touch(entry)``, ``touch_chain(entries)``
and ``insert_chain(entries)`` (head first; the head ends most recent), ``remove(entry)``, ``candidates()``
(oldest first), ``__len__``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterator

import numpy as np

CACHE_MIN = 4096  # oldest entries cached per rebuild, at the least


class EvictionPolicy(ABC):
    """Orders READY entries for eviction; ``candidates()`` is lazy and callers stop
    iterating before they change anything. A subclass missing a method cannot be built."""

    @abstractmethod
    def insert(self, entry: Hashable) -> None: ...

    @abstractmethod
    def touch(self, entry: Hashable) -> None: ...

    @abstractmethod
    def touch_chain(self, entries: list) -> None: ...

    @abstractmethod
    def insert_chain(self, entries: list) -> None: ...

    @abstractmethod
    def remove(self, entry: Hashable) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[Hashable]: ...

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first, by epoch stamps.

    Every insert or touch gives the entry the next stamp of a clock; a chain
    refresh is one C-level dict update (no Python step per entry, no list
    reordering). Eviction reads a cache of the oldest stamps, built with numpy
    from all stamps and reused until used up: an entry touched since the
    build carries a newer stamp and is skipped as stale, and every entry not
    in the cache was newer than all of it already, so the order stays exact.

    Callers touch a hash chain so its head ends most recent: under pressure
    suffixes go before the prefix heads that make them reachable (a chain
    without its head is useless).
    """

    def __init__(self) -> None:
        self._stamp: dict[Hashable, int] = {}
        self._clock = 0
        self._oldest: list[tuple[int, Hashable]] = []  # (stamp, entry), ascending, may be stale
        self._pos = 0                                   # _oldest before this is all stale

    def insert(self, entry: Hashable) -> None:
        self._stamp[entry] = self._clock
        self._clock += 1

    def touch(self, entry: Hashable) -> None:
        if entry in self._stamp:
            self.insert(entry)

    def touch_chain(self, entries: list) -> None:
        """Refresh ``entries`` (members; a chain head first): the head ends most recent."""
        self.insert_chain(entries)

    def insert_chain(self, entries: list) -> None:
        """Insert or refresh ``entries``, a chain head first: the head ends most recent."""
        n = len(entries)
        self._stamp.update(zip(reversed(entries), range(self._clock, self._clock + n)))
        self._clock += n

    def remove(self, entry: Hashable) -> None:
        self._stamp.pop(entry, None)

    def candidates(self) -> Iterator[Hashable]:
        # Lazy: callers must stop iterating before they remove or touch anything.
        stamp, last = self._stamp, -1
        oldest, pos = self._oldest, self._pos
        while pos < len(oldest) and stamp.get(oldest[pos][1]) != oldest[pos][0]:
            pos += 1  # each stale slot is passed here once, not once per eviction
        if pos == len(oldest):
            oldest, pos = self._build(-1), 0
            self._oldest = oldest
        self._pos = pos
        while oldest:
            for i in range(pos, len(oldest)):
                s, e = oldest[i]
                if s > last and stamp.get(e) == s:
                    last = s
                    yield e
            # Past the cache (the caller skipped all of it): the next oldest, for this walk only.
            oldest, pos = self._build(last), 0

    def __len__(self) -> int:
        return len(self._stamp)

    def _build(self, after: int) -> list[tuple[int, Hashable]]:
        """(stamp, entry) of the oldest entries stamped after ``after``, ascending."""
        stamp = self._stamp
        if not stamp:
            return []
        stamps = np.fromiter(stamp.values(), np.int64, len(stamp))
        pick = np.flatnonzero(stamps > after)
        if not len(pick):
            return []
        k = max(CACHE_MIN, len(stamp) // 64)  # a rebuild is O(n): reused for >= n/64 evictions
        if len(pick) > k:
            pick = pick[np.argpartition(stamps[pick], k)[:k]]
        pick = pick[np.argsort(stamps[pick], kind="stable")]
        entries = list(stamp)
        return [(s, entries[i]) for s, i in zip(stamps[pick].tolist(), pick.tolist())]


class FIFOPolicy(LRUPolicy):
    """Insertion order; lookups do not refresh. Useful as a baseline."""

    def touch(self, entry: Hashable) -> None:
        pass

    def touch_chain(self, entries: list) -> None:
        pass  # insert_chain (new entries) still orders them


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}
