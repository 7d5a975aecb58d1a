"""Per-tenant pool shares in the index, without sockets.

Pools are tiny (kit: 16 KiB slabs, 4 KiB blocks in namespace class A). A
namespace key ``ns_key(tenant, fingerprint)`` belongs to that tenant; with share 0.5
of an 8-slab pool one tenant may hold 4 slabs: 16 of its 32 A-blocks. A
tenant is charged the slabs its size classes occupy, whole.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.keys import SEP

from .kit import BLOCK_A, BLOCK_B, SLAB, chain, present, stored


def shared_index(share: float, slabs: int = 8) -> BlockIndex:
    return BlockIndex(SlabAllocator(slabs * SLAB, SLAB), share=share)


def ns_of(idx, tenant: str, block=BLOCK_A, fp="m"):
    return idx.namespace(f"{tenant}{SEP}{fp}", block)


def test_a_flooding_tenant_evicts_only_its_own_oldest_blocks():
    idx = shared_index(0.5)
    a, b = ns_of(idx, "alice"), ns_of(idx, "bob")
    kept = chain("bob", 8)
    assert stored(idx, b, kept) == 8
    for i in range(20):  # alice stores 160 blocks into a 32-block pool
        assert stored(idx, a, chain(f"alice{i}", 8)) == 8
        assert idx.tenants.usage(idx)["alice"] <= idx.tenants.limit
    assert present(b, kept) == [True] * 8  # bob's cache was never touched
    assert idx.tenants.usage(idx) == {"alice": 16 * BLOCK_A, "bob": 8 * BLOCK_A}
    assert present(a, chain("alice19", 8)) == [True] * 8  # her newest blocks are the ones kept
    assert idx.tenants.at_share["alice"] > 0 and idx.tenants.own_evictions["alice"] == 160 - 16


def test_with_the_share_off_a_flood_evicts_everyone_as_before():
    idx = shared_index(1.0)
    a, b = ns_of(idx, "alice"), ns_of(idx, "bob")
    kept = chain("bob", 8)
    stored(idx, b, kept)
    for i in range(8):
        stored(idx, a, chain(f"alice{i}", 8))
    assert present(b, kept) == [False] * 8
    assert idx.tenants.usage(idx) == {"alice": 32 * BLOCK_A}


def test_below_its_share_a_store_still_evicts_by_global_lru():
    idx = shared_index(0.75, slabs=4)  # 16 blocks; 12 each
    a, b = ns_of(idx, "alice"), ns_of(idx, "bob")
    stored(idx, b, chain("bob", 12))
    stored(idx, a, chain("alice", 4))  # pool full: alice (4 of 12) evicts bob's oldest
    assert stored(idx, a, chain("alice2", 4)) == 4
    assert sum(present(b, chain("bob", 12))) == 8


def test_a_store_at_the_share_with_only_pinned_own_blocks_is_no_space():
    idx = shared_index(0.5, slabs=4)  # 8 A-blocks per tenant
    a, b = ns_of(idx, "alice"), ns_of(idx, "bob")
    mine = chain("alice", 8)
    stored(idx, a, mine)
    stored(idx, b, chain("bob", 4))
    reading = idx.prepare_load(a, mine)  # all of alice's blocks are being loaded
    plan = idx.prepare_store(a, chain("more", 3))
    assert plan.no_space == [0, 1, 2]  # a value, as a full pool gives
    idx.complete_store(plan)
    idx.complete_load(reading)
    assert present(b, chain("bob", 4)) == [True] * 4 and present(a, mine) == [True] * 8
    idx.check_integrity()


def test_the_chain_a_store_extends_is_not_evicted_to_make_room_for_it():
    idx = shared_index(0.5, slabs=4)
    a = ns_of(idx, "alice")
    head = chain("c", 8)
    stored(idx, a, head)  # at the share; the whole chain is the store's prefix
    longer = head + chain("c", 2, start=8)
    plan = idx.prepare_store(a, longer)
    assert plan.skipped == list(range(8)) and plan.no_space == [8, 9]
    idx.complete_store(plan)
    assert present(a, head) == [True] * 8


@pytest.mark.parametrize("walk_limit", [16384, 0])  # 0: the rule past reclaim's walk limit
def test_a_tenants_sizes_get_slabs_of_their_own_and_its_other_slabs_go_whole(walk_limit):
    """Two tenants' blocks of one size never share a slab, so a tenant at its
    share frees a whole slab of its other size, never one holding another's block."""
    idx = shared_index(0.5, slabs=4)  # 2 slabs each; A = 4 KiB (4 a slab), B = 8 KiB (2)
    idx.slab_walk_limit = walk_limit
    a_small, a_big = ns_of(idx, "alice"), ns_of(idx, "alice", BLOCK_B, "big")
    b_big = ns_of(idx, "bob", BLOCK_B, "big")
    stored(idx, a_big, chain("ab", 1))      # slab 0: alice's B block alone ...
    stored(idx, b_big, chain("bb", 1))      # ... bob's goes to a slab of his own
    slab_of = idx.alloc_.slab_of
    assert slab_of(a_big.entry(chain("ab", 1)[0]).offset) != slab_of(b_big.entry(chain("bb", 1)[0]).offset)
    stored(idx, a_small, chain("as", 2))    # alice: 2 slabs, her share, for 3 blocks
    assert idx.tenants.usage(idx) == {"alice": 2 * SLAB, "bob": SLAB}
    assert stored(idx, a_small, chain("as2", 3)) == 3  # 2 free slots + her B slab, whole
    assert present(b_big, chain("bb", 1)) == [True]
    assert present(a_big, chain("ab", 1)) == [False]
    assert idx.tenants.own_evictions["alice"] == 1


