"""The index's fast paths answer exactly what the slow definitions answer:
ready prefixes found by bisection, the LRU order (linked or keyed), slots
handed out as ascending runs."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.pool import LRUPolicy, SlabAllocator
from kvtier.pool.entry import Entry
from kvtier.pool.policy import KeyedLRUPolicy
from kvtier.pool.index import ready_prefix

from .kit import BLOCK_A, SLAB, chain, make_index, stored


def linear_prefix(ready: dict, keys: list) -> int:
    n = 0
    while n < len(keys) and keys[n] in ready:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=40), extra=st.lists(st.integers(0, 39), max_size=5))
def test_ready_prefix_is_exact_for_any_pattern_of_holes(flags, extra):
    """Any keys, ready or not in any pattern (holes mid-chain, keys that are no
    chain, repeats): the bisection's answer equals the linear walk's."""
    keys = [f"k{i}".encode() for i in range(len(flags))] + [f"k{i}".encode() for i in extra]
    ready = {k: ("entry", k) for k, f in zip(keys, flags) if f}
    found = ready_prefix(ready, keys)
    n = linear_prefix(ready, keys)
    assert len(found) == n and found == [ready[k] for k in keys[:n]]


def test_lookup_sees_a_hole_left_by_a_discarded_block():
    idx = make_index(slabs=4)
    ns = idx.namespace("model-a", BLOCK_A)
    keys = chain("c", 10)
    stored(idx, ns, keys)
    idx.discard(ns.entry(keys[3]))  # a checksum failure drops a block mid-chain
    assert idx.lookup(ns, keys) == 3
    idx.check_integrity()


@pytest.mark.parametrize("kind", [LRUPolicy, KeyedLRUPolicy])
def test_lru_order_is_an_ordered_dicts_under_random_use(kind):
    """insert / touch / touch_chain / remove in any mix, with candidates() read
    part way: the linked order (links in the entries) and the keyed one (an
    ordered dict, the tenants' orders) keep the order an OrderedDict with
    move_to_end keeps."""
    rng = random.Random(5)
    p, ref = kind(), OrderedDict()
    items = [Entry(None, bytes([i]) * 16, 0) for i in range(30)]
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            x = rng.choice(items)
            p.insert(x)
            ref[x] = None
            ref.move_to_end(x)
        elif op < 0.5:
            x = rng.choice(items)
            p.touch(x)
            if x in ref:
                ref.move_to_end(x)
        elif op < 0.75:
            chain_ = [x for x in rng.sample(items, rng.randint(1, 8)) if x in ref]
            p.touch_chain(chain_)
            for x in reversed(chain_):  # the head ends most recent
                ref.move_to_end(x)
        elif op < 0.95:
            x = rng.choice(items)
            p.remove(x)
            ref.pop(x, None)
        else:
            got = list(itertools.islice(p.candidates(), 3))  # a walk stopped part way
            assert got == list(ref)[:3]
        if step % 50 == 0:
            assert list(p.candidates()) == list(ref) and len(p) == len(ref)
    assert list(p.candidates()) == list(ref)


def test_slots_come_back_ascending_after_frees():
    """Freed slots are reused lowest first, so a batch allocated after frees is
    one ascending run that the copy routine moves as a unit."""
    a = SlabAllocator(4 * SLAB, SLAB)
    cls = a.add_class(BLOCK_A)  # 4 slots per slab
    offs = a.alloc_many(cls, 4)
    assert offs == [0, 4096, 8192, 12288]
    for off in reversed(offs[1:3]):  # freed in descending order
        a.free(off)
    assert a.alloc_many(cls, 2) == [4096, 8192]
    a.check_integrity()


def test_a_batch_fills_the_current_slab_then_takes_the_next():
    a = SlabAllocator(4 * SLAB, SLAB)
    cls = a.add_class(BLOCK_A)
    assert a.alloc_many(cls, 6) == [0, 4096, 8192, 12288, SLAB, SLAB + 4096]
    assert a.alloc_many(cls, 20) == [SLAB + 8192, SLAB + 12288] + [2 * SLAB + i * 4096 for i in range(4)] \
        + [3 * SLAB + i * 4096 for i in range(4)]  # fewer than asked: the pool is full
    a.check_integrity()


def test_a_store_into_a_full_pool_evicts_in_one_batch_oldest_first():
    """Making room for a chain of 4 evicts the 4 oldest blocks of the class in
    one walk, in eviction order, and the new chain lands as one ascending run."""
    idx = make_index(slabs=2, events=True)
    ns = idx.namespace("model-a", BLOCK_A)
    old = chain("old", 8)
    stored(idx, ns, old)
    idx.take_events()
    plan = idx.prepare_store(ns, chain("new", 4))
    removed = [k for kind, _, k in idx.take_events() if kind == "removed"]
    assert removed == old[::-1][:4]  # the tail is oldest: suffixes go first
    offs = [e.offset for e in plan.entries]
    assert offs == sorted(offs) and offs == list(range(offs[0], offs[0] + 4 * BLOCK_A, BLOCK_A))
    idx.complete_store(plan)
    idx.check_integrity()
