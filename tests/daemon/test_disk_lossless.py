"""The disk tier loses nothing it was given without saying so: every block a
store committed reaches the disk once the write backlog drains (its bytes
load back exact from the files alone), a block that does not is counted with
its reason, a daemon SIGKILLed with blocks still waiting serves each block
right or not at all after a warm restart, and the disk drops the files used
least recently, not the oldest written. Real daemons, real files."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tests.daemon.test_disk_tier import block_files, chain, disk_env, scanned
from tests.daemon.test_reaping import wait_for
from tests.daemon.test_warm_restart import warm  # noqa: F401  (the fixture)
from tests.helpers import NS, block_bytes, make_kv

BLOCK = 16 * 1024  # tests.helpers SHAPE: 4 layers x 4 KiB per engine block
PER_FILE = 4096 + BLOCK


def store_chains(c, kv, tags) -> dict:
    """Store a 32-block chain per tag back to back (each with bytes of its own); hash -> bytes."""
    want = {}
    for tag in tags:
        for t in kv.tensors:
            t.add_(1)
        hs = chain(tag, 32)
        assert c.store(hs, list(range(32))).wait().ok
        want.update(zip(hs, (block_bytes(kv, [i]) for i in range(32))))
    return want


def drained(d) -> dict:
    def done():
        s = d.stats()["disk"]
        return s["backlog_blocks"] == 0 and s["queued_bytes"] == 0 and s["warm_waiting"] == 0
    assert wait_for(done, 60)
    return d.stats()["disk"]


def loads_back(d, kv, tags, want, exact: bool) -> int:
    """Load each chain; every block is byte-exact or failed (``exact``: none may fail). Blocks served."""
    served = 0
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in tags:
            hs = chain(tag, 32)
            for t in kv.tensors:
                t.zero_()
            bad = set(c.load(hs, list(range(32))).wait().failed)
            assert not (exact and bad), (tag, sorted(bad))
            for i, k in enumerate(hs):
                got = block_bytes(kv, [i])
                if i in bad:
                    assert all(not g.any() for g in got)  # nothing copied into a failed block
                else:
                    assert all(torch.equal(a, b) for a, b in zip(got, want[k])), (tag, i)
                    served += 1
    return served


def test_every_committed_block_is_on_disk_once_the_backlog_drains_and_loads_back_exact(daemon_factory, tmp_path):
    """192 blocks stored back to back: more than the write-behind queue (a quarter of the 8 MiB
    pool, 128 blocks) holds, so some wait in the backlog; none is dropped for it."""
    env = disk_env(tmp_path / "disk")
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=21)
    d = daemon_factory(process=True, socket=sock, env=env, pool_size="8MiB", slab_size="1MiB")
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        want = store_chains(c, kv, range(1, 7))
    s = drained(d)
    assert (s["written"], s["blocks"], s["not_written"]) == (192, 192, {})
    d.stop(signal.SIGTERM)
    cold = daemon_factory(process=True, socket=sock, env=env, pool_size="8MiB", slab_size="1MiB")
    assert scanned(cold) and cold.stats()["pool"]["blocks"] == 0  # every byte below comes from the files
    assert loads_back(cold, kv, range(1, 7), want, exact=True) == 192


def test_a_flood_past_the_disk_is_counted_block_by_block_never_dropped_silently(daemon_factory, tmp_path):
    """A 2 MiB pool (128 blocks) takes 640 blocks back to back: RAM evicts blocks before the disk
    reaches them. Every committed block is written or counted in ``not_written`` with its reason."""
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tmp_path / "disk"))
    kv = make_kv(seed=22)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        store_chains(c, kv, range(1, 21))
    s = drained(d)
    lost = sum(n for why in s["not_written"].values() for n in why.values())
    assert s["written"] + lost == 640
    assert set(why for t in s["not_written"].values() for why in t) <= {"evicted", "backlog_full"}


def test_a_daemon_sigkilled_with_a_backlog_serves_each_block_right_or_not_at_all(warm, tmp_path):  # noqa: F811
    """Chains are stored until the status shows blocks still waiting for the disk, then the
    daemon is SIGKILLed. The next one (warm restart: the kept pool, and the files) serves
    each block byte-exact or fails it; never another block's bytes or a torn one."""
    env = disk_env(tmp_path / "disk")
    first = warm(env=env, pool_size="4MiB", slab_size="1MiB")
    kv = make_kv(seed=23)
    want, tags = {}, []
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(1, 41):
            want.update(store_chains(c, kv, [tag]))
            tags.append(tag)
            if first.stats()["disk"]["backlog_blocks"]:
                break
    first.stop(signal.SIGKILL)
    second = warm(env=env, pool_size="4MiB", slab_size="1MiB")
    assert scanned(second)
    assert loads_back(second, kv, tags, want, exact=False) > 0
    assert second.stats()["disk"]["rejected"] == 0  # no torn file was indexed either


