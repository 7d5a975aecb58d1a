"""Eviction policies: which ready prefix-cache entry to drop next.

A policy only orders entries; the index decides which candidates are actually
evictable (unpinned, not being written). Swap entries never enter a policy.

Primitives: ``insert(entry)``, ``touch(entry)``, ``remove(entry)``,
``candidates()`` (oldest first), ``__len__``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterator, Protocol


class EvictionPolicy(Protocol):
    def insert(self, entry: Hashable) -> None: ...
    def touch(self, entry: Hashable) -> None: ...
    def remove(self, entry: Hashable) -> None: ...
    def candidates(self) -> Iterator[Hashable]: ...
    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first.

    Callers touch a hash chain tail-first so the chain's head ends most
    recent: under pressure suffixes go before the prefix heads that make
    them reachable (a chain without its head is useless).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, entry: Hashable) -> None:
        self._order[entry] = None
        self._order.move_to_end(entry)

    def touch(self, entry: Hashable) -> None:
        if entry in self._order:
            self._order.move_to_end(entry)

    def remove(self, entry: Hashable) -> None:
        self._order.pop(entry, None)

    def candidates(self) -> Iterator[Hashable]:
        # Lazy: callers must stop iterating before they remove anything.
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """Insertion order; lookups do not refresh. Useful as a baseline."""

    def touch(self, entry: Hashable) -> None:
        pass


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}
