"""Two nodes share KV through one Redis Cluster: two daemons on this machine
(separate pools and sockets), each with an engine, both pointing at a real
three-master cluster on loopback. Engines see one lookup and one load, as
without the remote tier."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvtier.client import block_hashes
from kvtier.pool.keys import ns_key
from kvtier.remote import values as v
from tests.helpers import NS, make_kv
from tests.remote.conftest import SECRET, running_cluster, write_secret

TOKENS = list(range(5000, 5000 + 16 * 12))  # 12 full blocks
TEAM = "nodes"  # the operator names this test's user's tenant the same on every node
CODEC = v.ValueCodec(SECRET)
SECRET_FILE = {}


@pytest.fixture(autouse=True, scope="module")
def _secret_file(tmp_path_factory):
    SECRET_FILE["path"] = write_secret(tmp_path_factory.mktemp("secret") / "remote.secret")


def node(daemon_factory, url: str, tenants: str = f"{TEAM}:{os.geteuid()}", env=None, **kw):
    """A node's daemon on the cluster at ``url``, with the cluster's secret file. A lookup
    that asks the cluster is answered within remote_timeout_s: generous here, so that a busy
    test machine never turns a remote hit into a miss (tests of a hung store set it low)."""
    return daemon_factory(env={"KVTIER_REMOTE": url, "KVTIER_REMOTE_TIMEOUT_S": "5",
                               "KVTIER_REMOTE_SECRET_FILE": SECRET_FILE["path"], "KVTIER_TENANTS": tenants,
                               **(env or {})}, **kw)


def remote_stats(d) -> dict:
    return d.stats(check=True)["remote"]


def wait_remote(d, key: str, at_least: int, timeout: float = 30.0) -> dict:
    """Readiness probe: poll the daemon's remote counters until ``key`` reaches ``at_least``."""
    deadline = time.monotonic() + timeout
    while True:
        r = remote_stats(d)
        if r[key] >= at_least:
            return r
        assert time.monotonic() < deadline, f"remote {key} stayed at {r[key]} < {at_least}: {r}"
        time.sleep(0.05)


