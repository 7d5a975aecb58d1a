"""The daemon dies under load and comes back: clients degrade, then recover alone."""

from __future__ import annotations

import os
import signal
import time

import torch

from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv, pool_segments


def test_clients_survive_a_daemon_kill_and_reconnect(daemon_factory):
    first = daemon_factory(process=True)
    kv = make_kv(seed=7)
    hashes = [bytes([i]) * 16 for i in range(16)]
    c = first.client(name="engine", timeout=2.0)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, list(range(16))).wait().ok
        assert c.lookup(hashes) == 16
        pending = c.load(hashes, list(range(16, 32)))  # may or may not finish before the kill

        # SIGKILL: no drain, no cleanup. The pool segment is left behind.
        (pool_segment,) = pool_segments(first.proc.pid)
        first.stop(signal.SIGKILL)
        assert os.path.exists(pool_segment)
        killed = time.monotonic()

        # The engine keeps working: every call returns within its timeout and
        # degrades to misses / failed blocks; nothing raises.
        assert pending.wait(timeout=10).done in (0, 16)
        t = time.monotonic()
        assert c.lookup(hashes) == 0
        r = c.store(hashes, list(range(16))).wait(timeout=5)
        assert r.failed == tuple(range(16)) and r.error
        r = c.load(hashes, list(range(16))).wait(timeout=5)
        assert r.failed == tuple(range(16))
        assert c.offload("req", [1, 2]).wait(timeout=5).failed_requests == ("req",)
        c.discard("req")
        assert time.monotonic() - t < 6.0
        assert wait_for(lambda: not c.connected, 5)
        detect_s = time.monotonic() - killed

        # A new daemon on the same socket: stale segment removed, client back by itself.
        spawned = time.monotonic()
        second = daemon_factory(process=True, socket=first.socket)
        ready = time.monotonic()
        assert not os.path.exists(pool_segment)
        assert wait_for(lambda: c.connected, 10)
        recovery_s, startup_s = time.monotonic() - ready, ready - spawned
        assert c.reconnects == 1
        # The registration was replayed: the new (empty) pool works for this engine.
        assert c.lookup(hashes) == 0
        assert c.store(hashes, list(range(16))).wait().ok
        for t_ in kv.tensors:
            t_[16:32].zero_()
        assert c.load(hashes, list(range(16, 32))).wait().ok
        assert all(torch.equal(t_[:16], t_[16:32]) for t_ in kv.tensors)
        names = [x["name"] for x in second.stats()["clients"]]
        assert names == ["engine"]
        print(f"\nloss detected after {detect_s:.2f}s; new daemon ready after {startup_s:.2f}s, "
              f"client back {recovery_s:.2f}s after that")
    finally:
        c.close()
        kv.close()


def test_client_started_before_the_daemon_connects_later(daemon_factory, tmp_path):
    from kvtier.client import Client
    sock = str(tmp_path / "late.sock")
    kv = make_kv(seed=1)
    c = Client(sock, name="early", timeout=1.0, require_daemon=False)
    try:
        assert not c.connected
        assert c.register_kv_cache(kv, [0] * 4, NS) is None  # remembered for later
        assert c.lookup([b"x" * 16]) == 0
        daemon_factory(process=True, socket=sock)
        assert wait_for(lambda: c.connected, 10)
        assert c.store([b"x" * 16], [3]).wait().ok
        assert c.lookup([b"x" * 16]) == 1
    finally:
        c.close()
        kv.close()
