"""Eviction policies: which ready prefix-cache entry to drop next.

A policy only orders entries; the index decides which candidates are actually
evictable (unpinned, not being written). Swap entries never enter a policy.
``EvictionPolicy`` is the whole seam: the index (and its per-tenant split,
shares.SplitPolicy) calls these methods and nothing else, and nothing outside
kvtier/pool touches a policy. A second policy implements it, takes no
constructor arguments (the split makes one per tenant, of the policy's
``keyed`` kind where it has one: an entry carries one pair of links) and is
named in ``POLICIES`` (config ``policy``); the index does not change.

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


class KeyedLRUPolicy(EvictionPolicy):
    """Least recently used first over any hashable items: an ordered dict, oldest first.

    An insert or a touch moves the item to the end (``move_to_end``); eviction
    reads from the front. 91-99 B per item (the dict's slot and its node). The
    index's own order is ``LRUPolicy`` (links in the entries, 16 B); this kind
    orders what cannot carry links: each tenant's own order when shares are on
    (an entry has one pair of links, taken by the global order) and tests.
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


class KeyedFIFOPolicy(KeyedLRUPolicy):
    """Insertion order over any hashable items; lookups do not refresh."""

    def touch(self, entry: Hashable) -> None:
        pass

    def touch_chain(self, entries: list) -> None:
        pass  # insert_chain (new entries) still orders them


class _Head:
    """The list's sentinel: the oldest entry is ``head.ln``, the newest ``head.lp``."""
    __slots__ = ("lp", "ln")


class LRUPolicy(EvictionPolicy):
    """Least recently used first: a doubly linked list threaded through the entries.

    Each entry carries its neighbours in two slots of its own (``lp``, ``ln``;
    None while it is in no order), so the order costs 16 B per entry and no
    table: the ordered dict it replaced cost 91-99 B per entry (a dict slot and
    a node) and, like every big dict, copied itself at each doubling. An insert
    or a touch relinks the entry at the end, eviction reads from the front; all
    O(1), no hashing (in process at 10^6 entries: touch and insert of 1,000
    1.8x and 2.8x faster than ``move_to_end``, BENCHMARKS.md 18.7).

    Callers touch a hash chain so its head ends most recent: under pressure
    suffixes go before the prefix heads that make them reachable (a chain
    without its head is useless). Items must have ``lp``/``ln`` slots
    (``pool.entry.Entry`` has); ``keyed`` names the kind that orders anything
    hashable (the split's per-tenant orders).
    """

    keyed = KeyedLRUPolicy

    def __init__(self) -> None:
        head = self._head = _Head()
        head.lp = head.ln = head
        self._n = 0

    def insert(self, entry) -> None:
        self.insert_chain((entry,))

    def touch(self, entry) -> None:
        if entry.lp is not None:
            self.insert_chain((entry,))

    def touch_chain(self, entries: list) -> None:
        """Refresh ``entries`` (members; a chain head first): the head ends most recent."""
        self.insert_chain(entries)

    def insert_chain(self, entries) -> None:
        """Insert or refresh ``entries``, a chain head first: the head ends most recent."""
        head, added = self._head, 0
        for e in reversed(entries):
            p = e.lp
            if p is None:
                added += 1
            else:  # unlink from where it was
                n = e.ln
                p.ln, n.lp = n, p
            t = head.lp
            t.ln, e.lp, e.ln, head.lp = e, t, head, e
        self._n += added

    def remove(self, entry) -> None:
        p = entry.lp
        if p is not None:
            n = entry.ln
            p.ln, n.lp = n, p
            entry.lp = entry.ln = None
            self._n -= 1

    def candidates(self) -> Iterator:
        # Lazy: callers must stop iterating before they remove or touch anything. Removing the
        # entry just yielded is survived; removing the next one would yield it unlinked, and
        # touching it would end the walk early (reclaim.pick collects first, evicts after).
        head = self._head
        e = head.ln
        while e is not head:
            n = e.ln  # read first: the entry just yielded may be unlinked meanwhile
            yield e
            e = n

    def __len__(self) -> int:
        return self._n

    def ages(self) -> dict:
        """Each entry's place in the order, 0 the oldest: for audits and tests (O(entries))."""
        return {e: i for i, e in enumerate(self.candidates())}


class FIFOPolicy(LRUPolicy):
    """Insertion order; lookups do not refresh. Useful as a baseline."""

    keyed = KeyedFIFOPolicy

    def touch(self, entry) -> None:
        pass

    def touch_chain(self, entries: list) -> None:
        pass  # insert_chain (new entries) still orders them


POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}
