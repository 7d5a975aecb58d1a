"""Several caches on one connection (``Client.share``): a hybrid model's KV
cache groups, each in its own namespace, cost one connection per process."""

from __future__ import annotations

import signal

import pytest
import torch

from kvtier.client import KVTierError, Namespace
from kvtier.protocol.errors import ErrorCode
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, block_bytes, make_kv

WINDOW = Namespace("tiny-llama", "float16", "flashinfer", 16, extra="group1")
HASHES = [bytes([i]) * 16 for i in range(8)]
SWAP_BLOCK = 16 * 1024  # one block of make_kv()'s cache: 4 layers x 2 x 16 tokens x 2 heads x 32 x fp16


def equal(kv, a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(block_bytes(kv, a), block_bytes(kv, b)))


def clients_of(daemon) -> list[dict]:
    return [c for c in daemon.stats()["clients"] if c["name"] == "engine"]


def two_caches(a, seed: int):
    """A hybrid engine's two groups: ``a`` registers a full-attention cache in NS,
    a Client shared from it a window cache in WINDOW."""
    full, window, b = make_kv(seed=seed), make_kv(seed=seed + 1), a.share()
    a.register_kv_cache(full, [0] * 4, NS)
    b.register_kv_cache(window, [0] * 4, WINDOW)
    return b, full, window


def test_two_caches_share_one_connection_and_keep_their_namespaces_apart(daemon):
    with daemon.client(name="engine") as a:
        b, full, window = two_caches(a, seed=1)
        # One connection, one client id, both namespaces registered on it.
        assert b.client_id == a.client_id
        (row,) = clients_of(daemon)
        assert row["namespaces"] == sorted([NS.fingerprint(), WINDOW.fingerprint()])

        assert a.store(HASHES, list(range(8))).wait().ok
        assert b.store(HASHES[:4], list(range(4))).wait().ok
        # The same keys, different namespaces: each cache sees only its own.
        assert a.lookup(HASHES) == 8 and b.lookup(HASHES) == 4
        assert b.load(HASHES[:4], list(range(16, 20))).wait().ok
        assert a.load(HASHES, list(range(16, 24))).wait().ok
        assert equal(window, range(4), range(16, 20)) and equal(full, range(8), range(16, 24))

        # The first one closes: its registration goes, the connection stays for b.
        assert a.close()
        assert len(clients_of(daemon)) == 1
        assert wait_for(lambda: clients_of(daemon)[0]["namespaces"] == [WINDOW.fingerprint()], 5)
        assert b.lookup(HASHES) == 4 and b.connected
        assert b.load(HASHES[:4], list(range(20, 24))).wait().ok
        # The last one closes the connection.
        assert b.close()
        assert wait_for(lambda: not clients_of(daemon), 5)
        with pytest.raises(KVTierError):
            a.share()  # nothing left to share
    full.close()
    window.close()


def test_a_restarted_daemon_gets_every_shared_cache_back(daemon_factory):
    first = daemon_factory(process=True)
    a = first.client(name="engine", timeout=2.0)
    b, full, window = two_caches(a, seed=3)
    try:
        first.stop(signal.SIGKILL)
        assert wait_for(lambda: not a.connected and not b.connected, 5)
        assert b.lookup(HASHES) == 0 and b.store(HASHES, list(range(8))).wait(timeout=5).failed

        second = daemon_factory(process=True, socket=first.socket)
        assert wait_for(lambda: a.connected and b.connected, 10)
        assert a.reconnects == b.reconnects == 1  # one keeper for the connection
        (row,) = clients_of(second)
        assert row["namespaces"] == sorted([NS.fingerprint(), WINDOW.fingerprint()])
        assert b.store(HASHES, list(range(8))).wait().ok and a.lookup(HASHES) == 0
        assert b.load(HASHES, list(range(8, 16))).wait().ok
        assert equal(window, range(8), range(8, 16))
    finally:
        b.close()
        a.close()
        full.close()
        window.close()


