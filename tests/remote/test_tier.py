"""The remote tier on its own against a real Redis Cluster of three masters:
pools are plain bytearrays, the caller is the test."""

from __future__ import annotations

import os
import select
import socket
import time

import pytest

from kvtier.pool.keys import ns_key
from kvtier.remote import values as v
from kvtier.remote.settings import RemoteSettings
from kvtier.remote.tier import RemoteTier
from tests.remote.conftest import SECRET

FP = ns_key("team", "tiny-llama|float16|flashinfer|bs16|tp0of1")
CODEC = v.ValueCodec(SECRET)
SIZE = 16 * 1024


def chain(tag: int, n: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(4, "little") + bytes(11) for i in range(n)]


def filled_pool(blocks: int) -> bytearray:
    return bytearray(os.urandom(blocks * SIZE))


def wait_jobs(tier: RemoteTier, n: int, timeout: float = 20.0) -> list:
    """Completions, waited for on the tier's wakeup fd as the daemon's poller does."""
    jobs, deadline = [], time.monotonic() + timeout
    while len(jobs) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(jobs)} of {n} jobs completed: {tier.stats()}"
        select.select([tier.wakeup_fd], [], [], left)
        jobs += tier.completed()
    return jobs


@pytest.fixture
def make_tier(cluster):
    made = []

    def make(pool, **kw):
        kw.setdefault("timeout_s", 5.0)  # a busy test machine must not turn an answer into "no answer in time"
        t = RemoteTier(RemoteSettings(cluster.url, secret=SECRET, **kw), pool)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_blocks_written_behind_by_one_tier_are_fetched_byte_exactly_by_another(make_tier):
    """Node A writes 8 blocks; node B, with its own pool, probes the chain and fetches them."""
    keys = chain(1, 8)
    pool_a = filled_pool(8)
    a = make_tier(pool_a)
    assert a.write(FP, keys, [i * SIZE for i in range(8)], SIZE, "w") == 8
    assert [j.token for j in wait_jobs(a, 1)] == ["w"]
    assert a.stats()["written"] == 8 and a.stats()["written_bytes"] == 8 * SIZE

    pool_b = bytearray(10 * SIZE)
    b = make_tier(pool_b)
    assert b.probe(FP, keys + chain(9, 3), "p")  # the chain goes on past what was written
    [probe] = wait_jobs(b, 1)
    assert probe.hits == 8 and not probe.error
    # Into B's pool at other offsets, in reverse order.
    offsets = [(9 - i) * SIZE for i in range(8)]
    assert b.fetch(FP, keys, offsets, SIZE, "f")
    [fetch] = wait_jobs(b, 1)
    assert fetch.failed == [] and len(fetch.crcs) == 8
    for i, off in enumerate(offsets):
        assert pool_b[off:off + SIZE] == pool_a[i * SIZE:(i + 1) * SIZE]
    assert b.stats()["fetched"] == 8 and b.stats()["remote_hits"] == 8


def test_a_probe_counts_only_the_unbroken_run_from_the_start(make_tier):
    keys = chain(2, 6)
    pool = filled_pool(6)
    t = make_tier(pool)
    written = [0, 1, 3, 4, 5]  # block 2 never reached the store
    assert t.write(FP, [keys[i] for i in written], [i * SIZE for i in written], SIZE, "w")
    wait_jobs(t, 1)
    assert t.probe(FP, keys, "p")
    assert wait_jobs(t, 1)[0].hits == 2


def test_missing_corrupt_and_replayed_values_are_reported_failed_and_never_copied(make_tier, cluster):
    keys = chain(3, 4)
    pool = filled_pool(4)
    t = make_tier(pool)
    assert t.write(FP, keys, [i * SIZE for i in range(4)], SIZE, "w")
    wait_jobs(t, 1)
    r = cluster.client()
    ns = CODEC.namespace(FP)
    k1, k2, k3 = (CODEC.key(ns, keys[i]) for i in (1, 2, 3))
    flipped = bytearray(r.get(k1))
    flipped[v.HEADER_BYTES + 5] ^= 1
    r.set(k1, bytes(flipped))                # a flipped payload bit
    r.set(k2, r.get(CODEC.key(ns, keys[0])))  # block 0's intact value under block 2's key: a replay
    r.delete(k3)                              # gone between lookup and load

    # Fetch into a pool region filled with a marker: only the intact block may land there.
    fill = b"\xee" * 4 * SIZE
    pool[:] = fill
    assert t.fetch(FP, keys, [i * SIZE for i in range(4)], SIZE, "f")
    [job] = wait_jobs(t, 1)
    assert sorted(job.failed) == [1, 2, 3]
    s = t.stats()
    assert (s["fetched"], s["corrupt"], s["forged"], s["missing"], s["fetch_failed"]) == (1, 1, 1, 1, 3)
    assert pool[:SIZE] != fill[:SIZE] and pool[SIZE:] == fill[SIZE:]
    # The rejected values are deleted: a later probe no longer offers them.
    assert t.probe(FP, keys, "p")
    assert wait_jobs(t, 1)[0].hits == 1


