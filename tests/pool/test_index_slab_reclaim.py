"""Two size classes in one full pool: a slab of the other class goes whole, and late.

Making room for class B may take a whole slab of class A. The slab goes once
eviction, walking oldest first, has passed every block in it (its newest block
is the oldest left), so no block goes while an older block of the class asking
for room stays, and a recently read chain head is not thrown away with an old
tail that shared its slab. Pools are tiny (kit.py): 4 A-blocks or 2 B-blocks per slab.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pool import BlockIndex, SlabAllocator

from .kit import BLOCK_A, BLOCK_B, SLAB, chain, make_index, present, stored


def a_pool(slabs: int):
    """A pool filled by chain 'a' of namespace A: a0..a3 in slab 0, a4..a7 in slab 1, ..."""
    idx = make_index(slabs=slabs)
    a, b = idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)
    keys = chain("a", 4 * slabs)
    stored(idx, a, keys)
    return idx, a, b, keys


def test_a_slab_holding_a_recently_read_block_outlives_an_older_slab():
    idx, a, b, keys = a_pool(slabs=3)
    # A tail block in slab 2 is read again (a prefix-less load, e.g. a reader of one
    # block): slab 2's newest block is now the newest in the pool.
    idx.complete_load(idx.prepare_load(a, keys[11:12]))
    # The oldest block is now a10 in slab 2, but slab 1 (a4..a7) is the first all of
    # whose blocks the walk passes: it goes, slab 2 stays whole.
    assert stored(idx, b, chain("b", 1)) == 1
    assert present(a, keys) == [True] * 4 + [False] * 4 + [True] * 4
    assert idx.alloc_.slab_of(b.entry(chain("b", 1)[0]).offset) == 1


def test_a_chain_head_is_not_evicted_with_an_old_tail_in_its_slab():
    idx = make_index(slabs=3)
    a, b = idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)
    stored(idx, a, chain("old", 6))               # slab 0 full, slab 1 half: old4, old5
    stored(idx, a, chain("new", 6))               # new0, new1 fill slab 1, new2..new5 slab 2
    # Before: the oldest block (old5) sat in slab 1, so slab 1 went whole with
    # new0 and new1, the new chain's head: its other 4 blocks stayed, unreachable.
    assert stored(idx, b, chain("b", 2)) == 2
    assert idx.lookup(a, chain("new", 6)) == 6
    assert present(a, chain("old", 6)) == [False] * 4 + [True] * 2  # slab 0 went


def test_past_the_walk_limit_the_slab_of_the_next_oldest_block_goes():
    idx, a, b, keys = a_pool(slabs=4)
    # Every slab's first block read again: no slab completes before the walk's end.
    idx.complete_load(idx.prepare_load(a, keys[::4]))
    idx.slab_walk_limit = 2
    # The walk passes a15 and a14 (slab 3), then a13's slab goes whole.
    assert stored(idx, b, chain("b", 1)) == 1
    assert present(a, keys) == [True] * 12 + [False] * 4


def test_past_the_walk_limit_a_slab_with_a_pinned_block_still_stays():
    idx, a, b, keys = a_pool(slabs=2)
    idx.complete_load(idx.prepare_load(a, [keys[0], keys[4]]))
    pin = idx.prepare_load(a, keys[7:8])  # slab 1 has the most walked, but a pinned block
    idx.slab_walk_limit = 1
    # Passed: a6 (a7 is pinned). Then a5's slab is refused for a7, a3's slab goes.
    plan = idx.prepare_store(b, chain("b", 1))
    assert plan.no_space == [] and present(a, keys[4:]) == [True] * 4
    assert present(a, keys[:4]) == [False] * 4
    idx.complete_store(plan)
    idx.complete_load(pin)
    idx.check_integrity()


class CountingAllocator(SlabAllocator):
    """The real allocator, counting how often eviction reads a slab's slots."""
    scans = 0

    def used_offsets(self, s):
        self.scans += 1
        return super().used_offsets(s)


def test_blocked_slabs_are_never_read_by_the_walk_and_once_past_its_limit():
    alloc = CountingAllocator(4 * SLAB, SLAB)
    idx = BlockIndex(alloc)
    a, b = idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)
    keys = chain("a", 16)
    stored(idx, a, keys)
    pin = idx.prepare_load(a, keys[::4])  # one pinned block in every slab
    for limit, scans in ((10**6, 0), (0, 4)):  # 12 unpinned blocks in 4 slabs
        idx.slab_walk_limit, alloc.scans = limit, 0
        plan = idx.prepare_store(b, chain("b", 1))
        # The walk counts a slab's blocks as it passes them; past its limit it reads
        # each slab once, not once per block (that cost 39 s for 64K entries).
        assert plan.no_space == [0] and alloc.scans == scans
        idx.complete_store(plan)
    idx.complete_load(pin)
    idx.check_integrity()


# ---- property: no evicted block is newer than a kept block of the class asking ----------------
step = st.tuples(st.sampled_from(["store", "read"]), st.integers(0, 1), st.integers(0, 20), st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(st.lists(step, min_size=1, max_size=60))
def test_eviction_keeps_lru_order_at_slab_granularity(steps):
    idx = make_index(slabs=5)
    nss = [idx.namespace("model-a", BLOCK_A), idx.namespace("model-b", BLOCK_B)]
    for op, which, tag, n in steps:
        ns = nss[which]
        keys = chain(f"{which}/{tag}", n)
        if op == "read":
            idx.lookup(ns, keys)
            continue
        before = idx.policy.ages()
        stored(idx, ns, keys)
        stamp = idx.policy.ages()
        gone = [e for e in before if e not in stamp]
        kept = [before[e] for e in before if e in stamp and e.ns.cls == ns.cls and e.key not in keys]
        if gone and kept:
            # Blocks of the asking class older than an evicted block would have gone first.
            assert max(before[e] for e in gone) < min(kept)
        for s in {idx.alloc_.slab_of(e.offset) for e in gone if e.ns.cls != ns.cls}:
            # Another class's blocks only go as whole slabs.
            assert idx.alloc_.slabs[s].cls in (-1, ns.cls)