def test_closing_one_cache_leaves_the_others_transfers_alone(daemon):
    with daemon.client(name="engine") as a:
        b, full, window = two_caches(a, seed=5)
        assert a.store(HASHES, list(range(8))).wait().ok
        pending = a.load(HASHES, list(range(16, 24)))
        assert b.close()  # cancels b's transfers (none), not a's load
        assert pending.wait(timeout=10).ok
        assert equal(full, range(8), range(16, 24))
    full.close()
    window.close()


def test_one_connection_cannot_register_without_bound(daemon):
    """Hostile: a connection sharing itself past the daemon's per-connection
    bound gets a typed refusal; the daemon and the first caches go on."""
    kv = make_kv(shape=(4, 2, 16, 2, 32), layers=1)
    with daemon.client(name="engine") as a:
        views = [a] + [a.share() for _ in range(64)]
        for v in views[:64]:
            v.register_kv_cache(kv, [0], NS)
        with pytest.raises(KVTierError) as err:
            views[64].register_kv_cache(kv, [0], NS)
        assert err.value.code == ErrorCode.BAD_ARGUMENT
        assert views[63].store(HASHES[:1], [0]).wait().ok and a.lookup(HASHES[:1]) == 1
        for v in views[1:]:
            assert v.close()
    assert wait_for(lambda: not clients_of(daemon), 5)
    kv.close()


def test_each_cache_on_one_connection_is_held_to_its_own_swap_quota(daemon_factory):
    """Three caches on one connection, three swap quotas: 4 blocks, none, and
    the operator's default of 8. Each is held to its own, whatever registered
    after it (every REGISTER used to reset one quota for the whole connection,
    so the last cache's 0 would have stopped the first one's swap too); and
    what a cache swapped out comes back byte for byte."""
    d = daemon_factory(env={"KVTIER_SWAP_QUOTA": str(8 * SWAP_BLOCK)})
    first, window, second = make_kv(seed=7), make_kv(seed=8), make_kv(seed=9)
    with d.client(name="engine") as a:
        b, c = a.share(), a.share()
        a.register_kv_cache(first, [0] * 4, NS, swap_quota=4 * SWAP_BLOCK)
        b.register_kv_cache(window, [0] * 4, WINDOW, swap_quota=0)
        c.register_kv_cache(second, [0] * 4, NS)  # the same namespace as a: still a quota of its own
        (row,) = clients_of(d)
        assert sorted(q["swap_quota"] for q in row["caches"]) == [0, 4 * SWAP_BLOCK, 8 * SWAP_BLOCK]

        saved = [t[0:4].clone() for t in first.tensors]
        assert a.offload("a1", [0, 1, 2, 3]).wait().ok          # a's 4 blocks fit its quota
        over = a.offload("a2", [4]).wait()                        # a fifth does not
        assert over.failed_requests == ("a2",) and over.no_space
        refused = b.offload("b1", [0]).wait()                     # b may not swap at all
        assert refused.failed_requests == ("b1",) and refused.no_space
        assert c.offload("c1", list(range(8))).wait().ok          # c has the operator's 8
        assert not c.offload("c2", [8]).wait().ok

        (row,) = clients_of(d)
        per_cache = {q["id"]: q["swap_bytes"] for q in row["caches"]}
        assert sorted(per_cache.values()) == [0, 4 * SWAP_BLOCK, 8 * SWAP_BLOCK]
        assert row["swap_bytes"] == 12 * SWAP_BLOCK and row["swap_requests"] == 2

        for t in first.tensors:  # the engine reuses those blocks
            t.normal_()
        assert a.restore("a1", [20, 21, 22, 23]).wait().ok
        assert all(torch.equal(s, t[20:24]) for s, t in zip(saved, first.tensors))
        assert a.offload("a3", [5, 6]).wait().ok                  # its room is back, only its own
    for kv in (first, window, second):
        kv.close()
