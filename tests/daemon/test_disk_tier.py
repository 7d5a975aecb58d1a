"""The disk tier keeps what the RAM pool cannot: blocks go to files under
``disk_path`` as they are stored, stay lookup hits after RAM evicted them,
load back byte-exact, and survive the daemon. Real daemons (restarted as
processes for real), real files, real engine memory."""

from __future__ import annotations

import os
import signal
import stat

import msgpack
import pytest
import torch
import zmq

from tests.daemon.test_reaping import wait_for
from tests.daemon.test_warm_restart import warm  # noqa: F401  (the fixture)
from tests.helpers import NS, block_bytes, make_kv

BLOCK = 16 * 1024  # tests.helpers SHAPE: 4 layers x 4 KiB per engine block


def disk_env(path, size="64MiB", **extra) -> dict:
    return {"KVTIER_DISK_PATH": str(path), "KVTIER_DISK_SIZE": size,
            **{"KVTIER_" + k.upper(): str(v) for k, v in extra.items()}}


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def written(d, n: int) -> bool:
    """``n`` blocks written in all, and the loop has taken the writes back (the queue is free)."""
    def done():
        s = d.stats()["disk"]
        return s["written"] >= n and s["queued_bytes"] == 0
    return wait_for(done, 20)


def scanned(d) -> bool:
    return wait_for(lambda: not d.stats()["disk"]["scanning"], 20)


def block_files(root) -> list[str]:
    return sorted(os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".kvb"))


def evict_ram(d, c, tags):
    """Store other chains until the small pool has evicted everything older; each
    is let reach the disk (a store while the write-behind queue is full is not written)."""
    for tag in tags:
        assert c.store(chain(tag, 32), list(range(32))).wait().ok
        assert wait_for(lambda: d.stats()["disk"]["queued_bytes"] == 0)


def test_blocks_evicted_from_ram_stay_hits_and_load_back_byte_exact(daemon_factory, tmp_path):
    # 2 MiB pool = 128 blocks; the disk holds 4x more.
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tmp_path / "disk", "16MiB"))
    kv = make_kv(seed=1)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hs = chain(1, 32)
        assert c.store(hs, list(range(32))).wait().ok
        want = block_bytes(kv, range(32))
        assert written(d, 32)
        evict_ram(d, c, range(100, 108))
        s = d.stats()
        assert s["pool"]["evictions"] >= 32 and s["disk"]["blocks"] > 128  # more than RAM holds
        assert c.lookup(hs) == 32  # answered from the disk index
        ns = d.stats()["namespaces"][0]
        assert ns["disk_hits"] == 32
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, list(range(32))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(32))))
        s = d.stats()["disk"]
        assert (s["read"], s["rejected"], s["loaded"]) == (32, 0, 32)
        assert s["read_direct"] == (32 if s["o_direct"] else 0)  # by DMA into the pool where the fs allows
        assert c.lookup(hs) == 32  # back in RAM now
    for f in block_files(tmp_path / "disk"):
        st = os.stat(f)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(tmp_path / "disk").st_mode) == 0o700


def test_a_load_mixing_ram_and_disk_blocks_gets_both_and_a_prefix_load_reads_the_disk_part(daemon_factory,
                                                                                          tmp_path):
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tmp_path / "disk", "16MiB"))
    kv = make_kv(seed=2)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        old, new = chain(1, 16), chain(2, 16)
        assert c.store(old, list(range(16))).wait().ok
        want_old = block_bytes(kv, range(16))
        assert written(d, 16)
        evict_ram(d, c, range(100, 106))
        assert c.store(new, list(range(16, 32))).wait().ok  # in RAM
        want_new = block_bytes(kv, range(16, 32))
        for t in kv.tensors:
            t.zero_()
        r = c.load(old + new, list(range(32))).wait()
        assert r.ok and r.done == 32
        assert all(torch.equal(a, b) for a, b in zip(want_old + want_new, block_bytes(kv, range(32))))
        evict_ram(d, c, range(110, 116))
        for t in kv.tensors:
            t.zero_()
        r = c.load(old, list(range(16)), prefix=True).wait()
        assert r.ok and r.done == 16
        assert all(torch.equal(a, b) for a, b in zip(want_old, block_bytes(kv, range(16))))


