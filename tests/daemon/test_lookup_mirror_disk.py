"""With the disk tier on, the lookup mirror says "hit" for every block a load
would serve: ready in RAM or on disk. A block evicted from RAM but on disk is
a mirror hit and loads back byte-exact; once the disk drops it too it is a
miss; a flush clears both tiers; a daemon started on a disk that holds blocks
(warm start) mirrors them. Real daemons, real disk directories, real engine
memory; the mirror's answer always equals the daemon's own."""

from __future__ import annotations

import hashlib

import torch

from kvtier.protocol import messages as m
from kvtier.protocol.arrays import pack_hashes
from tests.daemon.test_disk_tier import disk_env, scanned, written
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, block_bytes, make_kv


def daemon_answer(client, hashes) -> int:
    return client.channel.call(m.Lookup(client.registration.reg, pack_hashes(hashes))).hits


def chain(tag: int, n: int) -> list[bytes]:
    """Digests as an engine makes them (the mirror's buckets are picked by their bits)."""
    return [hashlib.blake2b(bytes([tag]) + i.to_bytes(4, "little"), digest_size=16).digest() for i in range(n)]


def evict_ram(d, c, tags):
    """Store other chains until the small pool evicted the older ones, each let reach the disk."""
    for tag in tags:
        assert c.store(chain(tag, 32), list(range(32))).wait().ok
        assert wait_for(lambda: d.stats()["disk"]["queued_bytes"] == 0)


def test_a_block_evicted_from_ram_is_a_mirror_hit_until_the_disk_drops_it_too(daemon_factory, tmp_path):
    # 2 MiB pool = 128 blocks; the disk about 250: each tier evicts in turn.
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB",
                       env=disk_env(tmp_path / "disk", "4MiB", lookup_index="true"))
    kv = make_kv(seed=3)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c._mirror is not None  # the disk tier no longer turns the mirror off
        assert d.stats()["lookup_index"]["enabled"]
        hs = chain(1, 32)
        assert c.store(hs, list(range(32))).wait().ok
        want = block_bytes(kv, range(32))
        assert written(d, 32)
        evict_ram(d, c, range(100, 104))
        assert d.stats()["pool"]["evictions"] >= 32
        assert c._mirror.ready_prefix(pack_hashes(hs)) == 32  # the mirror alone: on disk only
        assert c.lookup(hs) == daemon_answer(c, hs) == 32
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, list(range(32))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(32))))
        # Newer chains push it out of RAM and, past 4 MiB of files, off the disk too.
        evict_ram(d, c, range(110, 122))
        assert d.stats()["disk"]["dropped"] > 0
        assert c._mirror.ready_prefix(pack_hashes(hs)) == daemon_answer(c, hs) == 0
        newest = chain(121, 32)
        assert c._mirror.ready_prefix(pack_hashes(newest)) == daemon_answer(c, newest) == 32
    kv.close()


def test_a_flush_clears_the_mirror_of_both_tiers(daemon_factory, tmp_path):
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB",
                       env=disk_env(tmp_path / "disk", "16MiB", lookup_index="true"))
    kv = make_kv(seed=4)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hs = chain(2, 32)
        assert c.store(hs, list(range(32))).wait().ok
        assert written(d, 32)
        evict_ram(d, c, range(100, 104))  # the head of the chain on disk only, newer chains in both
        assert c._mirror.ready_prefix(pack_hashes(hs)) == 32
        c.flush()
        assert wait_for(lambda: d.stats()["disk"]["blocks"] == 0)
        for tags in ([2], range(100, 104)):
            for tag in tags:
                h = chain(tag, 32)
                assert c._mirror.ready_prefix(pack_hashes(h)) == daemon_answer(c, h) == 0
    kv.close()


def test_a_daemon_started_on_a_full_disk_mirrors_what_the_disk_holds(daemon_factory, tmp_path):
    env = disk_env(tmp_path / "disk", "16MiB", lookup_index="true")
    kv = make_kv(seed=5)
    hs = chain(3, 16)
    first = daemon_factory(env=env)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(16))).wait().ok
        assert written(first, 16)
    want = block_bytes(kv, range(16))
    first.stop()
    d = daemon_factory(env=env)  # a cold RAM pool: the blocks are on disk only
    assert scanned(d)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c._mirror.ready_prefix(pack_hashes(hs + chain(4, 2))) == 16
        assert c.lookup(hs) == daemon_answer(c, hs) == 16
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, list(range(16))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(16))))
    kv.close()