def wait_state(d, state: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (r := remote_stats(d))["state"] != state:
        assert time.monotonic() < deadline, f"remote tier never became {state}: {r}"
        time.sleep(0.05)
    return r


def engine_blocks(kv, ids) -> list[bytes]:
    return [t[i].clone().numpy().tobytes() for i in ids for t in kv.tensors]


def store_prefix(d, tokens, seed: int, ids=range(3, 15)) -> list[bytes]:
    """Engine on node ``d`` prefilled ``tokens`` into blocks ``ids`` and stores them."""
    kv = make_kv(seed=seed)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(tokens, 16)
        r = c.store(hashes, list(ids)).wait()
        assert r.ok and r.done == len(hashes), r
        out = engine_blocks(kv, ids)
    kv.close()
    return out


def lookup_and_load(d, tokens, first_id: int = 16):
    """Engine on node ``d``: one lookup, one load of what it found; (hits, result, bytes)."""
    kv = make_kv(seed=99)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(tokens + [1, 2, 3], 16)  # the prompt plus a partial tail
        hits = c.lookup(hashes)
        result = c.load(hashes[:hits], list(range(first_id, first_id + hits))).wait() if hits else None
        got = engine_blocks(kv, range(first_id, first_id + hits))
    kv.close()
    return hits, result, got


def test_node_b_loads_byte_exactly_the_prefix_node_a_stored(daemon_factory, cluster):
    """A's committed blocks are written behind to the cluster; B, with an empty pool, finds
    them with one lookup and loads them byte for byte with one load; B's pool keeps them."""
    a, b = node(daemon_factory, cluster.url), node(daemon_factory, cluster.url)
    expected = store_prefix(a, TOKENS, seed=1)
    wait_remote(a, "written", 12)

    hits, result, got = lookup_and_load(b, TOKENS)
    assert hits == 12 and result.ok and result.done == 12
    assert got == expected
    rb = remote_stats(b)
    assert (rb["remote_hits"], rb["fetched"], rb["fetch_failed"], rb["written"]) == (12, 12, 0, 0)
    # Now local on B: a second lookup needs no remote answer for the prefix.
    hits, result, got = lookup_and_load(b, TOKENS)
    assert hits == 12 and result.ok and got == expected
    assert remote_stats(b)["fetched"] == 12
    assert b.stats()["namespaces"][0]["blocks"] == 12


def test_node_a_reloads_its_evicted_prefix_from_the_remote_tier(daemon_factory, cluster):
    """A 64-block pool: 64 later blocks evict the prefix; the lookup still finds it, in
    the cluster, and the load brings it back into A's pool byte for byte."""
    tokens = [t + 100_000 for t in TOKENS]
    a = node(daemon_factory, cluster.url, pool_size="1MiB", slab_size="1MiB")
    expected = store_prefix(a, tokens, seed=2)
    wait_remote(a, "written", 12)

    kv = make_kv(seed=3)
    with a.client(name="other") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        filler = block_hashes(list(range(900_000, 900_000 + 16 * 64)), 16)
        assert c.store(filler, [i % 32 for i in range(64)]).wait().ok
    kv.close()
    ns = a.stats()["namespaces"][0]
    assert ns["evicted"] >= 12

    hits, result, got = lookup_and_load(a, tokens)
    assert hits == 12 and result.ok and got == expected
    assert remote_stats(a)["fetched"] == 12


def test_a_corrupted_remote_value_is_detected_and_reported_failed(daemon_factory, cluster):
    """One flipped payload bit in the cluster: B's load reports that block failed (the rest
    loads intact), the block never enters B's pool, and the bad value is no longer offered."""
    tokens = [t + 200_000 for t in TOKENS]
    a, b = node(daemon_factory, cluster.url), node(daemon_factory, cluster.url)
    expected = store_prefix(a, tokens, seed=4)
    wait_remote(a, "written", 12)
    hashes = block_hashes(tokens, 16)
    r = cluster.client()
    # Remote keys carry the tenant too, by the name the operator gave it on every node.
    key = CODEC.key(CODEC.namespace(ns_key(TEAM, NS.fingerprint())), hashes[5])
    value = bytearray(r.get(key))
    value[v.HEADER_BYTES + 1234] ^= 0x10
    r.set(key, bytes(value))

    hits, result, got = lookup_and_load(b, tokens)
    assert hits == 12  # the lookup only checks existence
    assert result.failed == (5,) and result.done == 11
    layers = len(got) // 12
    ok = [i for i in range(12) if i != 5]
    assert [got[i * layers:(i + 1) * layers] for i in ok] == [expected[i * layers:(i + 1) * layers] for i in ok]
    rb = remote_stats(b)
    assert rb["corrupt"] == 1 and rb["fetched"] == 11
    # B holds the 11 good blocks; block 5 is neither local nor offered remotely any more.
    hits, result, _ = lookup_and_load(b, tokens)
    assert hits == 5 and result.ok
    assert b.stats()["namespaces"][0]["blocks"] == 11


@pytest.fixture
def own_cluster():
    """A cluster this test may kill: the module's shared one stays up for the others."""
    yield from running_cluster()


def test_with_redis_killed_both_nodes_serve_locally_and_recover_when_it_is_back(daemon_factory, own_cluster):
    cl = own_cluster
    a, b = node(daemon_factory, cl.url), node(daemon_factory, cl.url)
    first = [t + 300_000 for t in TOKENS]
    store_prefix(a, first, seed=5)
    wait_remote(a, "written", 12)
    cl.kill()

    # Both keep serving locally: A's own prefix, stored and loaded while the cluster is gone.
    second = [t + 400_000 for t in TOKENS]
    expected = store_prefix(a, second, seed=6)
    hits, result, got = lookup_and_load(a, second)
    assert hits == 12 and result.ok and got == expected
    # B finds nothing of A's (0 remote hits), and a load of blocks it lacks fails at once.
    for _ in range(4):  # enough failed probes to open the breaker
        hits, _, _ = lookup_and_load(b, first)
        assert hits == 0
    wait_state(b, "open")
    kv = make_kv(seed=7)
    with b.client(name="stubborn") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        r = c.load(block_hashes(first, 16)[:3], [0, 1, 2]).wait()
        assert r.failed == (0, 1, 2)
    kv.close()
    assert remote_stats(b)["remote_hits"] == 0
    store_prefix(b, second, seed=8)  # B's own stores still commit locally
    assert b.stats()["namespaces"][0]["blocks"] == 12

    cl.start()
    cl.wait_ok()
    wait_state(a, "closed")
    wait_state(b, "closed")
    third = [t + 500_000 for t in TOKENS]
    written = remote_stats(a)["written"]
    expected = store_prefix(a, third, seed=9)
    wait_remote(a, "written", written + 12)
    hits, result, got = lookup_and_load(b, third)
    assert hits == 12 and result.ok and got == expected
    assert remote_stats(b)["remote_hits"] == 12


def test_status_and_metrics_show_the_remote_tier_up_or_down(daemon_factory, cluster, capsys):
    """`kvtier status` has a remote line and Prometheus the remote series; a node whose
    cluster is unreachable from the start serves locally and says the tier is down."""
    from kvtier.cli import main
    from tests.daemon.test_metrics import free_port, scrape_until

    port = free_port()
    up = node(daemon_factory, cluster.url, extra=("--metrics", f"127.0.0.1:{port}"))
    store_prefix(up, [t + 600_000 for t in TOKENS], seed=10)
    wait_remote(up, "written", 12)
    m = scrape_until(port, lambda m: m.get(("kvtier_remote_blocks_written_total", frozenset())) == 12)
    assert m[("kvtier_remote_blocks_written_total", frozenset())] == 12
    assert m[("kvtier_remote_up", frozenset())] == 1
    assert m[("kvtier_remote_backlog_blocks", frozenset())] == 0  # all written: nothing waits, nothing lost
    assert not any(name == "kvtier_remote_not_written_total" for name, _ in m)
    assert main(["status", "--socket", up.socket]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("remote"))
    assert "127.0.0.1" in line and " up " in line and "written 12 blocks" in line

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    down = node(daemon_factory, f"redis://127.0.0.1:{dead}")
    tokens = [t + 700_000 for t in TOKENS]
    expected = store_prefix(down, tokens, seed=11)
    for _ in range(3):  # lookups past the local prefix each try the store and fail
        hits, result, got = lookup_and_load(down, tokens + list(range(64)))
        assert hits == 12 and result.ok and got == expected
    wait_state(down, "open")
    assert main(["status", "--socket", down.socket]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("remote"))
    assert "DOWN (open" in line and "hits 0" in line
