"""The entry at a pool offset is found in a list per slab, whatever the slab held before.

A slab's row of entries outlives the slab's blocks; when the slab comes back
in a size class with another slot count its row is made anew, and a slot a
swap block held is found empty. Slab eviction, which asks the map for every
used slot of a slab, must see exactly the entries living there.
"""

from __future__ import annotations

import pytest

from kvtier.pool.slots import SlotMap

from .kit import BLOCK_A, BLOCK_B, chain, make_index, present, stored


def entries_at(idx, ns, keys):
    return [idx.slots.get(ns.entry(k).offset) is ns.entry(k) for k in keys]


def test_a_slab_that_comes_back_in_another_size_class_maps_its_new_entries():
    idx = make_index(slabs=1)
    small = idx.namespace("small", BLOCK_A)   # 4 per slab
    big = idx.namespace("big", BLOCK_B)       # 2 per slab
    assert stored(idx, small, chain("a", 4)) == 4
    assert entries_at(idx, small, chain("a", 4)) == [True] * 4
    # The big blocks need the only slab: the small ones are evicted as a whole slab.
    assert stored(idx, big, chain("b", 2)) == 2
    assert present(small, chain("a", 4)) == [False] * 4
    assert entries_at(idx, big, chain("b", 2)) == [True] * 2
    assert len(idx.slots) == 2 and idx.slots.count() == 2
    # And back: the small class takes the slab again, through the slab eviction walk.
    assert stored(idx, small, chain("c", 4)) == 4
    assert entries_at(idx, small, chain("c", 4)) == [True] * 4 and present(big, chain("b", 2)) == [False] * 2
    idx.check_integrity()


def test_a_slab_back_in_a_class_of_the_same_slot_count_but_another_stride_maps_its_entries():
    idx = make_index(slabs=1)
    odd = idx.namespace("odd", 4097)    # stride 4,352: 3 per 16 KiB slab
    wide = idx.namespace("wide", 5000)  # stride 5,120: 3 per slab too, at other offsets
    assert stored(idx, odd, chain("o", 3)) == 3
    assert stored(idx, wide, chain("w", 3)) == 3  # the row is reused: same length
    assert sorted(wide.entry(k).offset for k in chain("w", 3)) == [0, 5120, 10240]
    assert entries_at(idx, wide, chain("w", 3)) == [True] * 3 and present(odd, chain("o", 3)) == [False] * 3
    assert stored(idx, odd, chain("o2", 3)) == 3  # and slab eviction reads the wide entries right
    idx.check_integrity()


def test_a_slot_a_swap_block_holds_is_empty_in_the_map_and_keeps_its_slab():
    idx = make_index(slabs=2)
    ns = idx.namespace("m", BLOCK_A)
    big = idx.namespace("big", BLOCK_B)
    swap = idx.alloc_for(ns, 2)  # swap takes its slots from the same class, outside the map
    idx.pinned_offsets.update(swap)  # as pool/swap.py holds them
    assert all(idx.slots.get(off) is None for off in swap)
    assert stored(idx, ns, chain("p", 6)) == 6  # 2 beside the swap blocks, 4 in the other slab
    # Slab eviction for the big class: the slab of 4 prefix blocks goes, the one with swap stays.
    assert stored(idx, big, chain("b", 4)) == 2
    assert present(ns, chain("p", 6)).count(True) == 2
    assert {idx.alloc_.slab_of(ns.entry(k).offset) for k in chain("p", 6) if present(ns, [k])[0]} == \
        {idx.alloc_.slab_of(swap[0])}
    for off in swap:  # the swap blocks leave: now that slab can go too
        idx.pinned_offsets.discard(off)
        idx.free(off)
    assert stored(idx, big, chain("c", 2)) == 2  # the older blocks' slab: the small ones'
    assert present(ns, chain("p", 6)) == [False] * 6 and present(big, chain("b", 2) + chain("c", 2)) == [True] * 4
    assert entries_at(idx, big, chain("b", 2) + chain("c", 2)) == [True] * 4
    idx.check_integrity()


def test_the_map_refuses_a_second_entry_at_one_offset_and_a_pop_of_an_empty_slot():
    idx = make_index(slabs=1)
    ns = idx.namespace("m", BLOCK_A)
    assert stored(idx, ns, chain("x", 1)) == 1
    off = ns.entry(chain("x", 1)[0]).offset
    with pytest.raises(KeyError):
        idx.slots.add(off, object())
    free = idx.alloc_for(ns, 1)[0]
    with pytest.raises(KeyError):
        idx.slots.pop(free)
    assert isinstance(idx.slots, SlotMap) and len(idx.slots) == 1
