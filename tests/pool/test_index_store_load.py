"""BlockIndex two-phase store and load, dedup, lookup, flush, events."""

from __future__ import annotations

import pytest

from kvtier.pool import WRITING, IntegrityError

from .kit import BLOCK_A, BLOCK_B, chain, key, make_index, present, stored


def test_store_is_invisible_until_complete():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 3)
    plan = idx.prepare_store(ns, keys)
    assert [e.state for e in plan.entries] == [WRITING] * 3
    # Space is taken already, but nobody can find or load the half-written blocks.
    assert idx.alloc_.used_bytes == 3 * BLOCK_A
    assert idx.lookup(ns, keys) == 0
    load = idx.prepare_load(ns, keys)
    assert load.missing == [0, 1, 2]
    idx.complete_load(load)
    idx.check_integrity()
    assert idx.complete_store(plan) == 3
    assert idx.lookup(ns, keys) == 3
    assert ns.ready_blocks() == 3 and ns.stats["stored"] == 3
    idx.check_integrity()


def test_failed_indices_are_freed():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 4)
    assert stored(idx, ns, keys, failed=[1, 3]) == 2
    assert present(ns, keys) == [True, False, True, False]
    assert idx.alloc_.used_bytes == 2 * BLOCK_A
    # The chain breaks at the first failed block: only the head is a usable prefix.
    assert idx.lookup(ns, keys) == 1
    assert ns.stats["store_failed"] == 2
    # A failed block can be stored again later.
    assert stored(idx, ns, keys) == 2 and idx.lookup(ns, keys) == 4


def test_abandoned_plan_commits_nothing():
    idx = make_index(events=True)
    ns = idx.namespace("model-a", BLOCK_A)
    plan = idx.prepare_store(ns, chain("p", 5))
    plan.abandoned = True  # the writer died mid-copy
    assert idx.complete_store(plan) == 0
    assert ns.all_entries() == {} and idx.alloc_.used_bytes == 0
    assert idx.take_events() == []  # nothing was announced, so nothing is removed
    idx.check_integrity()


def test_store_of_present_or_inflight_keys_is_skipped():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 6)
    assert stored(idx, ns, keys[:2]) == 2
    first = idx.prepare_store(ns, keys[:4])      # 0,1 present; 2,3 now in flight
    second = idx.prepare_store(ns, keys)         # 0..3 present or in flight; 4,5 new
    assert first.skipped == [0, 1] and second.skipped == [0, 1, 2, 3]
    assert second.entries[:4] == [None] * 4
    assert idx.alloc_.used_bytes == 6 * BLOCK_A  # no block was allocated twice
    assert idx.complete_store(second) == 2
    assert idx.lookup(ns, keys) == 2             # 2,3 still writing: the prefix stops there
    assert idx.complete_store(first) == 2
    assert idx.lookup(ns, keys) == 6
    assert ns.stats["store_skipped"] == 6
    idx.check_integrity()


def test_duplicate_key_within_one_store_is_written_once():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    a = key("p", 0)
    plan = idx.prepare_store(ns, [a, a])
    assert plan.skipped == [1]
    assert idx.complete_store(plan) == 1
    idx.check_integrity()


def test_lookup_returns_longest_ready_prefix_and_counts():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 5)
    stored(idx, ns, keys[:3])
    assert idx.lookup(ns, keys) == 3
    assert idx.lookup(ns, [key("other")] + keys) == 0  # a prefix must start at the head
    assert idx.lookup(ns, keys[1:3]) == 2
    assert idx.lookup(ns, []) == 0
    assert (ns.stats["lookups"], ns.stats["hits"], ns.stats["misses"]) == (4, 5, 2 + 6 + 0)


def test_namespaces_are_isolated_and_sizes_checked():
    idx = make_index()
    a = idx.namespace("model-a", BLOCK_A)
    b = idx.namespace("model-b", BLOCK_A)
    assert idx.namespace("model-a", BLOCK_A) is a
    keys = chain("p", 2)
    stored(idx, a, keys)
    assert idx.lookup(b, keys) == 0  # same hashes, other model: no sharing
    with pytest.raises(ValueError, match="fingerprint"):
        idx.namespace("model-a", BLOCK_B)
    assert idx.lookup(a, keys) == 2  # the mismatch changed nothing


