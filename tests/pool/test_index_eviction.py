"""BlockIndex under pressure: what is evicted, what never is.

Pools here are tiny: SLAB is 16 KiB, so namespace A (4 KiB blocks) fits 4 blocks
per slab and namespace B (8 KiB blocks) 2 per slab. Slabs are handed out from
slab 0 upwards and slots from 0 upwards, so a chain stored into an empty pool
lands in slab order: a0..a3 in slab 0, a4..a7 in slab 1, ...
"""

from __future__ import annotations

import pytest

from kvtier.pool import WRITING, BlockIndex, SlabAllocator

from .kit import BLOCK_A, BLOCK_B, SLAB, chain, make_index, present, stored


def full_pool(slabs=2, events=False):
    """An index whose pool is filled by one committed chain 'c' in namespace A."""
    idx = make_index(slabs=slabs, events=events)
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("c", 4 * slabs)
    assert stored(idx, ns, keys) == len(keys)
    assert idx.alloc_.free_bytes == 0
    return idx, ns, keys


def test_pinned_entries_are_never_evicted():
    idx, ns, keys = full_pool()
    pins = idx.prepare_load(ns, keys)  # every block is being read
    plan = idx.prepare_store(ns, chain("new", 2))
    assert plan.no_space == [0, 1] and idx.evictions == 0
    idx.complete_store(plan)
    assert present(ns, keys) == [True] * 8
    idx.complete_load(pins)
    # Unpinned again, the same store now makes room.
    assert stored(idx, ns, chain("new", 2)) == 2 and idx.evictions == 2


def test_pinned_oldest_is_skipped_for_the_next_oldest():
    idx, ns, keys = full_pool()
    pin = idx.prepare_load(ns, keys[-1:])  # the tail is the oldest entry
    assert stored(idx, ns, chain("new", 1)) == 1
    assert present(ns, keys[-2:]) == [False, True]
    idx.complete_load(pin)


def test_a_store_never_evicts_its_own_blocks():
    idx = make_index(slabs=2)
    ns = idx.namespace("model-a", BLOCK_A)
    stored(idx, ns, chain("old", 4))
    # 12 blocks into a pool of 8: the 4 old ones make room, then the store
    # runs out instead of eating the blocks it is still writing.
    plan = idx.prepare_store(ns, chain("big", 12))
    assert plan.no_space == [8, 9, 10, 11] and idx.evictions == 4
    assert [e.state for e in plan.entries[:8]] == [WRITING] * 8
    assert idx.complete_store(plan) == 8
    assert idx.lookup(ns, chain("big", 12)) == 8
    idx.check_integrity()


def test_a_store_never_evicts_the_present_prefix_it_extends():
    idx = make_index(slabs=2)
    ns = idx.namespace("model-a", BLOCK_A)
    head = chain("h", 4)
    stored(idx, ns, head)              # oldest entries in the pool
    stored(idx, ns, chain("y", 4))     # pool now full
    # Extending h by 4 blocks must evict y, not h's own (skipped) head blocks:
    # evicting those would leave the new blocks unreachable.
    plan = idx.prepare_store(ns, chain("h", 8))
    assert plan.skipped == [0, 1, 2, 3] and plan.no_space == []
    idx.complete_store(plan)
    assert idx.lookup(ns, chain("h", 8)) == 8
    assert present(ns, chain("y", 4)) == [False] * 4
    idx.check_integrity()


def test_suffixes_go_before_prefix_heads():
    idx, ns, keys = full_pool()
    assert idx.lookup(ns, keys) == 8   # refresh: head most recent, tail oldest
    stored(idx, ns, chain("x", 2))
    assert present(ns, keys) == [True] * 6 + [False] * 2
    assert idx.lookup(ns, keys) == 6   # a shorter prefix, not zero
    # That lookup refreshed c0..c5 again, so the unused x blocks go before c5.
    stored(idx, ns, chain("z", 3))
    assert present(ns, chain("x", 2)) == [False, False]
    assert idx.lookup(ns, keys) == 5


@pytest.mark.parametrize("refresh", [True, False])
def test_lookup_refresh_protects_a_used_chain(refresh):
    idx = make_index(slabs=2)
    ns = idx.namespace("model-a", BLOCK_A)
    used, unused = chain("used", 4), chain("unused", 4)
    stored(idx, ns, used)
    stored(idx, ns, unused)
    if refresh:
        idx.lookup(ns, used)
    stored(idx, ns, chain("r", 4))
    # Without the lookup the older chain goes; with it the untouched one does.
    assert idx.lookup(ns, used) == (4 if refresh else 0)
    assert idx.lookup(ns, unused) == (0 if refresh else 4)


def test_other_class_gets_space_by_evicting_a_whole_slab():
    idx, a, keys = full_pool(slabs=4)
    b = idx.namespace("model-b", BLOCK_B)
    # The oldest A entry is the tail a15, in slab 3: the whole slab goes.
    # (present() rather than lookup(): a lookup would refresh A past B.)
    assert stored(idx, b, chain("b", 1)) == 1
    assert idx.evictions == 4 and present(a, keys) == [True] * 12 + [False] * 4
    assert idx.alloc_.slab_of(b.entry(chain("b", 1)[0]).offset) == 3
    # The second B block fits the same slab; the third needs slab 2 (a8..a11).
    assert stored(idx, b, chain("b", 2, start=1)) == 2
    assert idx.evictions == 8 and present(a, keys) == [True] * 8 + [False] * 8
    assert idx.lookup(b, chain("b", 3)) == 3 and idx.lookup(a, keys) == 8


def test_no_space_rather_than_evicting_pinned_blocks_of_another_class():
    idx, a, keys = full_pool(slabs=4)
    b = idx.namespace("model-b", BLOCK_B)
    pin = idx.prepare_load(a, keys[::4])  # one pinned block in every slab
    plan = idx.prepare_store(b, chain("b", 2))
    assert plan.no_space == [0, 1] and idx.evictions == 0
    idx.complete_store(plan)
    assert present(a, keys) == [True] * 16
    idx.complete_load(pin)
    assert stored(idx, b, chain("b", 2)) == 2
    idx.check_integrity()


def test_slab_with_an_inflight_block_is_not_evicted_for_another_class():
    idx = make_index(slabs=2)
    a, b = idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)
    stored(idx, a, chain("a", 7))
    writing = idx.prepare_store(a, chain("w", 1))  # last slot of slab 1
    pin = idx.prepare_load(a, chain("a", 1))       # slab 0 pinned
    plan = idx.prepare_store(b, chain("b", 1))
    assert plan.no_space == [0] and idx.evictions == 0
    for p in (plan, writing):
        idx.complete_store(p)
    idx.complete_load(pin)
    idx.check_integrity()


def test_evictions_emit_removed_events_in_eviction_order():
    idx, ns, keys = full_pool(events=True)
    idx.take_events()
    new = chain("new", 2)
    stored(idx, ns, new)
    assert idx.take_events() == [
        ("removed", "model-a", keys[7]), ("removed", "model-a", keys[6]),
        ("stored", "model-a", new[0]), ("stored", "model-a", new[1]),
    ]
    assert ns.stats["evicted"] == 2
