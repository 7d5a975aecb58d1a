"""A daemon restarted with ``warm_restart`` on keeps the node's cache: the next
daemon adopts the pool segment and the journal of committed blocks, engines
reconnect by themselves and hit at once, byte-exact. What was not committed,
what another user planted and what a changed setting no longer fits is never
adopted. Real daemon processes, real signals, real shared memory."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import warm_names
from kvtier.pool.segment import unlink_segment
from tests.conftest import REPO
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

WARM = {"KVTIER_WARM_RESTART": "1"}
OTHER_UID = 41006


@pytest.fixture
def warm(daemon_factory, tmp_path):
    """``start(**kw)``: a warm_restart daemon process on one socket for the whole test;
    the kept segments are removed at the end (no daemon unlinks them)."""
    sock = str(tmp_path / "warm.sock")
    names = warm_names(DaemonConfig(socket=sock))

    def start(env=None, **kw):
        return daemon_factory(process=True, socket=sock, env={**WARM, **(env or {})}, **kw)
    start.names, start.socket = names, sock
    yield start
    for name in names:
        unlink_segment(name)


def hashes_of(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def blocks(kv, ids):
    return [t[i].clone() for i in ids for t in kv.tensors]


def test_sigterm_restart_keeps_every_committed_block_byte_exact(warm, capsys):
    first = warm()
    kv = make_kv(seed=3)
    c = first.client(name="engine", timeout=5.0)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        hs = hashes_of(1, 16)
        assert c.store(hs, list(range(16))).wait().ok
        want = blocks(kv, range(16))
        first.stop(signal.SIGTERM)
        assert all(os.path.exists("/dev/shm" + n) for n in warm.names)  # kept, not unlinked

        second = warm()
        assert wait_for(lambda: c.connected, 10)  # the engine reconnects and re-registers alone
        w = second.stats()["warm_restart"]
        assert (w["start"], w["adopted_blocks"], w["rejected_records"]) == ("warm", 16, 0)
        assert w["adopted_at"] and w["unverified_blocks"] == 16
        assert c.lookup(hs) == 16
        for t in kv.tensors:
            t[16:32].zero_()
        assert c.load(hs, list(range(16, 32))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, blocks(kv, range(16, 32))))
        w = second.stats()["warm_restart"]
        assert (w["unverified_blocks"], w["verify_failed"]) == (0, 0)  # checked at first load
        assert "adopted 16 blocks" in second.read_log()
        from kvtier.cli import main as kvtier_cli
        assert kvtier_cli(["status", "--socket", second.socket]) == 0
        line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warm")]
        assert line and "adopted 16 blocks at" in line[0] and "0 failed verification" in line[0]
    finally:
        c.close()
        kv.close()


def test_sigkill_keeps_committed_blocks_and_never_a_store_in_flight(warm):
    # Every copy chunk stalls 1.5 s: the second store is surely in flight at the kill.
    first = warm(env={"KVTIER_COPY_DELAY_S": "1.5"})
    kv = make_kv(seed=4)
    c = first.client(name="engine", timeout=10.0)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        done, in_flight = hashes_of(2, 8), hashes_of(3, 8)
        assert c.store(done, list(range(8))).wait().ok
        want = blocks(kv, range(8))
        c.store(in_flight, list(range(8, 16)))
        assert wait_for(lambda: first.stats()["clients"][0]["inflight"] == 1, 5)
        first.stop(signal.SIGKILL)

        second = warm()
        assert wait_for(lambda: c.connected, 10)
        assert second.stats()["warm_restart"]["adopted_blocks"] == 8
        assert c.lookup(done) == 8
        assert c.lookup(in_flight) == 0
        for t in kv.tensors:
            t[16:24].zero_()
        assert c.load(done, list(range(16, 24))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want, blocks(kv, range(16, 24))))
    finally:
        c.close()
        kv.close()


def test_offloaded_requests_are_dropped_by_a_restart(warm):
    first = warm()
    kv = make_kv(seed=5)
    c = first.client(name="engine", timeout=5.0)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.offload("req-1", [1, 2, 3]).wait().ok
        first.stop(signal.SIGTERM)
        second = warm()
        assert wait_for(lambda: c.connected, 10)
        s = second.stats()
        assert s["swap"]["requests"] == 0 and s["warm_restart"]["adopted_blocks"] == 0
        assert not c.restore("req-1", [4, 5, 6]).wait(timeout=5).ok  # its owner's session died with the daemon
    finally:
        c.close()
        kv.close()


@pytest.mark.parametrize("changed, why", [({"pool_size": "32MiB"}, "pool_size changed"),
                                          ({"slab_size": "2MiB"}, "slab_size changed")])
def test_a_changed_pool_setting_starts_cold_and_replaces_the_kept_segments(warm, changed, why):
    first = warm()
    kv = make_kv(seed=6)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes_of(4, 4), list(range(4))).wait().ok
    first.stop()
    second = warm(**changed)
    w = second.stats()["warm_restart"]
    assert (w["start"], w["adopted_blocks"]) == ("cold", 0) and why in w["reason"]
    assert f"starting cold: {why}" in second.read_log()
    size = os.stat("/dev/shm" + warm.names[0]).st_size
    assert size == (32 if "pool_size" in changed else 64) * 2**20  # the new pool, not the old one
    with second.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(hashes_of(4, 4)) == 0
    kv.close()


def test_a_newer_journal_format_is_never_read(warm):
    first = warm()
    first.stop()
    with open("/dev/shm" + warm.names[1], "r+b") as f:  # a daemon from the future wrote v99
        f.seek(8)
        f.write((99).to_bytes(4, "little"))
    second = warm()
    w = second.stats()["warm_restart"]
    assert w["start"] == "cold" and "format v99" in w["reason"]


def test_turning_warm_restart_off_removes_the_kept_pool(warm, daemon_factory):
    warm().stop()
    assert all(os.path.exists("/dev/shm" + n) for n in warm.names)
    off = daemon_factory(process=True, socket=warm.socket)
    assert not any(os.path.exists("/dev/shm" + n) for n in warm.names)
    assert "warm_restart is off: removed the kept segment" in off.read_log()


PLANT = """
import sys, os, mmap, posix_ipc
sys.path.insert(0, {repo!r})
from kvtier.pool.journal import Journal, journal_bytes
from kvtier.pool.keys import ns_key
os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})
pool, jname, size = {pool!r}, {jname!r}, {size}
p = posix_ipc.SharedMemory(pool, posix_ipc.O_CREX, mode=0o600, size=size)
j = posix_ipc.SharedMemory(jname, posix_ipc.O_CREX, mode=0o600, size=journal_bytes(size))
m = mmap.mmap(p.fd, size); m[0:16384] = b"\\x66" * 16384
jm = mmap.mmap(j.fd, journal_bytes(size))
jr = Journal.create(memoryview(jm), size, 4 * 2**20)
print(jr.commit(ns_key("uid0", {fp!r}), 16384, bytes([9, 0]) * 8, 0, 0))
"""


def test_a_pool_planted_by_another_user_is_refused_and_never_adopted(warm, tmp_path):
    pool, jname = warm.names
    fp = NS.fingerprint()
    code = PLANT.format(repo=REPO, uid=OTHER_UID, pool=pool, jname=jname, size=64 * 2**20, fp=fp)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr  # a well-formed journal naming root's namespace
    assert os.stat("/dev/shm" + pool).st_uid == OTHER_UID
    d = warm()
    w = d.stats()["warm_restart"]
    assert (w["start"], w["adopted_blocks"]) == ("cold", 0)
    assert f"belongs to uid {OTHER_UID}" in w["reason"]
    st = os.stat("/dev/shm" + pool)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600  # replaced by the daemon's own
    kv = make_kv(seed=8)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup([bytes([9, 0]) * 8]) == 0
    kv.close()


def test_a_kept_pool_with_a_wider_mode_is_refused(warm):
    warm().stop()
    os.chmod("/dev/shm" + warm.names[0], 0o644)
    w = warm().stats()["warm_restart"]
    assert w["start"] == "cold" and "mode 0644" in w["reason"]


# ---- SIGKILL at random points of a store/evict stream --------------------------------------
NS2 = NS.__class__("other-model", "float16", "flashinfer", 16)


def fill(kv, block: int, h: bytes, which: int) -> None:
    """Engine block ``block`` gets the bytes block ``h`` of namespace ``which`` must have."""
    base = (int.from_bytes(h[:2], "little") * 31 + which * 7919) % 30000
    for layer, t in enumerate(kv.tensors):
        t[block].view(torch.int16).fill_(base + layer)


def holds(kv, block: int, h: bytes, which: int) -> bool:
    base = (int.from_bytes(h[:2], "little") * 31 + which * 7919) % 30000
    return all(bool((t[block].view(torch.int16) == base + layer).all()) for layer, t in enumerate(kv.tensors))


def writer(c, kv, which, stop, acked, attempted, first):
    """Store batches of fresh blocks (the same hashes in both namespaces, other bytes)
    until the daemon is gone; a 16 MiB pool keeps evicting the oldest."""
    import itertools
    for n in itertools.count(first):
        if stop.is_set():
            return
        hs = [(n * 8 + i).to_bytes(4, "little") * 4 for i in range(8)]
        for i, h in enumerate(hs):
            fill(kv, i, h, which)
        attempted.append(hs)
        try:
            r = c.store(hs, list(range(8))).wait(timeout=5)
        except TimeoutError:  # the daemon died with it in flight: never acknowledged
            return
        if not r.ok:
            return
        acked.append(hs)


def test_sigkill_at_random_points_never_yields_a_torn_or_misattributed_block(warm):
    import random
    import threading
    rng = random.Random(25)
    d = warm(pool_size="16MiB", slab_size="1MiB")
    kvs = [make_kv(), make_kv()]
    clients = [d.client(name=f"engine{i}", timeout=5.0) for i in range(2)]
    try:
        for c, kv, ns in zip(clients, kvs, (NS, NS2)):
            c.register_kv_cache(kv, [0] * 4, ns)
        adopted_total = 0
        for round_ in range(8):
            stop = threading.Event()
            acked, attempted = [[], []], [[], []]
            threads = [threading.Thread(target=writer, args=(clients[i], kvs[i], i, stop, acked[i], attempted[i],
                                                             round_ * 10**6))
                       for i in range(2)]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.2, 1.5))
            d.stop(signal.SIGKILL)  # somewhere in a store, a commit, an eviction or idle
            stop.set()
            for t in threads:
                t.join(30)
            d = warm(pool_size="16MiB", slab_size="1MiB")
            assert all(wait_for(lambda c=c: c.connected, 15) for c in clients)
            w = d.stats()["warm_restart"]  # stats() also checks the index's integrity
            assert w["start"] == "warm", w["reason"]
            adopted_total += w["adopted_blocks"]
            print(f"round {round_}: adopted {w['adopted_blocks']}, refused {w['rejected_records']}")
            for i, (c, kv) in enumerate(zip(clients, kvs)):
                found = set()
                every = [h for batch in attempted[i] for h in batch]
                for k in range(0, len(every), 24):
                    part = every[k:k + 24]
                    r = c.load(part, list(range(8, 8 + len(part)))).wait(timeout=10)
                    for j, h in enumerate(part):
                        if j not in r.failed:
                            assert holds(kv, 8 + j, h, i), f"round {round_}: block {h.hex()} of ns {i} is wrong"
                            found.add(h)
                # The last acknowledged batch is the most recent: it must have been kept.
                if acked[i]:
                    assert set(acked[i][-1]) <= found, f"round {round_}: an acknowledged store was lost"
            w = d.stats()["warm_restart"]
            assert w["verify_failed"] == 0  # no torn bytes ever reached the journal
        assert adopted_total > 0
    finally:
        for c in clients:
            c.close()
        for kv in kvs:
            kv.close()


# ---- tenancy across a restart ------------------------------------------------------------
def test_adopted_blocks_keep_their_tenant_and_are_never_served_to_another(tmp_path):
    """The victim's tenant ("team", two uids) stores; the daemon restarts warm. Its
    teammate loads the exact bytes from the adopted pool; another user with the same
    fingerprint and hashes gets 0 hits and no bytes."""
    import shutil
    import tempfile

    from tests.conftest import DaemonProc
    from tests.daemon.test_tenants import ATTACKER, FRIEND, VICTIM, finish_victim, lines, start_victim, worker
    if os.geteuid() != 0:
        pytest.skip("cross-user isolation needs root to run workers as other uids")
    run = tempfile.mkdtemp(prefix="kvt-warm-")
    os.chmod(run, 0o755)
    sock = os.path.join(run, "kvtier.sock")
    env = {**WARM, "KVTIER_SOCKET_MODE": "666", "KVTIER_TENANTS": f"team:{VICTIM},{FRIEND}"}
    d = DaemonProc(tmp_path, env=env, socket=sock)
    try:
        v, stored = start_victim(sock, VICTIM)
        finish_victim(v)
        d.stop(signal.SIGTERM)
        d = DaemonProc(tmp_path, env=env, socket=sock)
        s = d.stats()
        assert s["warm_restart"]["adopted_blocks"] == 4
        assert [(n["tenant"], n["blocks"]) for n in s["namespaces"]] == [("team", 4)]
        other = lines(worker("reader", sock, ATTACKER))["read"]
        assert (other["hits"], other["loaded"]) == (0, 0)
        friend = lines(worker("reader", sock, FRIEND))["read"]
        assert (friend["hits"], friend["loaded"]) == (4, 4) and friend["digest"] == stored["digest"]
    finally:
        d.stop()
        for name in warm_names(DaemonConfig(socket=sock)):
            unlink_segment(name)
        shutil.rmtree(run, ignore_errors=True)


RUN_AS = """
import os, sys
sys.path.insert(0, {repo!r})
import kvtier.daemon.main, kvtier.daemon.server, kvtier.remote.bridge, logging.handlers, json  # all, while root
os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})
sys.exit(kvtier.daemon.main.main(sys.argv[1:]))
"""


def start_warm_daemon_as(uid: int, sock: str, log) -> subprocess.Popen:
    """A warm-restart daemon running as ``uid`` on ``sock`` (64 MiB pool), once its socket
    exists; its output goes to ``log``. Fails with the log if it exited instead."""
    p = subprocess.Popen([sys.executable, "-c", RUN_AS.format(repo=REPO, uid=uid), "--socket", sock,
                          "--pool-size", "64MiB", "--slab-size", "4MiB", "--gpu", "off"],
                         env={**os.environ, **WARM, "PYTHONPATH": REPO}, stdout=log, stderr=subprocess.STDOUT)
    assert wait_for(lambda: os.path.exists(sock) or p.poll() is not None, 60)
    assert p.poll() is None, open(log.name).read()
    return p


def test_a_name_held_by_another_user_does_not_stop_an_unprivileged_daemon(tmp_path, monkeypatch):
    """Run as its own user, the daemon cannot remove a segment another user planted
    under its kept pool's name (/dev/shm is sticky): it refuses it and runs with a
    pid-named pool and no warm restart, instead of not starting."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the daemon and the planter as other uids")
    import shutil
    import tempfile
    daemon_uid = 41008
    run = tempfile.mkdtemp(prefix="kvt-warm-uid-")  # /tmp/pytest-of-root is root's only
    os.chown(run, daemon_uid, daemon_uid)
    sock = os.path.join(run, "kvtier.sock")
    pool, jname = warm_names(DaemonConfig(socket=sock), uid=daemon_uid)
    code = PLANT.format(repo=REPO, uid=OTHER_UID, pool=pool, jname=jname, size=64 * 2**20, fp=NS.fingerprint())
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).returncode == 0
    log = open(tmp_path / "daemon.log", "w")
    p = start_warm_daemon_as(daemon_uid, sock, log)
    try:
        from kvtier.client import Client
        monkeypatch.setenv("KVTIER_DAEMON_USER", str(daemon_uid))  # the client trusts that daemon's socket
        with Client(sock, name="probe", timeout=10) as c:
            s = c.stats()
        assert s["warm_restart"] == {"enabled": False}
        assert os.stat("/dev/shm" + pool).st_uid == OTHER_UID  # untouched, never read
        text = (tmp_path / "daemon.log").read_text()
        assert "refusing the kept pool" in text and "running without warm restart" in text
        assert f"pool /kvtier-pool.{p.pid}" in text
    finally:
        p.terminate()
        p.wait(30)
        log.close()
        for name in (pool, jname):
            unlink_segment(name)
        shutil.rmtree(run, ignore_errors=True)
