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
from collections import OrderedDict
from typing import Hashable, Iterator


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
    """Least recently used first: an ordered dict, oldest first.

    An insert or a touch moves the entry to the end (O(1) in C: ``move_to_end``);
    eviction reads from the front. No stamps, no stale items, no rebuild: the
    stamps this replaced needed an O(entries) rebuild of their oldest-first cache
    once per entries/64 evictions, 95-406 ms of CPU at 2.25M entries, which was
    the store p99 of a trace replay at that size (BENCHMARKS.md 18.5).

    Callers touch a hash chain so its head ends most recent: under pressure
    suffixes go before the prefix heads that make them reachable (a chain
    without its head is useless).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, entry: Hashable) -> None:
        order = self._order
        if entry in order:
            order.move_to_end(entry)
        else:
            order[entry] = None

    def touch(self, entry: Hashable) -> None:
        if entry in self._order:
            self._order.move_to_end(entry)

    def touch_chain(self, entries: list) -> None:
        """Refresh ``entries`` (members; a chain head first): the head ends most recent."""
        self.insert_chain(entries)

    def insert_chain(self, entries: list) -> None:
        """Insert or refresh ``entries``, a chain head first: the head ends most recent."""
        order, move = self._order, self._order.move_to_end
        for e in reversed(entries):
            if e in order:
                move(e)
            else:
                order[e] = None

    def remove(self, entry: Hashable) -> None:
        self._order.pop(entry, None)

    def candidates(self) -> Iterator[Hashable]:
        # Lazy: callers must stop iterating before they remove or touch anything.
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def ages(self) -> dict[Hashable, int]:
        """Each entry's place in the order, 0 the oldest: for audits and tests (O(entries))."""
        return {e: i for i, e in enumerate(self._order)}


class FIFOPolicy(LRUPolicy):
    """Insertion order; lookups do not refresh. Useful as a baseline."""

    def touch(self, entry: Hashable) -> None:
        pass

    def touch_chain(self, entries: list) -> None:
        pass  # insert_chain (new entries) still orders them


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}