def test_values_expire_after_the_ttl_and_the_budget_caps_what_one_node_writes(make_tier, cluster):
    keys = chain(4, 10)
    pool = filled_pool(10)
    t = make_tier(pool, ttl_s=120.0, budget=3 * SIZE)
    assert t.write(FP, keys, [i * SIZE for i in range(10)], SIZE, "w")
    [job] = wait_jobs(t, 1)
    assert (job.failed, job.dropped) == ([], {"budget": 7})  # for good: the caller counts, never retries
    s = t.stats()
    assert (s["written"], s["budget_skipped"], s["window_bytes"]) == (3, 7, 3 * SIZE)
    r = cluster.client()
    ns = CODEC.namespace(FP)
    ttls = [r.pttl(CODEC.key(ns, k)) for k in keys]
    assert all(0 < ms <= 120_000 for ms in ttls[:3]) and ttls[3:] == [-2] * 7  # -2: no such key


def test_an_unreachable_store_fails_fast_opens_the_breaker_and_never_raises(tmp_path):
    """Nothing listens on the port: every call reports an error, and once the breaker is open
    the verbs refuse at once so the caller answers locally."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = filled_pool(2)
    t = RemoteTier(RemoteSettings(f"redis://127.0.0.1:{port}", secret=SECRET, timeout_s=0.2), pool)
    try:
        # Three failed calls open it. A probe answered at its deadline (0.2 s) while the
        # first call is still connecting (a loaded machine: redis' first import alone can
        # take longer) is never sent, so it is no failure: probe until three were sent.
        for i in range(30):
            if t.stats()["state"] != "closed" or not t.probe(FP, chain(5, 2), i):
                break  # (a late call's failure may open it between the check and the probe)
            [job] = wait_jobs(t, 1)
            assert job.hits == 0 and job.error
            time.sleep(0.05)  # a late call's failure lands after its probe's deadline answer
        assert t.stats()["state"] != "closed"  # open, or half-open while its trial ping fails
        skipped = t.stats()["probe_skipped"]
        assert not t.probe(FP, chain(5, 2), "refused")
        assert t.fetch(FP, chain(5, 2), [0, SIZE], SIZE, "refused") is None
        assert t.write(FP, chain(5, 2), [0, SIZE], SIZE, "refused") == 0
        s = t.stats()
        assert s["probe_skipped"] == skipped + 1 and s["fetch_skipped"] == 2 and s["write_skipped"] == 2
        assert s["errors"] >= 3 and s["last_error"]
    finally:
        t.close()


def test_a_write_larger_than_the_queue_writes_the_prefix_that_fits(make_tier):
    """The write-behind allowance holds 3 blocks: a 10-block chain queues its first 3
    (another node can use a prefix, never a middle), the other 7 are counted and released."""
    keys = chain(6, 10)
    pool = filled_pool(10)
    t = make_tier(pool, queue_bytes=3 * SIZE)
    assert t.write(FP, keys, [i * SIZE for i in range(10)], SIZE, "w") == 3
    assert t.write(FP, chain(7, 2), [0, SIZE], SIZE, "full") == 0  # the first 3 still in flight
    wait_jobs(t, 1)
    s = t.stats()
    assert (s["written"], s["queue_full"], s["queued_bytes"]) == (3, 9, 0)
    assert t.probe(FP, keys, "p")
    assert wait_jobs(t, 1)[0].hits == 3


@pytest.fixture
def own_cluster():
    from tests.remote.conftest import running_cluster
    yield from running_cluster()


def test_a_probe_to_a_hung_store_is_answered_at_its_deadline_and_so_are_those_behind_it(own_cluster):
    """Every master SIGSTOPped (connected, silent): each probe comes back with 0 hits and
    "no answer" from the deadline clock, not from the store, including the probes
    queued behind the first hung call; the late answers are dropped, never reported twice."""
    import signal
    cl = own_cluster
    t = RemoteTier(RemoteSettings(cl.url, secret=SECRET, timeout_s=0.3), filled_pool(1))
    try:
        for _ in range(50):  # readiness probe: connected and the topology known (slow on a busy machine)
            assert t.probe(FP, chain(8, 2), "warm")
            if not wait_jobs(t, 1)[0].error:
                break
        assert t.stats()["state"] == "closed"
        late = t.stats()["probe_late"]
        for p in cl.procs:
            p.send_signal(signal.SIGSTOP)
        try:
            for i in range(3):
                assert t.probe(FP, chain(8, 4), i)
            jobs = wait_jobs(t, 3)
            assert sorted(j.token for j in jobs) == [0, 1, 2]
            assert all(j.hits == 0 and "no answer within" in j.error for j in jobs)
            assert t.stats()["probe_late"] == late + 3
        finally:
            for p in cl.procs:
                p.send_signal(signal.SIGCONT)
        # The hung calls finish (or fail) on the probe thread; none is reported again.
        wait_until_idle = time.monotonic() + 30
        while t.probe_slots.held and time.monotonic() < wait_until_idle:
            time.sleep(0.05)
        assert t.probe_slots.held == 0 and t.completed() == []
    finally:
        t.close()



def test_a_fetch_cancelled_while_queued_behind_a_hung_one_is_answered_at_once(own_cluster):
    """Every master SIGSTOPped while the first fetch waits on it; a second fetch queued behind it is
    cancelled: it comes back (every block failed, its pool bytes untouched) while the first is
    still hung, so an engine's cancel never waits on someone else's stalled fetch."""
    import signal
    cl = own_cluster
    keys = chain(10, 4)
    src = filled_pool(4)
    a = RemoteTier(RemoteSettings(cl.url, secret=SECRET, timeout_s=20.0), src)
    pool = bytearray(8 * SIZE)
    b = RemoteTier(RemoteSettings(cl.url, secret=SECRET, timeout_s=20.0), pool)
    try:
        assert a.write(FP, keys, [i * SIZE for i in range(4)], SIZE, "w") == 4
        wait_jobs(a, 1)
        for p in cl.procs:
            p.send_signal(signal.SIGSTOP)
        try:
            hung = b.fetch(FP, keys, [i * SIZE for i in range(4)], SIZE, "hung")
            queued = b.fetch(FP, keys, [(4 + i) * SIZE for i in range(4)], SIZE, "queued")
            b.cancel(queued)
            [first] = wait_jobs(b, 1)
            assert first is queued and sorted(first.failed) == [0, 1, 2, 3] and first.error == "cancelled"
            assert not hung.reported  # still waiting on the stopped store
        finally:
            for p in cl.procs:
                p.send_signal(signal.SIGCONT)
        [second] = wait_jobs(b, 1)
        assert second is hung and second.failed == [] and pool[:4 * SIZE] == src
        assert pool[4 * SIZE:] == bytes(4 * SIZE)  # the cancelled fetch never wrote its blocks
        assert b.stats()["fetch_cancelled"] == 4
    finally:
        a.close()
        b.close()


def test_a_write_the_store_could_not_take_is_reported_for_a_retry_and_the_store_coming_back_is_announced(
        own_cluster):
    """Every master SIGKILLed: a write job comes back with every block ``failed`` (the caller's
    backlog takes them back), nothing ``dropped``. Probes open the breaker; once the cluster is
    back, the tier hands the caller a "healed" job so its backlog goes on, and a write lands."""
    t = RemoteTier(RemoteSettings(own_cluster.url, secret=SECRET, timeout_s=0.5), filled_pool(4))
    try:
        own_cluster.kill()
        assert t.write(FP, chain(12, 4), [i * SIZE for i in range(4)], SIZE, "w") == 4
        [job] = wait_jobs(t, 1)
        assert (job.token, sorted(job.failed), job.dropped) == ("w", [0, 1, 2, 3], {})
        while t.stats()["state"] != "open":
            assert t.probe(FP, chain(12, 4), "p")
            wait_jobs(t, 1)
        own_cluster.start()
        own_cluster.wait_ok()
        deadline = time.monotonic() + 60
        while not any(j.kind == "healed" for j in t.completed()):
            assert time.monotonic() < deadline, f"no healed job: {t.stats()}"
            select.select([t.wakeup_fd], [], [], 1.0)
        assert t.available()
        assert t.write(FP, chain(12, 4), [i * SIZE for i in range(4)], SIZE, "again") == 4
        [job] = wait_jobs(t, 1)
        assert (job.failed, t.stats()["written"]) == ([], 4)
    finally:
        t.close()
