"""The disk tier against a hung disk, a namespace cycler and a tenant that keeps
the disk busy (issue 30, rows 6, 8, 9): a load waiting on another load's hung
read obeys the disk deadline and counts toward its user's transfer cap; a
tenant's namespaces are bounded in every tier and leave no empty directory
behind; and a committed block is never dropped because another tenant filled
the write-behind queue. Real daemons, a real disk directory, a FIFO standing
in for a hung disk file, real other uids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import zmq

from kvtier.protocol import ErrorCode, decode, encode, pack_hashes, pack_ids
from kvtier.protocol import messages as m
from tests.conftest import REPO, DaemonProc
from tests.daemon.test_bad_input import ask, code_of, hello_and_register
from tests.daemon.test_disk_attacks import file_of, needs_root, restarted, store_to_disk
from tests.daemon.test_disk_tier import chain, disk_env, scanned, written
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, block_bytes, make_kv

VICTIM, ATTACKER = 41031, 41032
WORKER = os.path.join(REPO, "tests", "daemon", "disk_worker.py")


def hang(root, key: bytes) -> str:
    """The block's file becomes a FIFO: opening it blocks until a writer comes (a read stuck in the kernel)."""
    fifo = file_of(root, key)
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    return fifo


def answer(fifo: str) -> None:
    """The hung disk answers at last."""
    threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()


def namespace_dirs(root) -> list[str]:
    return sorted(d for d in os.listdir(root) if d != "tmp")