def test_load_pins_and_complete_load_unpins():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 3)
    stored(idx, ns, keys[:2])
    plan = idx.prepare_load(ns, keys)
    assert plan.missing == [2]
    assert [e.pins for e in plan.entries[:2]] == [1, 1]
    idx.complete_load(plan, failed=[0])
    assert [ns.entry(k).pins for k in keys[:2]] == [0, 0]
    assert (ns.stats["loaded"], ns.stats["load_failed"]) == (1, 2)
    idx.check_integrity()


def test_double_unpin_raises():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    stored(idx, ns, chain("p", 2))
    plan = idx.prepare_load(ns, chain("p", 2))
    idx.complete_load(plan)
    with pytest.raises(IntegrityError, match="unpin"):
        idx.complete_load(plan)
    idx.check_integrity()


def test_completing_a_load_twice_cannot_steal_another_readers_pin():
    # Two readers pin the same block; one completing twice must not leave the
    # other's block unpinned (it could then be evicted under the copy).
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 1)
    stored(idx, ns, keys)
    first, second = idx.prepare_load(ns, keys), idx.prepare_load(ns, keys)
    idx.complete_load(first)
    with pytest.raises(IntegrityError):
        idx.complete_load(first)
    assert ns.entry(keys[0]).pins == 1
    idx.complete_load(second)
    assert ns.entry(keys[0]).pins == 0


def test_flush_one_namespace_or_all_keeps_pinned_and_writing():
    idx = make_index(slabs=8)
    a, b = idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)
    ka, kb = chain("a", 4), chain("b", 3)
    stored(idx, a, ka)
    stored(idx, b, kb)
    pin = idx.prepare_load(a, ka[:1])
    writing = idx.prepare_store(a, chain("w", 2))
    assert idx.flush(a) == 3
    assert present(a, ka) == [True, False, False, False]
    assert idx.lookup(b, kb) == 3  # the other namespace is untouched
    assert idx.flush() == 3        # b's three; a's pinned head stays
    assert present(a, ka[:1]) == [True] and b.all_entries() == {}
    idx.complete_load(pin)
    assert idx.complete_store(writing) == 2  # in-flight stores survive a flush
    assert idx.flush() == 3 and idx.alloc_.used_bytes == 0
    idx.check_integrity()


def test_events_in_order():
    idx = make_index(events=True)
    a = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 3)
    stored(idx, a, keys, failed=[2])
    assert idx.take_events() == [("stored", "model-a", keys[0]), ("stored", "model-a", keys[1])]
    assert idx.take_events() == []  # taking drains
    idx.flush(a)
    assert sorted(idx.take_events()) == sorted(("removed", "model-a", k) for k in keys[:2])


def test_events_off_by_default():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    stored(idx, ns, chain("p", 2))
    idx.flush()
    assert idx.take_events() == []


def test_completing_a_store_twice_raises_and_changes_nothing():
    idx = make_index(events=True)
    ns = idx.namespace("model-a", BLOCK_A)
    plan = idx.prepare_store(ns, chain("p", 2))
    assert idx.complete_store(plan) == 2
    idx.take_events()
    with pytest.raises(IntegrityError):
        idx.complete_store(plan, failed=[0])  # must not free a block others now read
    assert present(ns, chain("p", 2)) == [True, True]
    assert ns.stats["stored"] == 2 and idx.take_events() == []
    idx.check_integrity()


def test_discard_drops_a_ready_unpinned_entry_only():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("p", 3)
    stored(idx, ns, keys)
    pin = idx.prepare_load(ns, keys[:1])
    idx.discard(ns.entry(keys[0]))  # pinned: a reader is copying it out
    idx.discard(ns.entry(keys[1]))
    assert present(ns, keys) == [True, False, True] and ns.ready_blocks() == 2
    idx.complete_load(pin)
    idx.check_integrity()


def test_namespace_ids_are_never_reused_after_one_is_forgotten():
    from kvtier.pool.allocator import SlabAllocator
    from kvtier.pool.index import BlockIndex
    idx = BlockIndex(SlabAllocator(4 << 20, 1 << 20))
    a = idx.namespace("a", 4096)
    del idx.namespaces["a"]  # what the daemon does with an empty, unregistered namespace
    b = idx.namespace("b", 4096)
    assert b.id != a.id
