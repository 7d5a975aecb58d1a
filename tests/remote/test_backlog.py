"""The remote write backlog against real daemons and a real three-master Redis Cluster:
a store larger than the write-behind allowance, or made while the store is down, waits
in its tenant's backlog and reaches the cluster whole once there is room and the
cluster is back; what cannot be written (gone from RAM first, a backlog past the pool's
worth) is counted by reason in status, never dropped silently."""

from __future__ import annotations

import signal
import time

import pytest

from kvtier.cli import main
from kvtier.client import block_hashes
from kvtier.pool.keys import ns_key
from tests.daemon.test_warm_restart import warm  # noqa: F401  (the fixture)
from tests.helpers import NS, make_kv
from tests.remote.conftest import running_cluster
from tests.remote.test_two_nodes import (CODEC, TEAM, lookup_and_load, node, remote_stats,  # noqa: F401
                                         store_prefix, wait_remote, wait_state, _secret_file)

QUEUE = {"KVTIER_REMOTE_QUEUE": "64KiB"}  # 4 blocks of 16 KiB in flight


def chain(start: int, blocks: int) -> list[int]:
    return list(range(start, start + 16 * blocks))


@pytest.fixture
def own_cluster():
    """A cluster this test may kill masters of."""
    yield from running_cluster()


def open_breaker(d, cl) -> None:
    """Kill master 0, then look up a chain nobody holds until the node's breaker opens:
    each lookup asks the cluster past the local prefix, and those asks fail."""
    cl.kill_master(0)
    kv = make_kv()
    with d.client(name="prober") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(chain(9_000_000, 12), 16)
        deadline = time.monotonic() + 60
        while remote_stats(d)["state"] != "open":
            assert time.monotonic() < deadline, f"the breaker never opened: {remote_stats(d)}"
            assert c.lookup(hashes) == 0
    kv.close()


