"""A Connection and the caches registered on it: what one link to the daemon
carries for several Clients, across a daemon that comes and goes."""

from __future__ import annotations

import os
import signal

import pytest

from kvtier.client import Client, Connection, KVTierError, Namespace
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

WINDOW = Namespace("tiny-llama", "float16", "flashinfer", 16, extra="group1")
BLOCK = 16 * 1024  # one block of make_kv()'s cache


def caches(daemon) -> dict[str, int | None]:
    (row,) = [c for c in daemon.stats()["clients"] if c["name"] == "engine"]
    return {q["namespace"]: q["swap_quota"] for q in row["caches"]}


def test_caches_registered_before_the_daemon_came_keep_their_own_quotas_after_each_reconnect(daemon_factory, tmp_path):
    """Two caches register on a connection opened while no daemon runs (the
    engine starts first): nothing is sent, nothing raises. When a daemon
    comes, the connection's one keeper registers both, each with the swap
    quota it asked for once; a restarted daemon gets the same again."""
    socket = str(tmp_path / "later.sock")
    conn = Connection(socket, name="engine", timeout=2.0, require_daemon=False)
    full, window = make_kv(seed=1), make_kv(seed=2)
    a, b = Client(connection=conn), Client(connection=conn)
    try:
        assert not conn.connected and conn.registrations == [a, b]
        assert a.register_kv_cache(full, [0] * 4, NS, swap_quota=2 * BLOCK) is None
        assert b.register_kv_cache(window, [0] * 4, WINDOW, swap_quota=0) is None

        first = daemon_factory(process=True, socket=socket)
        assert wait_for(lambda: a.connected and b.connected, 20)
        assert caches(first) == {NS.fingerprint(): 2 * BLOCK, WINDOW.fingerprint(): 0}
        assert a.offload("r", [0, 1]).wait().ok and not b.offload("r", [0]).wait().ok

        first.stop(signal.SIGKILL)
        assert wait_for(lambda: not conn.connected, 10)
        second = daemon_factory(process=True, socket=socket)
        assert wait_for(lambda: a.connected and b.connected, 20)
        assert caches(second) == {NS.fingerprint(): 2 * BLOCK, WINDOW.fingerprint(): 0}
        assert conn.reconnects == 2
    finally:
        assert b.close() and a.close()
        full.close()
        window.close()
    assert conn.closed and conn.registrations == []


def test_a_closed_connection_takes_no_new_cache(daemon):
    """Hostile use: a Client on a connection whose last cache closed it gets
    a typed error at once, not a socket that is gone."""
    conn = Connection(daemon.socket, name="engine")
    a = Client(connection=conn)
    assert a.close() and conn.closed
    with pytest.raises(KVTierError):
        Client(connection=conn)
    with pytest.raises(KVTierError):
        a.share()
    assert os.path.exists(daemon.socket) and daemon.stats()["clients"] == []