def test_one_block_in_each_of_many_sizes_is_charged_a_slab_each():
    """Issue 30 row 1 without sockets: 8 sizes, one block each, used to be charged
    their slot bytes (~36 KB of a 64 KiB share) while taking all 8 slabs."""
    idx = shared_index(0.5)
    b = ns_of(idx, "bob")
    kept = chain("bob", 16)
    stored(idx, b, kept)  # 4 slabs: all the room alice's share leaves
    for k in range(1, 9):
        assert stored(idx, ns_of(idx, "alice", 256 * k, f"size{k}"), chain(f"s{k}", 1)) == 1
    assert idx.tenants.usage(idx) == {"alice": 4 * SLAB, "bob": 4 * SLAB}
    assert present(b, kept) == [True] * 16
    assert idx.tenants.own_evictions["alice"] == 4  # sizes 5-8 each freed her oldest slab


def test_adopted_blocks_count_against_their_tenant():
    idx = shared_index(0.5, slabs=2)
    a = ns_of(idx, "alice")
    got = idx.adopt(a, [(k, i * BLOCK_A) for i, k in enumerate(chain("w", 3))])
    assert all(got) and idx.tenants.usage(idx) == {"alice": SLAB}  # 3 blocks, one slab
    idx.check_integrity()


def test_the_integrity_check_catches_a_wrong_tenant_counter():
    idx = shared_index(0.5, slabs=2)
    stored(idx, ns_of(idx, "alice"), chain("x", 2))
    idx.alloc_.owner_slabs["alice"] += 1
    try:
        idx.check_integrity()
    except Exception as exc:
        assert "slabs per owner" in str(exc)
    else:
        raise AssertionError("a counter off by one byte passed the integrity check")


OPS = st.lists(st.tuples(st.sampled_from(["store", "load", "flush", "discard"]),
                         st.integers(0, 2), st.integers(0, 1), st.integers(1, 9)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([0.25, 0.5, 1.0]), OPS)
def test_counters_stay_exact_and_no_tenant_passes_its_share(share, ops):
    """Any mix of stores (two block sizes), loads, flushes and discards by three
    tenants: the slab counters equal the slabs, and with a share no tenant's
    classes hold more slabs than it."""
    idx = shared_index(share, slabs=6)
    spaces = [[ns_of(idx, t, blk, f"f{blk}") for blk in (BLOCK_A, BLOCK_B)] for t in ("t0", "t1", "t2")]
    for n, (op, t, c, size) in enumerate(ops):
        ns = spaces[t][c]
        keys = chain(f"{t}.{c}.{n % 4}", size)
        if op == "store":
            stored(idx, ns, keys, failed=[0] if size == 9 else ())
        elif op == "load":
            idx.complete_load(idx.prepare_load(ns, keys))
        elif op == "flush":
            idx.flush(ns)
        elif ns.held():
            idx.discard(next(iter(ns.all_entries().values())))
        idx.check_integrity()
        if share < 1:
            assert all(n <= idx.tenants.limit_slabs for n in idx.alloc_.owner_slabs.values())
