"""Eviction policies order entries; LRU refreshes on touch, FIFO does not."""

from __future__ import annotations

from kvtier.pool import POLICIES, BlockIndex, FIFOPolicy, LRUPolicy, SlabAllocator
from kvtier.pool.keys import SEP
from kvtier.pool.policy import EvictionPolicy

from .kit import BLOCK_A, SLAB, chain, present, stored


def filled(policy_cls, keys="abcde"):
    p = policy_cls()
    for k in keys:
        p.insert(k)
    return p


def test_lru_touch_moves_to_most_recent():
    p = filled(LRUPolicy)
    p.touch("b")
    p.touch("a")
    assert list(p.candidates()) == ["c", "d", "e", "b", "a"]


def test_fifo_ignores_touch():
    p = filled(FIFOPolicy)
    p.touch("a")
    p.touch("c")
    assert list(p.candidates()) == list("abcde")


def test_remove_and_len():
    for cls in (LRUPolicy, FIFOPolicy):
        p = filled(cls)
        p.remove("c")
        p.remove("zz")  # removing an unknown entry is a no-op
        assert len(p) == 4
        assert list(p.candidates()) == ["a", "b", "d", "e"]


def test_touch_unknown_does_not_insert():
    p = filled(LRUPolicy, "ab")
    p.touch("x")
    assert list(p.candidates()) == ["a", "b"] and len(p) == 2


def test_reinsert_moves_to_end_in_both():
    for cls in (LRUPolicy, FIFOPolicy):
        p = filled(cls, "abc")
        p.insert("a")
        assert list(p.candidates()) == ["b", "c", "a"]


def test_registry_names():
    assert POLICIES == {"lru": LRUPolicy, "fifo": FIFOPolicy}


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
