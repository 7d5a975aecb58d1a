"""A seeded random workload over two namespaces, checked after every step.

The test keeps its own model from the event stream (stored / removed) and
from the plans it holds open, and compares it with the index each step: the
set of READY keys, pins, in-flight entries, allocator bytes and counters.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvtier.pool import READY, WRITING, IntegrityError
from kvtier.pool.entry import NATIVE, PIN_MAX

from .kit import BLOCK_A, BLOCK_B, chain, make_index

OPS = ["store"] * 4 + ["complete"] * 4 + ["load"] * 3 + ["unpin"] * 3 + ["lookup"] * 2 + ["flush"]


class Workload:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.idx = make_index(slabs=6, events=True)  # 24 A-blocks or 12 B-blocks
        self.nss = [self.idx.namespace("model-a", BLOCK_A), self.idx.namespace("model-b", BLOCK_B)]
        self.ready = {ns.key: set() for ns in self.nss}
        self.stores, self.loads = [], []
        self.tally = Counter()

    def random_chain(self):
        # Few tags and short chains so stores overlap, dedup and extend prefixes.
        return chain(f"t{self.rng.randrange(6)}", self.rng.randint(1, 8))

    def step(self, op: str) -> None:
        rng, idx = self.rng, self.idx
        ns = rng.choice(self.nss)
        if op == "store":
            keys = self.random_chain()
            plan = idx.prepare_store(ns, keys)
            self.check_store_plan(plan, keys)
            self.stores.append(plan)
        elif op == "complete" and self.stores:
            plan = self.stores.pop(rng.randrange(len(self.stores)))
            written = [i for i, e in enumerate(plan.entries) if e is not None]
            mode = rng.choice(["ok", "ok", "failed", "abandoned"])
            failed = rng.sample(written, rng.randint(0, len(written))) if mode == "failed" else []
            plan.abandoned = mode == "abandoned"
            expect = 0 if plan.abandoned else len(written) - len(failed)
            assert idx.complete_store(plan, failed) == expect
        elif op == "load":
            self.loads.append(idx.prepare_load(ns, self.random_chain()))
        elif op == "unpin" and self.loads:
            idx.complete_load(self.loads.pop(rng.randrange(len(self.loads))))
        elif op == "lookup":
            keys = self.random_chain()
            expect = 0
            while expect < len(keys) and keys[expect] in self.ready[ns.key]:
                expect += 1
            assert idx.lookup(ns, keys) == expect
        elif op == "flush":
            self.tally["flushed"] += idx.flush(ns if rng.random() < 0.7 else None)

    def check_store_plan(self, plan, keys) -> None:
        written = sum(e is not None for e in plan.entries)
        assert written + len(plan.skipped) + len(plan.no_space) == len(keys)
        self.tally["no_space"] += len(plan.no_space)
        if plan.no_space:  # once out of room, every later new key is no_space too
            first = plan.no_space[0]
            assert all(e is None for e in plan.entries[first:])

    def apply_events(self) -> None:
        for kind, fp, k in self.idx.take_events():
            self.tally[kind] += 1
            self.tally[kind, fp] += 1
            if kind == "stored":
                assert k not in self.ready[fp], "stored twice without a removal"
                self.ready[fp].add(k)
            else:
                assert k in self.ready[fp], "removed a block that was never announced"
                self.ready[fp].remove(k)

    def check(self) -> None:
        idx = self.idx
        idx.check_integrity()
        self.apply_events()
        for ns in self.nss:
            assert self.ready[ns.key] == {k for k, e in ns.all_entries().items() if e.state == READY}
            assert ns.ready_blocks() == len(self.ready[ns.key])  # kept as a counter
            assert ns.stats["stored"] == self.tally["stored", ns.key]
        # Every open plan still owns what it holds: pinned blocks are READY and
        # were not evicted or flushed; in-flight blocks are still WRITING.
        pins = Counter(id(e) for p in self.loads for e in p.entries if e is not None)
        for ns in self.nss:
            for e in ns.all_entries().values():
                assert e.pins == pins.get(id(e), 0)
        for p in self.loads:
            assert all(e is None or p.ns.entry(e.key) is e for e in p.entries)
        for p in self.stores:
            assert all(e is None or (p.ns.entry(e.key) is e and e.state == WRITING)
                       for e in p.entries)
        assert idx.alloc_.used_bytes == sum(ns.held() * ns.block_bytes for ns in self.nss)
        # Every removal is an eviction or a flush, and evictions are counted per namespace.
        assert self.tally["removed"] == idx.evictions + self.tally["flushed"]
        assert idx.evictions == sum(ns.stats["evicted"] for ns in self.nss)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_stays_consistent(seed):
    w = Workload(seed)
    for _ in range(1500):
        w.step(w.rng.choice(OPS))
        w.check()
    # Drain: finish every plan, then flush; the pool must come back empty.
    while w.stores:
        w.idx.complete_store(w.stores.pop())
    while w.loads:
        w.idx.complete_load(w.loads.pop())
    w.tally["flushed"] += w.idx.flush()
    w.check()
    assert w.idx.alloc_.used_bytes == 0 and all(not ns.held() for ns in w.nss)
    # The workload must actually have exercised pressure, not just the happy path.
    assert w.idx.evictions > 20 and w.tally["no_space"] > 0 and w.tally["flushed"] > 0


@pytest.mark.parametrize("seed", [4, 5])
def test_random_workload_stays_consistent_with_its_ready_maps_in_shards(seed, monkeypatch):
    """The same workload with maps moved into shards past 2 entries (pool/shardmap.py)."""
    from kvtier.pool import shardmap
    monkeypatch.setattr(shardmap, "SPLIT_AT", 2)
    w = Workload(seed)
    sharded = 0
    for _ in range(1500):
        w.step(w.rng.choice(OPS))
        w.check()
        sharded += any(isinstance(ns.ready_map, shardmap.ShardedMap) for ns in w.nss)
    w.tally["flushed"] += w.idx.flush()
    w.check()
    assert sharded > 500 and w.idx.evictions > 20 and w.tally["flushed"] > 0


def _some_entry(idx):
    return next(iter(idx.namespaces["model-a"].all_entries().values()))


@pytest.mark.parametrize("corrupt", [
    lambda idx: idx.policy.remove(_some_entry(idx)),             # READY entry lost by policy
    lambda idx: idx.slots.pop(_some_entry(idx).offset),          # offset map out of step
    pytest.param(lambda idx: setattr(_some_entry(idx), "pins", -1),  # unpinned once too often
                 marks=pytest.mark.skipif(NATIVE, reason="a native entry cannot hold negative pins (below)")),
    lambda idx: idx.alloc_.alloc(0),                             # a block nobody accounts for
    lambda idx: setattr(idx.namespaces["model-a"], "ready", 2),  # ready counter out of step
    lambda idx: idx.namespaces["model-a"].writing.update(       # an entry in two maps at once
        {_some_entry(idx).key: _some_entry(idx)}),
    lambda idx: setattr(_some_entry(idx), "lp", None),           # linked out of the LRU order alone
])
def test_index_integrity_check_catches_corruption(corrupt):
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    idx.complete_store(idx.prepare_store(ns, chain("p", 3)))
    idx.check_integrity()
    corrupt(idx)
    with pytest.raises(IntegrityError) as err:
        idx.check_integrity()
    assert "counters=" in str(err.value) and "'ready': 3" in str(err.value)


@pytest.mark.skipif(not NATIVE, reason="the compiled index (kvtier/pool/_native.c) is not built")
def test_a_native_entry_refuses_pins_it_cannot_hold_and_keeps_the_ones_it_has():
    idx = make_index()
    ns = idx.namespace("model-a", BLOCK_A)
    idx.complete_store(idx.prepare_store(ns, chain("p", 3)))
    e = _some_entry(idx)
    for bad in (-1, PIN_MAX + 1):
        with pytest.raises(OverflowError):
            e.pins = bad
    assert e.pins == 0
    e.pins = PIN_MAX
    with pytest.raises(OverflowError):
        e.pins += 1
    assert e.pins == PIN_MAX and e.state == READY
    e.pins = 0
    idx.check_integrity()
