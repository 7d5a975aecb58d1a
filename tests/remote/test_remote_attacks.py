"""Attacks on the remote tier (issue 21, items 1 and 9), against real daemons and a
real three-master Redis Cluster: a forger writing to Redis directly, replayed
values, tenants across nodes, a hung store, a cancel during a fetch, a store
larger than the write-behind allowance.

The forger knows what an engine user could read before this change: kvtier.toml
(the cluster's address and password), the namespace fingerprint, the uid
numbers, and the version 1 key and header scheme (public, unkeyed). It has no
secret file. No timing assertions: the figures in RELIABILITY.md come from
``scripts/bench_remote.py``-style runs printed with ``-s``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import zlib

import pytest

from kvtier.client import block_hashes
from kvtier.pool import checksum
from kvtier.pool.keys import ns_key
from kvtier.remote import values as v
from tests.helpers import NS, make_kv
from tests.remote.conftest import running_cluster
from tests.remote.test_two_nodes import (CODEC, TEAM, TOKENS, engine_blocks, lookup_and_load, node, remote_stats,
                                         store_prefix, wait_remote, _secret_file)  # noqa: F401 (fixture)

UID = os.geteuid()


def v1_key_and_value(tenant: str, block: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """The version 1 format, from public knowledge only: an unkeyed digest and a crc32."""
    full = hashlib.blake2b(ns_key(tenant, NS.fingerprint()).encode(), digest_size=16,
                           person=b"kvtier-remote").digest()
    key = b"kvt1:" + full[:8].hex().encode() + b":" + block.hex().encode()
    header = struct.pack("<4s16s16sQI", b"KVT1", full, block.ljust(16, b"\0"), len(payload), zlib.crc32(payload))
    return key, header + payload


def forged_value(ns: v.NamespaceDigest, block: bytes, payload: bytes) -> bytes:
    """Every public field right (the namespace digest read off a real value's header), the MAC guessed."""
    fields = v.FIELDS.pack(v.MAGIC, ns.full, block.ljust(16, b"\0"), len(payload), checksum.of(payload))
    return fields + hashlib.sha256(fields + payload).digest() + payload


def test_a_forger_without_the_secret_plants_nothing_any_node_serves(daemon_factory, cluster):
    """Old-style forgeries (v1 keys for the victim's namespace, as any engine user could compute
    them) are never looked at: 0 hits. A forgery written over a real key (found by SCAN)
    fails the MAC: that block is reported failed, counted as forged, deleted from the cluster,
    and the engine's memory for it is untouched; the other blocks load byte-exactly."""
    tokens = [t + 1_000_000 for t in TOKENS]
    hashes = block_hashes(tokens, 16)
    evil = bytes([0x66]) * (16 * 1024)  # one kvtier block of this namespace
    r = cluster.client()
    for tenant in (TEAM, f"uid{UID}"):  # the tenant by name, and by uid number as v1 keys had it
        for h in hashes:
            r.set(*v1_key_and_value(tenant, h, evil))
    b = node(daemon_factory, cluster.url)
    hits, _, _ = lookup_and_load(b, tokens)
    assert hits == 0  # before: 12 hits, and the forged bytes loaded

    a = node(daemon_factory, cluster.url)
    expected = store_prefix(a, tokens, seed=21)
    wait_remote(a, "written", 12)
    ns = CODEC.namespace(ns_key(TEAM, NS.fingerprint()))
    real = [k for k in r.scan_iter(match=b"kvt3:*", count=1000) if k.endswith(hashes[7].hex().encode())]
    assert real == [CODEC.key(ns, hashes[7])]  # what the forger finds by scanning
    r.set(real[0], forged_value(ns, hashes[7], evil))

    kv = make_kv(seed=99)
    with b.client(name="victim") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        before = engine_blocks(kv, range(16, 28))
        assert c.lookup(hashes) == 12
        result = c.load(hashes, list(range(16, 28))).wait()
        got = engine_blocks(kv, range(16, 28))
    kv.close()
    assert result.failed == (7,) and result.done == 11
    layers = len(got) // 12
    for i in range(12):
        want = before if i == 7 else expected  # block 7: the engine's own bytes, never the forgery
        assert got[i * layers:(i + 1) * layers] == want[i * layers:(i + 1) * layers]
    rb = remote_stats(b)
    assert (rb["forged"], rb["fetched"], rb["corrupt"]) == (1, 11, 0)
    assert r.exists(real[0]) == 0  # deleted: no node is offered it again
    print(f"\nforger: v1 keys for the victim's chain -> {hits} hits; forged value -> rejected {rb['forged']}, "
          f"deleted, 11 good blocks loaded")


def test_what_a_version_2_node_wrote_is_a_miss_here_and_left_where_it_is(daemon_factory, cluster):
    """During a rolling upgrade the cluster holds values an older node wrote (version 2:
    ``kvt2:`` keys, a CRC-32, this cluster's secret). A node of this version never looks
    them up (a miss, recomputed) and never deletes them, so the older nodes keep their hits."""
    tokens = [t + 1_050_000 for t in TOKENS]
    a = node(daemon_factory, cluster.url)
    store_prefix(a, tokens, seed=23)
    wait_remote(a, "written", 12)
    r = cluster.client()
    ns = CODEC.namespace(ns_key(TEAM, NS.fingerprint()))
    ours = [CODEC.key(ns, h) for h in block_hashes(tokens, 16)]
    old = []
    for key in ours:  # each value as the version 2 writer made it, under its key, and ours gone
        value = r.get(key)
        payload = value[v.HEADER_BYTES:]
        fields = v.FIELDS.pack(b"KVT2", *v.FIELDS.unpack_from(value)[1:4], zlib.crc32(payload))
        old.append(b"kvt2:" + key[len(v.KEY_PREFIX):])
        r.set(old[-1], fields + CODEC._mac(fields, payload) + payload)
        r.delete(key)
    b = node(daemon_factory, cluster.url)
    hits, _, _ = lookup_and_load(b, tokens)
    assert hits == 0
    rb = remote_stats(b)
    assert (rb["forged"], rb["corrupt"], rb["fetched"]) == (0, 0, 0)
    assert sum(r.exists(k) for k in old) == 12  # every older value still there for older nodes


def test_a_valid_value_replayed_under_another_tenants_key_is_rejected_and_deleted(daemon_factory, cluster):
    """Tenants alpha and beta (operator-named) store different data for the same tokens. Someone
    copies alpha's valid values over beta's keys: beta's node rejects every one (they name
    alpha's namespace), deletes them, and beta's engine gets none of alpha's bytes."""
    tokens = [t + 1_100_000 for t in TOKENS]
    hashes = block_hashes(tokens, 16)
    alpha = node(daemon_factory, cluster.url, tenants=f"alpha:{UID}")
    store_prefix(alpha, tokens, seed=22)
    wait_remote(alpha, "written", 12)
    r = cluster.client()
    ns_alpha = CODEC.namespace(ns_key("alpha", NS.fingerprint()))
    ns_beta = CODEC.namespace(ns_key("beta", NS.fingerprint()))
    for h in hashes:
        r.set(CODEC.key(ns_beta, h), r.get(CODEC.key(ns_alpha, h)))

    beta = node(daemon_factory, cluster.url, tenants=f"beta:{UID}")
    kv = make_kv(seed=98)
    with beta.client(name="beta-engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        before = engine_blocks(kv, range(16, 28))
        assert c.lookup(hashes) == 12  # the keys exist; only a fetch reads and checks values
        result = c.load(hashes, list(range(16, 28))).wait()
        assert engine_blocks(kv, range(16, 28)) == before
    kv.close()
    assert result.done == 0 and result.failed == tuple(range(12))
    rb = remote_stats(beta)
    assert (rb["forged"], rb["fetched"]) == (12, 0)
    assert sum(r.exists(CODEC.key(ns_beta, h)) for h in hashes) == 0
    assert sum(r.exists(CODEC.key(ns_alpha, h)) for h in hashes) == 12  # alpha's own values untouched


def test_tenants_cross_nodes_by_the_operators_names_not_by_uid_numbers(daemon_factory, cluster):
    """One uid on every node. Named alpha on node 1 and node 3, beta on node 2, unnamed on node 4:
    node 3 loads node 1's prefix byte-exactly; node 2 sees none of it; node 4 neither writes
    nor asks (uid numbers mean nothing on another node)."""
    tokens = [t + 1_200_000 for t in TOKENS]
    n1 = node(daemon_factory, cluster.url, tenants=f"alpha:{UID}")
    expected = store_prefix(n1, tokens, seed=23)
    wait_remote(n1, "written", 12)

    n2 = node(daemon_factory, cluster.url, tenants=f"beta:{UID}")
    assert lookup_and_load(n2, tokens)[0] == 0
    assert remote_stats(n2)["probes"] == 1

    n3 = node(daemon_factory, cluster.url, tenants=f"alpha:{UID}")
    hits, result, got = lookup_and_load(n3, tokens)
    assert hits == 12 and result.ok and got == expected

    n4 = node(daemon_factory, cluster.url, tenants="")
    assert lookup_and_load(n4, tokens)[0] == 0
    store_prefix(n4, [t + 1_300_000 for t in TOKENS], seed=24)
    r4 = remote_stats(n4)
    assert (r4["probes"], r4["written"], r4["queue_full"], r4["local_only_tenants"]) == (0, 0, 0, 1)
    assert f"tenant uid{UID} is not named in config tenants" in n4.read_log()


def test_a_store_four_times_the_write_behind_allowance_reaches_another_node_whole(daemon_factory, cluster):
    """A write-behind allowance of 64 KiB (4 blocks of 16 KiB; by default a quarter of the pool):
    a 16-block store waits in the write backlog and is written 4 by 4 as the queue drains
    (before: its first 4 were written and 12 skipped for good); another node then loads all
    16 byte for byte, and nothing is counted as not written."""
    tokens = list(range(1_400_000, 1_400_000 + 16 * 16))
    a = node(daemon_factory, cluster.url, env={"KVTIER_REMOTE_QUEUE": "64KiB"})
    expected = store_prefix(a, tokens, seed=25, ids=range(3, 19))
    ra = wait_remote(a, "written", 16)
    assert (ra["written"], ra["queue_full"], ra["backlog_blocks"], ra["not_written"]) == (16, 0, 0, {})
    hits, result, got = lookup_and_load(node(daemon_factory, cluster.url), tokens)
    assert hits == 16 and result.ok and result.done == 16 and got == expected


@pytest.fixture
def own_cluster():
    """A cluster this test may stop: the module's shared one stays up for the others."""
    yield from running_cluster()


def test_with_the_store_hung_lookups_are_answered_at_the_deadline(daemon_factory, own_cluster):
    """Every master SIGSTOPped (alive, silent). Three engines look up chains the node lacks at
    once: each gets its local hits (0) from the deadline clock (remote_timeout_s), not after
    the store's seconds-long client timeouts; a locally cached chain is answered all along."""
    cl = own_cluster
    n = node(daemon_factory, cl.url, env={"KVTIER_REMOTE_TIMEOUT_S": "0.3"})
    local = [t + 1_500_000 for t in TOKENS]
    expected = store_prefix(n, local, seed=26)
    wait_remote(n, "written", 12)
    for p in cl.procs:
        p.send_signal(signal.SIGSTOP)
    try:
        clients = [n.client(name=f"engine{i}") for i in range(3)]
        kvs = [make_kv() for _ in clients]
        for c, kv in zip(clients, kvs):
            c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        chains = [block_hashes([t + 2_000_000 + 10_000 * i for t in TOKENS], 16) for i in range(3)]
        assert [c.lookup(h) for c, h in zip(clients, chains)] == [0, 0, 0]
        hits, result, got = lookup_and_load(n, local)
        assert hits == 12 and result.ok and got == expected
        s = remote_stats(n)
        assert s["probe_late"] >= 3 and s["remote_hits"] == 0
        for c, kv in zip(clients, kvs):
            c.close()
            kv.close()
    finally:
        for p in cl.procs:
            p.send_signal(signal.SIGCONT)


def test_a_load_cancelled_while_its_blocks_are_fetched_copies_nothing(daemon_factory, own_cluster):
    """The store is stopped mid-fetch (SIGSTOP, well within remote_timeout_s); the engine's
    transfer times out and cancels. When the store answers, the fetched blocks enter the pool
    but nothing is copied into the engine's blocks (it may have reused them): every block is
    reported failed. Before: the cancel was ignored and the blocks were written anyway."""
    cl = own_cluster
    tokens = [t + 1_600_000 for t in TOKENS]
    a = node(daemon_factory, cl.url)
    store_prefix(a, tokens, seed=27)
    wait_remote(a, "written", 12)
    b = node(daemon_factory, cl.url, env={"KVTIER_REMOTE_TIMEOUT_S": "20"})
    hashes = block_hashes(tokens, 16)
    kv = make_kv(seed=97)
    with b.client(name="engine", transfer_timeout=0.2) as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        before = engine_blocks(kv, range(16, 28))
        assert c.lookup(hashes) == 12
        for p in cl.procs:
            p.send_signal(signal.SIGSTOP)
        try:
            h = c.load(hashes, list(range(16, 28)))
            with pytest.raises(TimeoutError):
                h.wait(timeout=0.5)  # past transfer_timeout: the handle sent its Cancel
            c.stats()  # readiness probe: the daemon has read the Cancel (same connection, in order)
        finally:
            for p in cl.procs:
                p.send_signal(signal.SIGCONT)
        result = h.wait()
        assert result.done == 0 and result.failed == tuple(range(12))
        assert engine_blocks(kv, range(16, 28)) == before
    kv.close()
    assert remote_stats(b)["fetched"] + remote_stats(b)["fetch_cancelled"] == 12


def test_with_a_password_only_the_secret_file_holds_a_forger_cannot_even_connect(daemon_factory, tmp_path):
    """The cluster requires AUTH. The nodes read the password from their secret file and share
    a prefix as usual; a client with what kvtier.toml holds (address, no password) is refused
    by Redis before it can read or write a key."""
    import redis
    from tests.remote.cluster import LocalCluster
    from tests.remote.conftest import write_secret
    cl = LocalCluster(password="s3cret-pw")
    try:
        secret = write_secret(tmp_path / "remote.secret", extra='password = "s3cret-pw"\n')
        env = {"KVTIER_REMOTE_SECRET_FILE": secret}
        tokens = [t + 1_700_000 for t in TOKENS]
        a = node(daemon_factory, cl.url, env=env)
        expected = store_prefix(a, tokens, seed=28)
        wait_remote(a, "written", 12)
        hits, result, got = lookup_and_load(node(daemon_factory, cl.url, env=env), tokens)
        assert hits == 12 and result.ok and got == expected
        with pytest.raises(redis.exceptions.RedisClusterException, match="(?i)auth"):
            cl.client(password="").set(b"kvt2:planted", b"x")
    finally:
        cl.close()