def test_two_engines_loading_the_same_disk_prefix_at_once_both_get_it_read_once(daemon_factory, tmp_path):
    env = disk_env(tmp_path / "disk", "16MiB", disk_threads=1)
    kv = make_kv(seed=7)
    hs = chain(7, 32)
    first = daemon_factory(env=env)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(32))).wait().ok
        assert written(first, 32)
    want = block_bytes(kv, range(32))
    first.stop()
    d = daemon_factory(env=env)  # RAM empty: the prefix is on disk only
    assert scanned(d)
    kv_a, kv_b = make_kv(), make_kv()
    with d.client(name="a") as a, d.client(name="b") as b:
        a.register_kv_cache(kv_a, [0] * 4, NS)
        b.register_kv_cache(kv_b, [0] * 4, NS)
        ha, hb = a.load(hs, list(range(32))), b.load(hs, list(range(32)))  # the second while the first reads
        assert ha.wait().ok and hb.wait().ok
        for kv_x in (kv_a, kv_b):
            assert all(torch.equal(x, y) for x, y in zip(want, block_bytes(kv_x, range(32))))
    assert d.stats()["disk"]["read"] == 32  # one read per block, shared by both loads
    kv_a.close()
    kv_b.close()


def test_disk_blocks_survive_sigterm_and_sigkill_of_the_daemon(daemon_factory, tmp_path):
    env = disk_env(tmp_path / "disk")
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=3)
    hs = chain(3, 32)
    first = daemon_factory(process=True, socket=sock, env=env)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(32))).wait().ok
        assert written(first, 32)
    want = block_bytes(kv, range(32))
    first.stop(signal.SIGTERM)
    for how in (signal.SIGKILL, signal.SIGTERM):
        d = daemon_factory(process=True, socket=sock, env=env)  # a cold RAM pool: only the disk has them
        assert scanned(d)
        assert d.stats()["disk"]["blocks"] == 32 and d.stats()["pool"]["blocks"] == 0
        with d.client(name="engine") as c:
            c.register_kv_cache(kv, [0] * 4, NS)
            assert c.lookup(hs) == 32
            for t in kv.tensors:
                t.zero_()
            assert c.load(hs, list(range(32))).wait().ok
            assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(32))))
        assert "32 blocks" in d.read_log()
        d.stop(how)


def test_disk_size_bounds_the_files_and_drops_the_oldest_first(daemon_factory, tmp_path):
    per_file = 4096 + BLOCK
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tmp_path / "disk", str(64 * per_file)))
    kv = make_kv(seed=4)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(1, 5):  # 4 x 32 blocks into room for 64
            assert c.store(chain(tag, 32), list(range(32))).wait().ok
            assert written(d, 32 * tag)
        s = d.stats()["disk"]
        assert s["used_bytes"] <= 64 * per_file and s["blocks"] == 64 and s["dropped"] == 64
        assert wait_for(lambda: len(block_files(tmp_path / "disk")) == 64)
        c.flush()  # RAM and disk: only what the disk kept could be a hit now
        assert c.lookup(chain(1, 32)) == 0 and c.lookup(chain(2, 32)) == 0
    assert d.stats()["disk"]["blocks"] == 0
    assert wait_for(lambda: not block_files(tmp_path / "disk"))


def test_disk_keeps_newest_after_restart_with_a_smaller_disk_size(daemon_factory, tmp_path):
    sock = str(tmp_path / "d.sock")
    per_file = 4096 + BLOCK
    kv = make_kv(seed=5)
    d = daemon_factory(process=True, socket=sock, env=disk_env(tmp_path / "disk"))
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(chain(1, 32), list(range(32))).wait().ok
        assert written(d, 32)
        for tag in (2, 3):
            assert c.store(chain(tag, 32), list(range(32))).wait().ok
            assert written(d, 32 * tag)
    d.stop()
    d = daemon_factory(process=True, socket=sock, env=disk_env(tmp_path / "disk", str(64 * per_file)))
    assert scanned(d)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert [c.lookup(chain(tag, 32)) for tag in (1, 2, 3)] == [0, 32, 32]
    assert wait_for(lambda: len(block_files(tmp_path / "disk")) == 64)


