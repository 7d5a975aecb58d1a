"""Eviction policies order entries; LRU refreshes on touch, FIFO does not."""

from __future__ import annotations

from kvtier.pool import POLICIES, FIFOPolicy, LRUPolicy


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
