"""Eviction policies order entries; LRU refreshes on touch, FIFO does not."""

from __future__ import annotations

import pytest

from kvtier.pool import POLICIES, BlockIndex, FIFOPolicy, LRUPolicy, SlabAllocator
from kvtier.pool.entry import Entry
from kvtier.pool.keys import SEP
from kvtier.pool.policy import EvictionPolicy, KeyedFIFOPolicy, KeyedLRUPolicy

from .kit import BLOCK_A, SLAB, chain, present, stored


KINDS = [LRUPolicy, FIFOPolicy, KeyedLRUPolicy, KeyedFIFOPolicy]
LRU_KINDS = [LRUPolicy, KeyedLRUPolicy]
FIFO_KINDS = [FIFOPolicy, KeyedFIFOPolicy]


class Orders:
    """One policy under test and the items it orders, named by letter: index entries
    (links of their own) for the linked kinds, the letters themselves for the keyed ones."""

    def __init__(self, kind, keys="abcde"):
        self.p = kind()
        self.linked = not kind.__name__.startswith("Keyed")
        self.items: dict = {}
        for k in keys:
            self.p.insert(self[k])

    def __getitem__(self, k: str):
        if k not in self.items:
            self.items[k] = Entry(None, k.encode().ljust(16, b"."), 0) if self.linked else k
        return self.items[k]

    def order(self) -> list[str]:
        return [e.key.rstrip(b".").decode() if self.linked else e for e in self.p.candidates()]


@pytest.mark.parametrize("kind", LRU_KINDS)
def test_lru_touch_moves_to_most_recent(kind):
    o = Orders(kind)
    o.p.touch(o["b"])
    o.p.touch(o["a"])
    assert o.order() == ["c", "d", "e", "b", "a"]


@pytest.mark.parametrize("kind", FIFO_KINDS)
def test_fifo_ignores_touch(kind):
    o = Orders(kind)
    o.p.touch(o["a"])
    o.p.touch_chain([o["c"], o["d"]])
    assert o.order() == list("abcde")


@pytest.mark.parametrize("kind", KINDS)
def test_remove_and_len(kind):
    o = Orders(kind)
    o.p.remove(o["c"])
    o.p.remove(o["zz"])  # removing an unknown entry is a no-op
    o.p.remove(o["c"])   # and so is removing one twice
    assert len(o.p) == 4
    assert o.order() == ["a", "b", "d", "e"]


@pytest.mark.parametrize("kind", LRU_KINDS)
def test_touch_unknown_does_not_insert(kind):
    o = Orders(kind, "ab")
    o.p.touch(o["x"])
    assert o.order() == ["a", "b"] and len(o.p) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_reinsert_moves_to_end_in_both(kind):
    o = Orders(kind, "abc")
    o.p.insert(o["a"])
    assert o.order() == ["b", "c", "a"]
    o.p.insert_chain([o["c"], o["x"]])  # a chain head first: the head ends most recent
    assert o.order() == ["b", "a", "x", "c"] and len(o.p) == 4


def test_an_entry_unlinked_while_the_walk_stands_on_it_does_not_end_the_walk():
    o = Orders(LRUPolicy)
    walk = o.p.candidates()
    assert next(walk) is o["a"]
    o.p.remove(o["a"])  # the index evicts what a walk picked only after it, but a walk survives it
    assert [e.key.rstrip(b".") for e in walk] == [b"b", b"c", b"d", b"e"]


def test_registry_names():
    assert POLICIES == {"lru": LRUPolicy, "fifo": FIFOPolicy}
    assert LRUPolicy.keyed is KeyedLRUPolicy and FIFOPolicy.keyed is KeyedFIFOPolicy


class NewestFirst(EvictionPolicy):
    """A second policy written against the interface alone: evicts the most recent entry first."""

    def __init__(self) -> None:
        self.order: dict = {}

    def insert(self, entry) -> None:
        self.order.pop(entry, None)
        self.order[entry] = None

    def touch(self, entry) -> None:
        if entry in self.order:
            self.insert(entry)

    def touch_chain(self, entries: list) -> None:
        for e in reversed(entries):
            self.touch(e)

    def insert_chain(self, entries: list) -> None:
        for e in reversed(entries):
            self.insert(e)

    def remove(self, entry) -> None:
        self.order.pop(entry, None)

    def candidates(self):
        return iter(reversed(list(self.order)))

    def __len__(self) -> int:
        return len(self.order)


def test_a_second_policy_plugs_into_the_index_through_the_interface_alone():
    """The index calls the policy through ``EvictionPolicy`` only: a policy written
    against it evicts in its own order, with or without tenant shares, and the
    index's integrity check holds throughout."""
    for share in (1.0, 0.5):
        idx = BlockIndex(SlabAllocator(4 * SLAB, SLAB), NewestFirst(), share)
        ns = idx.namespace(f"t{SEP}m", BLOCK_A)
        assert stored(idx, ns, chain("old", 4)) == 4
        room = 4 if share == 1.0 else 0  # at its share the tenant makes room from its own blocks
        assert stored(idx, ns, chain("new", 4 + room)) == 4 + room
        assert present(ns, chain("old", 4)) == [True] * 4  # newest first: the older chain stays
        idx.check_integrity()


def test_a_policy_missing_a_method_is_refused_at_construction():
    """Hostile input: something that is not a policy is a TypeError before the index uses it."""
    class Broken(EvictionPolicy):
        def insert(self, entry) -> None: ...
    try:
        BlockIndex(SlabAllocator(4 * SLAB, SLAB), Broken())
    except TypeError:
        return
    raise AssertionError("a policy without candidates() was accepted")


def test_fifo_with_tenant_shares_evicts_a_tenants_oldest_inserted_first():
    """The split's per-tenant orders are the keyed kind of the policy's own (FIFO's for FIFO):
    a tenant at its share evicts its first stored blocks, read or not."""
    idx = BlockIndex(SlabAllocator(4 * SLAB, SLAB), FIFOPolicy(), 0.5)
    ns = idx.namespace(f"t{SEP}m", BLOCK_A)
    assert stored(idx, ns, chain("first", 4)) == 4 and stored(idx, ns, chain("second", 4)) == 4
    idx.lookup(ns, chain("first", 4))  # FIFO: a read does not refresh
    assert stored(idx, ns, chain("third", 4)) == 4
    assert present(ns, chain("first", 4)) == [False] * 4 and present(ns, chain("second", 4)) == [True] * 4
    idx.check_integrity()


def test_a_linked_policy_without_its_own_keyed_kind_is_refused_by_the_split():
    class MostRecentFirst(LRUPolicy):  # another order kept in the links: would inherit LRU's keyed kind
        pass
    with pytest.raises(TypeError):
        BlockIndex(SlabAllocator(4 * SLAB, SLAB), MostRecentFirst(), 0.5)
    BlockIndex(SlabAllocator(4 * SLAB, SLAB), MostRecentFirst(), 1.0)  # no split: nothing to refuse