def test_status_metrics_and_events_cover_the_disk_tier_and_the_mirror_stays_on(daemon_factory, tmp_path, capsys):
    events = "ipc://" + str(tmp_path / "events.sock")
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", extra=["--events", events],
                       env=disk_env(tmp_path / "disk", "16MiB", lookup_index=1))
    # The lookup mirror holds disk blocks too (tests/daemon/test_lookup_mirror_disk.py).
    assert d.stats()["lookup_index"]["enabled"]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, NS.fingerprint().encode())
    sub.connect(events)
    kv = make_kv(seed=6)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hs = chain(1, 8)
        for _ in range(200):  # until the subscription is live: each store sends events
            assert c.store(hs, list(range(8))).wait().ok
            if sub.poll(50):
                break
            c.flush()
        assert written(d, 8)
        kinds = set()
        while sub.poll(500) and "disk_stored" not in kinds:
            _, body = sub.recv_multipart()
            kinds |= {k for k, _ in msgpack.unpackb(body)["events"]}
        assert "disk_stored" in kinds
    from kvtier.cli import main as kvtier_cli
    assert kvtier_cli(["status", "--socket", d.socket]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("disk")]
    assert line and str(tmp_path / "disk") in line[0] and "8 blocks" in line[0]
    from kvtier.daemon.metrics import SnapshotCollector
    names = {f.name for f in SnapshotCollector(lambda: d.stats()).collect()}
    assert {"kvtier_disk_used_bytes", "kvtier_disk_blocks_written", "kvtier_disk_enospc",
            "kvtier_disk_namespace_bytes"} <= names
    sub.close()


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_disk_path_other_users_can_write_is_refused(tmp_path, mode):
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.listen import UnfitConfig
    from kvtier.daemon.server import Daemon
    path = tmp_path / "disk"
    path.mkdir()
    os.chmod(path, mode)
    config = DaemonConfig(socket=str(tmp_path / "d.sock"), pool_size=4 * 2**20, slab_size=2**20,
                          disk_path=str(path), disk_size=2**24)
    with pytest.raises(UnfitConfig, match="lets group or others write"):
        Daemon(config)
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)  # no sticky bit: anyone could rename the directory away
    config = DaemonConfig(socket=str(tmp_path / "e.sock"), pool_size=4 * 2**20, slab_size=2**20,
                          disk_path=str(open_parent / "disk"), disk_size=2**24)
    with pytest.raises(UnfitConfig, match="writable by every user"):
        Daemon(config)


def restart_and_load(daemon_factory, root, kv, hs, ns=NS, **env) -> dict:
    """Store ``hs`` into engine blocks 0.., restart on the same disk, load them into the
    next blocks: byte-exact; the disk section of the stats after."""
    n = len(hs)
    first = daemon_factory(env=disk_env(root, "16MiB", **env))
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), ns)
        assert c.store(hs, list(range(n))).wait().ok
        assert written(first, n)
    want = block_bytes(kv, range(n))
    first.stop()
    d = daemon_factory(env=disk_env(root, "16MiB", **env))
    assert scanned(d)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), ns)
        assert c.lookup(hs) == n
        assert c.load(hs, list(range(n, 2 * n))).wait().ok
    assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(n, 2 * n))))
    return d.stats()["disk"]


def test_blocks_of_a_size_o_direct_cannot_read_load_buffered_and_byte_exact(daemon_factory, tmp_path):
    from kvtier.client import Namespace
    odd = Namespace("odd-model", "float16", "flashinfer", 16)
    kv = make_kv(shape=(32, 2, 16, 1, 24), layers=3, seed=8)  # 3 x 1,536 bytes: not a multiple of 4 KiB
    s = restart_and_load(daemon_factory, tmp_path / "disk", kv, chain(8, 16), odd)
    assert s["o_direct"] and (s["read"], s["read_direct"]) == (16, 0)
    kv.close()


def test_with_warm_restart_a_block_read_back_from_disk_is_kept_in_ram_across_a_sigkill(warm, tmp_path):
    """Both tiers on: the kept pool and the disk files are independent. A block RAM evicted is
    read back from disk, journaled as a store would be, and the next daemon (after SIGKILL)
    adopts it in RAM without touching the disk again."""
    env = disk_env(tmp_path / "disk", "16MiB")
    first = warm(env=env, pool_size="2MiB", slab_size="1MiB")
    kv = make_kv(seed=11)
    hs = chain(11, 16)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(16))).wait().ok
        want = block_bytes(kv, range(16))
        assert written(first, 16)
        evict_ram(first, c, range(120, 126))
        assert c.lookup(hs) == 16 and first.stats()["disk"]["read"] == 0
        assert c.load(hs, list(range(16, 32))).wait().ok  # from disk, back into the pool
        assert first.stats()["disk"]["read"] == 16
    first.stop(signal.SIGKILL)
    second = warm(env=env, pool_size="2MiB", slab_size="1MiB")
    assert scanned(second)
    with second.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, list(range(16))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(16))))
    s = second.stats()
    assert s["disk"]["read"] == 0 and s["warm_restart"]["verify_failed"] == 0  # all 16 from the kept pool
    assert s["warm_restart"]["adopted_blocks"] >= 16
