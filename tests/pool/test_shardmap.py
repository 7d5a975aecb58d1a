"""A large namespace's ready map in shards answers exactly what one dict answers.

Past ``SPLIT_AT`` entries the index keeps a namespace's READY entries in
``SHARDS`` dicts (``pool/shardmap.py``), so that no insert makes CPython
rebuild the whole map in one call (139 ms at 2M entries under churn). First
the map against a plain dict under any sequence of operations, then the index
and the disk index with a tiny ``SPLIT_AT``: maps move into shards as they
grow, and stores, loads, evictions, flushes and the integrity checks go on
unchanged.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from kvtier.pool import shardmap
from kvtier.pool.shardmap import SHARDS, ShardedMap, grown

from .kit import BLOCK_A, chain, make_index

KEYS = [bytes([i]) * 16 for i in range(40)]
OPS = st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "pop-default", "popitem", "update", "get"]),
                         st.integers(0, 39), st.integers(0, 5)), max_size=200)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_the_sharded_map_answers_what_a_dict_answers(ops):
    d, m = {}, ShardedMap()
    for op, k, n in ops:
        key = KEYS[k]
        if op == "set":
            d[key] = m[key] = n
        elif op == "del" and key in d:
            del d[key], m[key]
        elif op == "pop":
            assert (d.pop(key) if key in d else None) == (m.pop(key) if key in m else None)
        elif op == "pop-default":
            assert d.pop(key, "none") == m.pop(key, "none")
        elif op == "popitem":
            if d:
                got = m.popitem()
                assert d.pop(got[0]) == got[1]
            else:
                with pytest.raises(KeyError):
                    m.popitem()
        elif op == "update":
            more = [(KEYS[(k + i) % 40], n) for i in range(n)]
            d.update(more)
            m.update(more)
        assert m.get(key) == d.get(key) and (key in m) == (key in d)
        assert len(m) == len(d) and bool(m) == bool(d) and dict(m.items()) == d
    assert set(m) == set(d) and sorted(m.values()) == sorted(d.values())
    assert dict(m) == d  # dict() reads keys() and []


def test_a_map_moves_into_shards_past_split_at_and_spreads_over_them():
    small = {bytes([i]) * 16: i for i in range(10)}
    assert grown(small) is small
    big = {random.randbytes(16): i for i in range(shardmap.SPLIT_AT + 1)}
    m = grown(big)
    assert isinstance(m, ShardedMap) and dict(m.items()) == big and grown(m) is m
    # Keyed by Python's per-process hash of the key: spread, whatever the keys' bytes share.
    same_start = ShardedMap((b"\0" * 8 + i.to_bytes(8, "little"), i) for i in range(50 * SHARDS))
    assert same_start.largest_shard() < 3 * 50


def test_the_index_moves_a_growing_namespace_into_shards_and_serves_it_the_same(monkeypatch):
    monkeypatch.setattr(shardmap, "SPLIT_AT", 8)
    idx = make_index(slabs=6, events=True)  # 24 blocks
    ns = idx.namespace("model-a", BLOCK_A)
    chains = [chain(f"c{i}", 6) for i in range(8)]
    for c in chains[:3]:
        assert idx.complete_store(idx.prepare_store(ns, c)) == 6
    assert isinstance(ns.ready_map, ShardedMap) and len(ns.ready_map) == 18
    assert idx.lookup(ns, chains[1]) == 6 and idx.lookup(ns, chains[1][:3] + chains[5]) == 3
    plan = idx.prepare_load(ns, chains[2])
    assert plan.missing == [] and all(e.pins == 1 for e in plan.entries)
    for c in chains[3:]:  # evicts the oldest (not the pinned chain)
        idx.complete_store(idx.prepare_store(ns, c))
    idx.complete_load(plan)
    assert idx.evictions > 0 and idx.lookup(ns, chains[2]) == 6
    idx.check_integrity()
    ready = ns.ready_blocks()
    assert ready > 8 and idx.flush(ns) == ready  # hidden at once, freed by popitem from the shards
    assert len(ns.ready_map) == 0 and ns.held() == 0 and idx.alloc_.used_bytes == 0
    idx.check_integrity()
    removed = [k for kind, _, k in idx.take_events() if kind == "removed"]
    assert len(removed) == len(set(removed))  # every block left once


def test_the_disk_index_moves_a_namespace_into_shards_and_drains_a_flush_of_it(monkeypatch):
    from kvtier.disk.format import file_bytes
    from kvtier.disk.index import DiskEntry, DiskIndex
    monkeypatch.setattr(shardmap, "SPLIT_AT", 8)
    idx = DiskIndex(capacity=40 * file_bytes(100))
    entries = [DiskEntry("ns", bytes([i]) * 16, i + 1, 100, 0, f"/x/{i}") for i in range(30)]
    for e in entries:
        assert idx.add(e) == []
    assert isinstance(idx.entries_of("ns"), ShardedMap) and len(idx) == 30
    assert idx.remove(entries[3]) and entries[3].key not in idx.entries_of("ns")
    idx.check_integrity()
    job = idx.hide(["ns"])
    assert idx.entries_of("ns") is None and len(job.parts[0][1]) == 29
    freed = []
    while idx.flushes:
        freed += [e for _, e in idx.drain(4)]
    assert sorted(e.seq for e in freed) == sorted(e.seq for e in entries if e is not entries[3])
    idx.check_integrity()