# ---- row 6: loads waiting on a hung read ------------------------------------------------------
@needs_root
def test_a_load_joining_a_hung_read_is_answered_at_the_disk_deadline_not_the_clients(daemon_factory, tmp_path):
    """The first load of a hung block is answered at ``disk_timeout_s``; a second
    load of the same block, arriving after that deadline, must not wait on the
    hung read until the client gives up (before: the client's 8 s transfer
    timeout cancelled it): it is answered by the daemon, those blocks failed."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=0.5)
    kv = make_kv(seed=61)
    hs = chain(61, 4)
    d0 = daemon_factory(env=env)
    store_to_disk(d0, kv, hs)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = hang(root, hs[0])
    with d.client(name="engine", transfer_timeout=8.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        first = c.load(hs, list(range(4))).wait()
        assert sorted(first.failed) == [0, 1, 2, 3] and first.error == ""  # the daemon's answer
        began = time.monotonic()
        second = c.load(hs, list(range(4, 8))).wait()
        assert sorted(second.failed) == [0, 1, 2, 3]
        s = d.stats()["disk"]
        print(f"\nsecond load answered after {time.monotonic() - began:.2f}s, fail_fast {s['fail_fast']}")
        # Failed by the daemon as blocks behind a stuck read (before: held until the client cancelled it).
        assert s["fail_fast"] == 4
        assert s["loads_waiting"] == 0 and s["reads_in_flight"] == 1
        answer(fifo)
        assert wait_for(lambda: d.stats()["disk"]["reads_in_flight"] == 0)


@needs_root
def test_loads_waiting_on_a_hung_read_count_toward_the_users_transfer_cap(daemon_factory, tmp_path):
    """``max_transfers_per_user`` 4, and 200 loads of a block whose read hangs
    (its deadline far away): before, all 200 sat in the daemon (loads waiting
    for a disk read were not counted); now 4 wait, the other 196 are refused
    ``OVER_LIMIT`` at once, and once the disk answers the user's cap is free again."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=60, max_transfers_per_user=4)
    kv = make_kv(seed=62)
    hs, other = chain(62, 4), chain(63, 4)
    d0 = daemon_factory(env=env)
    store_to_disk(d0, kv, hs + other)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = hang(root, hs[0])
    with d.client(name="engine", transfer_timeout=120.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        handles = [c.load(hs, list(range(4))) for _ in range(200)]
        wait_for(lambda: sum(h.done() for h in handles) >= 196, 10)
        refused = [h for h in handles if h.done()]
        waiting = d.stats()["disk"]["loads_waiting"]
        print(f"\nloads waiting on the hung read: {waiting} of 200 (cap 4); refused at once: {len(refused)}")
        assert waiting == 4 and len(refused) == 196
        assert all("max_transfers_per_user" in h.wait().error for h in refused)  # OVER_LIMIT
        answer(fifo)
        rest = [h.wait() for h in handles if h not in refused]
        assert len(rest) == 4 and all(sorted(r.failed) == [0] for r in rest)  # the FIFO's block fails, the other three load
        assert c.load(other, list(range(4, 8))).wait().ok  # the user's cap is free again


# ---- row 8: namespaces in every tier -------------------------------------------------------------
def test_cycling_namespaces_leaves_no_empty_directories_behind(daemon_factory, tmp_path):
    """A tenant registers, stores to disk and flushes 20 namespaces in turn:
    each flush empties its namespace's directory, and the directory goes too
    (before: 20 empty directories stayed, one per namespace ever used)."""
    root = tmp_path / "disk"
    d = daemon_factory(env=disk_env(root, "16MiB"))
    kv = make_kv(seed=81)
    for i in range(20):
        with d.client(name=f"cycle-{i}") as c:
            c.register_kv_cache(kv, [0] * 4, f"cycle-{i}")
            assert c.store(chain(80, 2), [0, 1]).wait().ok
            assert written(d, 2 * (i + 1))
            assert c.flush(f"cycle-{i}") == 2
    assert wait_for(lambda: namespace_dirs(root) == [])
    print(f"\nnamespace directories left after cycling 20 namespaces: {len(namespace_dirs(root))}")
    assert d.stats()["disk"]["blocks"] == 0  # and the bridge forgot every namespace (integrity check)


def test_a_tenants_namespaces_are_bounded_on_disk_too(daemon_factory, tmp_path):
    """``max_namespaces_per_user`` 3. A tenant fills 3 namespaces, the daemon
    restarts (RAM empty, the files stay), and it registers 3 new ones: before,
    each was allowed (only RAM namespaces counted) and the disk held 6 of its
    namespaces; now each new one drops the tenant's oldest disk-only namespace,
    so the disk holds its 3 newest and their directories only."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", max_namespaces_per_user=3)
    kv = make_kv(seed=82)

    def fill(d, names):
        for name in names:
            with d.client(name=name) as c:
                c.register_kv_cache(kv, [0] * 4, name)
                assert c.store(chain(82, 2), [0, 1]).wait().ok
        assert written(d, 2 * len(names))
    d0 = daemon_factory(env=env)
    fill(d0, ["old-0", "old-1", "old-2"])
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fill(d, ["new-0", "new-1", "new-2"])
    rows = d.stats()["disk"]["namespaces"]
    print(f"\nthe tenant's namespaces on disk: {len(rows)} (cap 3)")
    assert sorted(r["fingerprint"] for r in rows) == ["new-0", "new-1", "new-2"]
    assert wait_for(lambda: len(namespace_dirs(root)) == 3)
    with d.client(name="reader") as c:
        c.register_kv_cache(kv, [0] * 4, "new-0")
        assert c.lookup(chain(82, 2)) == 2


# ---- row 9: the write-behind queue against another tenant ---------------------------------------
def run_as(role: str, sock: str, uid: int, tag: int, n: int) -> dict:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    p = subprocess.run([sys.executable, WORKER, role, sock, str(uid), str(tag), str(n)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


@needs_root
def test_another_tenant_filling_the_write_queue_loses_none_of_the_victims_blocks(tmp_path):
    """The disk is busy (one I/O thread, held by a hung read standing in for a
    stream of reads), the attacker (uid 41032) stores 128 blocks, filling the
    write-behind queue (a quarter of a 4 MiB pool: 64 blocks), then the victim
    (uid 41031) stores 64. Before, the victim's blocks found the queue full and
    were never written: after a restart 0 of 64 hit. Now they wait in the
    victim's own backlog, are written once the disk answers, and all 64 load
    back byte-exact from disk after a restart."""
    run = tempfile.mkdtemp(prefix="kvt-disk-trust-")
    os.chmod(run, 0o755)
    root = tmp_path / "disk"
    env = {"KVTIER_SOCKET_MODE": "666", **disk_env(root, "64MiB", disk_threads=1, disk_timeout_s=60)}
    sock = os.path.join(run, "kvtier.sock")

    def start():
        d = DaemonProc(tmp_path, pool_size="4MiB", slab_size="1MiB", env=env, socket=sock)
        assert scanned(d)
        return d
    try:
        d = start()
        kv = make_kv(seed=91)
        hs = chain(91, 4)
        store_to_disk(d, kv, hs)
        d.stop()
        d = start()
        fifo = hang(root, hs[0])
        with d.client(name="reader", transfer_timeout=120.0) as c:
            c.register_kv_cache(kv, [0] * 4, NS)
            stuck = c.load(hs, list(range(4)))  # the only I/O thread now waits on the FIFO
            assert wait_for(lambda: d.stats()["disk"]["reads_in_flight"] == 1)
            for tag in (1, 2):
                assert run_as("store", sock, ATTACKER, tag, 64)["done"] == 64
            stored = run_as("store", sock, VICTIM, 3, 64)
            assert stored["done"] == 64  # the store's reply never waits for the disk
            s = d.stats()["disk"]
            print(f"\nwhile the disk is busy: queued {s['queued_bytes']} of {s['queue_bytes']} bytes, "
                  f"backlog {s.get('backlog_blocks')} blocks, not written {s.get('not_written')}")
            answer(fifo)
            stuck.wait()
            assert wait_for(lambda: (lambda s: s["queued_bytes"] == 0 and not s.get("backlog_blocks"))(
                d.stats()["disk"]), 30)
        d.stop()
        d = start()
        got = run_as("read", sock, VICTIM, 3, 64)
        d.stop()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    print(f"victim's blocks on disk after the restart: {got['hits']} of 64")
    assert (got["hits"], got["loaded"], got["digest"]) == (64, 64, stored["digest"])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))


# ---- a load the disk held goes back to the load path, not to the dispatch point ----------------
@needs_root
def test_a_load_whose_cache_closes_while_the_disk_reads_gets_a_typed_error_and_the_daemon_serves_on(
        daemon_factory, tmp_path):
    """A load waiting on a (hung) disk read is handed back to the load path when the
    disk answers (daemon/pending.py), checked once on the way in. Hostile input: a
    bad load is refused before anything is read; a load whose cache is unregistered
    while it waits is answered ``UNKNOWN_NAMESPACE`` under its own request id, typed,
    never a crash; afterwards a fresh client loads the blocks the disk read byte-exact
    (the FIFO that stood in for block 0 was no block file: it is gone, that block fails)."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=60)
    kv = make_kv(seed=64)
    hs = chain(64, 4)
    d0 = daemon_factory(env=env)
    want = store_to_disk(d0, kv, hs)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = hang(root, hs[0])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect("ipc://" + d.socket)
    try:
        reg = hello_and_register(sock, kv, d.socket)
        _, reply = ask(sock, encode(m.Load(reg, pack_hashes(hs), pack_ids(range(4)), skip=5), 3))
        assert code_of(reply) == ErrorCode.BAD_ARGUMENT
        assert d.stats()["disk"]["reads_in_flight"] == 0  # refused before any read
        sock.send(encode(m.Load(reg, pack_hashes(hs), pack_ids(range(4))), 4))  # waits on the hung read
        assert wait_for(lambda: d.stats()["disk"]["loads_waiting"] == 1)
        assert isinstance(ask(sock, encode(m.Unregister(reg), 5))[1], m.Ok)
        answer(fifo)
        rid, reply = decode(sock.recv())
        assert rid == 4 and code_of(reply) == ErrorCode.UNKNOWN_NAMESPACE
        assert d.stats()["disk"]["loads_waiting"] == 0
    finally:
        sock.close(0)
    fresh = make_kv(seed=65)
    with d.client(name="engine") as c:
        c.register_kv_cache(fresh, [0] * 4, NS)
        r = c.load(hs, list(range(4))).wait()
        assert r.failed == (0,) and r.done == 3
        layers = len(fresh.tensors)
        assert all(torch.equal(a, b) for a, b in zip(want[layers:], block_bytes(fresh, range(1, 4))))
    assert d.stats()["disk"]["rejected"] == 1  # and the daemon still answers
