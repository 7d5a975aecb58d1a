"""Eviction under pressure: pinned blocks survive, counters stay consistent."""

from __future__ import annotations

import torch

from tests.helpers import NS, make_kv

BLOCK = 16 * 1024  # tests.helpers SHAPE: 4 layers x 4 KiB per engine block


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def test_pressure_never_evicts_pinned_blocks(daemon_factory):
    # 4 MiB pool in 1 MiB slabs = 256 blocks of 16 KiB; copies stall so pins are held.
    d = daemon_factory(pool_size="4MiB", slab_size="1MiB", env={"KVTIER_COPY_DELAY_S": "0.3"})
    kv_a, kv_b = make_kv(seed=1), make_kv(seed=2)
    with d.client(name="a") as a, d.client(name="b") as b:
        a.register_kv_cache(kv_a, [0] * 4, NS)
        b.register_kv_cache(kv_b, [0] * 4, NS)
        old = chain(1, 200)
        assert a.store(old, [i % 32 for i in range(200)]).wait().ok
        expect = [t[:32].clone() for t in kv_a.tensors]
        for t in kv_a.tensors:
            t.zero_()
        # A loads the first 32 blocks: they are pinned while the copy is stalled.
        loading = a.load(old[:32], list(range(32)))
        # B stores 200 new blocks: only 56 are free, so 144 must be evicted -
        # from the 168 unpinned old blocks, never from the 32 being loaded.
        stored = b.store(chain(2, 200), [i % 32 for i in range(200)]).wait()
        assert stored.ok and stored.done == 200
        result = loading.wait()
        assert result.ok, result
        assert all(torch.equal(e, t[:32]) for e, t in zip(expect, kv_a.tensors))
        assert a.lookup(old[:32]) == 32
        s = d.stats()  # runs the integrity check
        ns = s["namespaces"][0]
        assert ns["evicted"] == 144 and ns["blocks"] == 256
        assert s["pool"]["used_bytes"] == 256 * BLOCK and s["pool"]["free_bytes"] == 0
    kv_a.close()
    kv_b.close()


def test_full_pool_of_pinned_blocks_reports_no_space(daemon_factory):
    d = daemon_factory(pool_size="1MiB", slab_size="1MiB", env={"KVTIER_COPY_DELAY_S": "0.5"})
    kv = make_kv(seed=4)
    with d.client() as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        full = chain(3, 64)
        assert c.store(full, [i % 32 for i in range(64)]).wait().ok
        loading = c.load(full[:32], list(range(32)))
        # Half the pool is pinned; a 40-block store finds room for 32 only.
        r = c.store(chain(4, 40), [i % 32 for i in range(40)]).wait()
        assert r.no_space and r.done == 32 and r.failed == tuple(range(32, 40))
        assert loading.wait().ok
        assert d.stats()["namespaces"][0]["store_failed"] == 8
    kv.close()
