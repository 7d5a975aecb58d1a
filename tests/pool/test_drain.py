"""A flush spread over steps: what it names is hidden at once, freed a slice at a time,
and everything else the index does meanwhile stays exact."""

from __future__ import annotations

import random

from kvtier.pool import BlockIndex, SlabAllocator

from .kit import SLAB, chain, make_index, stored

BLOCK = 1024


def big_index(slabs: int = 64) -> BlockIndex:
    return BlockIndex(SlabAllocator(slabs * SLAB, SLAB), events=True)


def test_a_flush_hides_every_block_at_once_and_frees_them_over_steps():
    """After start nothing flushed is found; each step frees at most its budget;
    once done the pool's bytes are back where they were before the stores."""
    idx = big_index()
    ns = idx.namespace("a", BLOCK)
    base = idx.alloc_.used_bytes
    keys = chain("a", 600)
    assert stored(idx, ns, keys) == 600
    job = idx.start_flush([ns])
    assert idx.lookup(ns, keys) == 0 and idx.ready_entries(ns, keys) == []
    assert all(e is None for e in idx.prepare_load(ns, keys).entries)
    steps = 0
    while not job.done:
        before = ns.held()
        idx.drains.step(100)
        assert before - ns.held() <= 100
        idx.check_integrity()
        steps += 1
    assert steps == 6 and job.removed == 600
    assert idx.alloc_.used_bytes == base and not ns.held() and not ns.hidden
    removed = [k for kind, _, k in idx.take_events() if kind == "removed"]
    assert sorted(removed) == sorted(keys)  # in the map's order: nothing sees a hidden map


def test_blocks_stored_during_a_flush_survive_it_and_hidden_keys_are_stored_anew():
    idx = big_index()
    ns, other = idx.namespace("a", BLOCK), idx.namespace("b", BLOCK)
    old, theirs = chain("old", 300), chain("theirs", 50)
    stored(idx, ns, old)
    stored(idx, other, theirs)
    job = idx.start_flush([ns])
    idx.drains.step(10)
    new = chain("new", 40)
    assert stored(idx, ns, new) == 40            # new keys land
    assert stored(idx, ns, old[:20]) == 20       # hidden keys are written again, not skipped
    assert idx.lookup(ns, old) == 20             # the re-stored head is found again, the rest not
    while not job.done:
        idx.drains.step(7)
        idx.check_integrity()
    assert idx.lookup(ns, new) == 40 and idx.lookup(ns, old[:20]) == 20 and idx.lookup(ns, old[20:]) == 0
    assert idx.lookup(other, theirs) == 50
    assert job.removed == 300  # the 20 re-stored keys were taken by the flush too


def test_a_block_a_load_holds_survives_the_flush_like_before():
    idx = big_index()
    ns = idx.namespace("a", BLOCK)
    keys = chain("a", 50)
    stored(idx, ns, keys)
    load = idx.prepare_load(ns, keys[:5])
    assert idx.flush(ns) == 45
    assert idx.lookup(ns, keys) == 5  # held, so kept (and visible again)
    idx.complete_load(load)
    assert idx.flush(ns) == 5 and not ns.held()
    idx.check_integrity()


def test_eviction_and_a_second_flush_while_hidden_keep_the_books_straight():
    """Seeded random interleaving: stores, loads, flushes of either namespace or all,
    steps of random size and evictions (a small pool), checked after every operation."""
    rng = random.Random(7)
    idx = make_index(slabs=8, events=True)  # 32 blocks of 4 KiB: stores evict
    nss = [idx.namespace("a", 4096), idx.namespace("b", 4096)]
    jobs, loads = [], []
    for _ in range(3000):
        op = rng.random()
        ns = rng.choice(nss)
        if op < 0.35:
            plan = idx.prepare_store(ns, chain(f"c{rng.randrange(5)}", rng.randint(1, 12)))
            idx.complete_store(plan, [] if rng.random() < 0.9 else [0])
        elif op < 0.45:
            loads.append(idx.prepare_load(ns, chain(f"c{rng.randrange(5)}", rng.randint(1, 6))))
        elif op < 0.55 and loads:
            idx.complete_load(loads.pop(rng.randrange(len(loads))))
        elif op < 0.62:
            jobs.append(idx.start_flush(nss if rng.random() < 0.3 else [ns]))
        else:
            idx.drains.step(rng.randint(1, 9))
        idx.check_integrity()
        for n in nss:  # what a lookup finds is ready and visible, a prefix of the chain
            keys = chain(f"c{rng.randrange(5)}", 12)
            hits = idx.lookup(n, keys)
            assert all(idx.is_ready(e) for e in idx.ready_entries(n, keys[:hits]))
    while idx.drains.pending:
        idx.drains.step(5)
    for plan in loads:
        idx.complete_load(plan)
    assert all(j.done and 0 <= j.removed <= j.hidden for j in jobs)
    idx.flush()
    idx.check_integrity()
    assert idx.alloc_.used_bytes == 0