def wait_backlog_empty(d, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while (r := remote_stats(d))["backlog_blocks"] or r["queued_bytes"] or r["warm_waiting"]:
        assert time.monotonic() < deadline, f"the backlog never drained: {r}"
        time.sleep(0.05)
    return r


def test_a_store_made_while_a_master_is_dead_waits_and_reaches_another_node_whole(daemon_factory, own_cluster):
    """A master SIGKILLed and the breaker open: a 16-block store (4x the allowance) commits
    locally and all 16 wait in the backlog, none written, none lost. The master comes back
    (empty): the breaker closes, the backlog drains, and another node loads all 16 byte for byte."""
    cl = own_cluster
    a = node(daemon_factory, cl.url, env=QUEUE)
    open_breaker(a, cl)
    tokens = chain(2_000_000, 16)
    expected = store_prefix(a, tokens, seed=31, ids=range(3, 19))
    r = remote_stats(a)
    assert (r["backlog_blocks"], r["written"], r["pinned_bytes"], r["not_written"]) == (16, 0, 0, {})

    cl.restart_master(0)
    cl.wait_ok()
    r = wait_remote(a, "written", 16)
    assert (r["state"], r["not_written"]) == ("closed", {})
    hits, result, got = lookup_and_load(node(daemon_factory, cl.url), tokens)
    assert hits == 16 and result.ok and got == expected


def test_blocks_that_leave_ram_before_their_turn_are_counted_as_not_written(daemon_factory, own_cluster, capsys):
    """The cluster is down while a 16-block store waits in the backlog; the namespace is then
    flushed. When the cluster is back the backlog finds none of them in RAM: 16 are counted
    'evicted' under the tenant (status shows it), none written, none silently gone."""
    cl = own_cluster
    a = node(daemon_factory, cl.url, env=QUEUE)
    open_breaker(a, cl)
    store_prefix(a, chain(3_000_000, 16), seed=32, ids=range(3, 19))
    with a.client(name="operator") as c:
        c.flush()
    cl.restart_master(0)
    cl.wait_ok()
    wait_state(a, "closed")
    r = wait_backlog_empty(a)
    assert (r["written"], r["not_written"]) == (0, {TEAM: {"evicted": 16}})
    assert main(["status", "--socket", a.socket]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("remote"))
    assert "backlog 0 blocks" in line and "not written 16 (evicted 16)" in line


def test_blocks_larger_than_the_whole_allowance_are_counted_at_once_not_held_forever(daemon_factory, cluster):
    """remote_queue 8 KiB, blocks of 16 KiB: no block could ever be in flight, so a store's
    12 are counted 'too_large' at commit, and the backlog stays empty (before: queue_full)."""
    a = node(daemon_factory, cluster.url, env={"KVTIER_REMOTE_QUEUE": "8KiB"})
    store_prefix(a, chain(6_000_000, 12), seed=34)
    r = remote_stats(a)
    assert (r["backlog_blocks"], r["written"], r["not_written"]) == (0, 0, {TEAM: {"too_large": 12}})


def test_a_daemon_stopping_with_a_backlog_says_how_many_blocks_it_did_not_write(daemon_factory, own_cluster):
    """The cluster is down and 16 blocks wait: a clean stop cannot write them, and says so."""
    cl = own_cluster
    a = node(daemon_factory, cl.url, env=QUEUE)
    open_breaker(a, cl)
    store_prefix(a, chain(5_000_000, 16), seed=33, ids=range(3, 19))
    a.stop()
    assert "16 committed blocks still in the write backlog are not written (the daemon stops)" in a.read_log()


def test_a_flood_of_stores_while_the_cluster_is_down_keeps_the_backlog_within_the_pool(daemon_factory,
                                                                                       own_cluster):
    """Hostile volume: three 32-block stores into a 64-block pool while the cluster is down.
    The backlog names at most the pool's worth (64 blocks); the oldest 32 are counted
    'backlog_full' (they were evicted from RAM too). Once the cluster is back the 64 the pool
    holds are written: written + not written = the 96 stored."""
    cl = own_cluster
    a = node(daemon_factory, cl.url, env=QUEUE, pool_size="1MiB", slab_size="1MiB")
    open_breaker(a, cl)
    for i in range(3):
        store_prefix(a, chain(4_000_000 + 10_000 * i, 32), seed=40 + i, ids=range(32))
    r = remote_stats(a)
    assert (r["backlog_blocks"], r["backlog_limit_bytes"], r["not_written"]) == (64, 2**20, {TEAM: {"backlog_full": 32}})
    cl.restart_master(0)
    cl.wait_ok()
    r = wait_remote(a, "written", 64)
    r = wait_backlog_empty(a)
    assert (r["written"], r["not_written"]) == (64, {TEAM: {"backlog_full": 32}})


def test_a_daemon_sigkilled_with_a_backlog_writes_it_after_a_warm_restart(warm, daemon_factory,  # noqa: F811
                                                                          own_cluster):
    """A warm_restart node writes an 8-block chain, then, with a master SIGKILLed and the
    breaker open, commits a 16-block chain that waits in the backlog, and is SIGKILLed. The
    master comes back empty (the 8 it held are gone from it). The next daemon adopts all 24
    kept blocks and re-queues them: those the cluster still holds are found by EXISTS and
    not sent again (``warm_present``, exactly the ones a direct look finds), the rest are
    written: written + present + not_written == adopted. Another node then loads both chains
    byte for byte."""
    cl = own_cluster
    first = node(warm, cl.url, env=QUEUE)
    early, late = chain(7_000_000, 8), chain(7_100_000, 16)
    want_early = store_prefix(first, early, seed=51, ids=range(3, 11))
    wait_remote(first, "written", 8)
    open_breaker(first, cl)
    want_late = store_prefix(first, late, seed=52, ids=range(3, 19))
    assert remote_stats(first)["backlog_blocks"] == 16
    first.stop(signal.SIGKILL)
    cl.restart_master(0)
    cl.wait_ok()
    digest = CODEC.namespace(ns_key(TEAM, NS.fingerprint()))
    still = sum(cl.client().exists(CODEC.key(digest, h)) for h in block_hashes(early, 16))

    second = node(warm, cl.url, env=QUEUE)
    assert second.stats()["warm_restart"]["adopted_blocks"] == 24
    r = wait_backlog_empty(second)
    assert (r["warm_requeued"], r["warm_present"], r["not_written"]) == (24, still, {})
    assert r["written"] == 24 - still
    b = node(daemon_factory, cl.url)
    for tokens, want in ((early, want_early), (late, want_late)):
        hits, result, got = lookup_and_load(b, tokens)
        assert hits == len(tokens) // 16 and result.ok and got == want


def test_a_warm_restart_of_a_tenant_not_named_across_nodes_queues_nothing(warm, cluster):  # noqa: F811
    """Hostile to the accounting: a tenant the operator did not name never writes to the
    cluster, before or after a warm restart: its adopted blocks are not re-queued, and
    nothing is counted as not written (it was never to be written)."""
    first = node(warm, cluster.url, tenants="", env=QUEUE)
    store_prefix(first, chain(8_000_000, 8), seed=53, ids=range(3, 11))
    first.stop(signal.SIGKILL)
    second = node(warm, cluster.url, tenants="", env=QUEUE)
    assert second.stats()["warm_restart"]["adopted_blocks"] == 8
    r = remote_stats(second)
    assert (r["warm_requeued"], r["backlog_blocks"], r["written"], r["not_written"]) == (0, 0, 0, {})