def test_what_a_sigkilled_daemon_left_unwritten_is_written_after_a_warm_restart_or_counted(
        warm, daemon_factory, tmp_path):  # noqa: F811
    """SIGKILLed with blocks still waiting for the disk; the first chain's files are deleted
    too, so at least 32 kept blocks are certainly not on disk. The warm restart re-queues
    every adopted block the disk lacks once its scan is done: written + not_written (with a
    reason) + already on disk == adopted. Then a cold daemon (the kept pool discarded) loads
    every block on disk byte-exact from the files alone, and the written ones are among them."""
    root = tmp_path / "disk"
    env = disk_env(root)
    first = warm(env=env, pool_size="4MiB", slab_size="1MiB")
    kv = make_kv(seed=25)
    want, tags = {}, []
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(1, 8):  # 224 blocks: all in the 256-block pool, so all kept
            want.update(store_chains(c, kv, [tag]))
            tags.append(tag)
            if tag >= 3 and first.stats()["disk"]["backlog_blocks"]:
                break
    first.stop(signal.SIGKILL)
    gone = {k.hex() for k in chain(tags[0], 32)}
    for f in block_files(root):
        if os.path.basename(f).rpartition("-")[0] in gone:
            os.unlink(f)

    second = warm(env=env, pool_size="4MiB", slab_size="1MiB")
    assert scanned(second)
    s = drained(second)
    adopted = second.stats()["warm_restart"]["adopted_blocks"]
    lost = sum(n for why in s["not_written"].values() for n in why.values())
    assert adopted == 32 * len(tags) and s["warm_adopted"] == adopted
    assert s["warm_requeued"] >= 32 and s["written"] + lost == s["warm_requeued"]
    assert s["warm_on_disk"] + s["written"] + lost == adopted
    assert s["blocks"] == adopted - lost
    second.stop(signal.SIGTERM)

    cold = daemon_factory(process=True, socket=warm.socket, env=env, pool_size="4MiB", slab_size="1MiB")
    assert scanned(cold) and cold.stats()["pool"]["blocks"] == 0  # every byte below comes from the files
    assert loads_back(cold, kv, tags, want, exact=not lost) == adopted - lost


@pytest.mark.parametrize("policy,left", [("lru", [32, 0, 32, 32]), ("fifo", [0, 32, 32, 32])])
def test_the_disk_drops_files_in_the_pools_policy_order_a_lookup_hit_counts_under_lru(daemon_factory, tmp_path,
                                                                                       policy, left):
    """Room for 96 files: chains A, B, C fill it. After a restart (all on disk only) a lookup
    hits A; a fourth chain then makes room. Under ``lru`` it drops B, the least recently
    used, not A, the oldest written; under ``fifo`` files go in write order whatever was
    used, so A goes. (A lookup over the socket: one the lookup mirror answers refreshes
    no recency, the load that follows does.)"""
    env = disk_env(tmp_path / "disk", str(96 * PER_FILE), lookup_index="false", policy=policy)
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=24)
    first = daemon_factory(process=True, socket=sock, env=env)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        store_chains(c, kv, [1, 2, 3])
    assert drained(first)["blocks"] == 96
    first.stop(signal.SIGTERM)
    d = daemon_factory(process=True, socket=sock, env=env)
    assert scanned(d)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(chain(1, 32)) == 32  # from the disk: a use under lru only
        store_chains(c, kv, [4])
        assert drained(d)["dropped"] == 32
        assert [c.lookup(chain(tag, 32)) for tag in (1, 2, 3, 4)] == left
