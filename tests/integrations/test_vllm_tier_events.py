"""The scheduler side's KV events (``events.py``) with vLLM's own types and a real daemon.

The manager announces chunks as vLLM's scheduler will publish them
(``take_events`` -> ``OffloadingEvent``, medium CPU): once each when stored
or found, and as removed when the daemon says it dropped them (its block
event socket) or a lookup finds them gone. The full engine with vLLM's ZMQ
publisher is in ``test_vllm_events.py``.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from kvtier.integrations.vllm.events import DaemonFeed, TierEvents  # noqa: E402
from kvtier.integrations.vllm.groups import TierGroup  # noqa: E402
from kvtier.integrations.vllm.manager import KVTierManager  # noqa: E402
from kvtier.integrations.vllm.naming import kvtier_key  # noqa: E402
from kvtier.integrations.vllm.worker import KVTierWorker  # noqa: E402
from tests.integrations.test_vllm_worker import K, LAYERS, NS, PAGE, canonical_caches, finished, gpu_spec  # noqa: E402

def offload_keys(n: int, salt: int = 0) -> list[bytes]:
    return [vllm_base.make_offload_key(f"block-{salt}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


def req(req_id: str = "r1"):
    return vllm_base.ReqContext(req_id=req_id)


def events_of(manager, want: int, timeout: float = 30.0) -> list:
    """Drain ``take_events`` until ``want`` events came (the daemon's arrive asynchronously)."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {got} after {timeout}s"
        got.extend(manager.take_events())
        time.sleep(0.01)
    return got


@pytest.fixture
def engine(daemon_factory, tmp_path):
    endpoint = str(tmp_path / "events.sock")
    daemon = daemon_factory(extra=["--events", endpoint])
    caches, _ = canonical_caches(seed=3)
    worker = KVTierWorker(caches, NS, K, daemon.socket, name="vllm-worker-events")
    manager = KVTierManager([TierGroup(0, NS, LAYERS * PAGE)], K, daemon.socket, name="vllm-scheduler-events",
                            events=TierEvents(True, DaemonFeed(endpoint, NS.fingerprint())))
    yield daemon, worker, manager
    manager.shutdown()
    worker.shutdown()


def store(worker, manager, keys, job: int) -> None:
    out = manager.prepare_store(keys, req())
    assert worker.submit_store(job, gpu_spec(list(range(len(keys) * K))), out.store_spec)
    assert finished(worker, {job})[job].success
    manager.complete_store(keys, req())


def test_stored_chunks_are_announced_once_and_evictions_by_the_daemon_as_removed(engine):
    """Stores are announced once on the CPU medium (a repeated store or a later
    hit adds nothing); when the daemon drops them (here a flush, which its
    event socket reports like an eviction) the manager reports them removed."""
    daemon, worker, manager = engine
    keys = offload_keys(3)
    store(worker, manager, keys, job=1)
    store(worker, manager, keys, job=2)          # deduplicated by the daemon, and in the events
    manager.prefetch("r2", keys)                 # a hit on what it announced: nothing new
    (stored,) = manager.take_events()
    assert (stored.removed, stored.medium, stored.keys) == (False, vllm_base.Medium.CPU, keys)
    assert stored.locality == vllm_base.Locality.LOCAL
    with daemon.client(name="operator") as c:
        assert c.flush(NS) == 3
    (removed,) = events_of(manager, 1)
    assert removed.removed and sorted(removed.keys) == sorted(keys)
    assert list(manager.take_events()) == []


def test_another_engine_announces_chunks_once_its_lookups_find_them(engine):
    """A second engine on the node (its own scheduler) did not store the
    chunks; its lookup hits them, and from then on its own stream announces
    them (it can load them), the first chunk past the hits not at all."""
    daemon, worker, manager = engine
    keys = offload_keys(3, salt=4)
    store(worker, manager, keys[:2], job=3)
    other = KVTierManager([TierGroup(0, NS, LAYERS * PAGE)], K, daemon.socket, name="vllm-scheduler-other",
                          events=TierEvents(True))
    try:
        assert other.take_events() == []
        other.prefetch("r9", keys)
        assert other.lookup(keys[0], req("r9")) == vllm_base.LookupResult.HIT
        (found,) = other.take_events()
        assert (found.removed, found.keys) == (False, keys[:2])
    finally:
        other.shutdown()


def test_a_lookup_that_finds_an_announced_chunk_gone_reports_it_removed():
    """Without the daemon's feed the manager learns of a loss from lookups:
    the first chunk that misses is gone (later ones are unknown)."""
    ev = TierEvents(True)
    keys = offload_keys(4, salt=1)
    ev.stored(keys)
    ev.missing(keys[1:2])
    ev.stored(keys[1:2])       # stored again after the loss: announced again, after the removal
    kinds = [(e.removed, e.keys) for e in ev.take()]
    assert kinds == [(False, keys), (True, keys[1:2]), (False, keys[1:2])]


def test_nothing_is_queued_when_vllm_publishes_no_kv_events():
    """vLLM drains take_events only with kv_events_config on: a disabled
    tracker keeps nothing, however many chunks pass."""
    ev = TierEvents(False)
    ev.stored(offload_keys(1000, salt=2))
    assert ev.take() == [] and not ev._pending and not ev._announced


def test_a_forged_or_foreign_message_on_the_event_socket_never_reaches_the_engine(tmp_path):
    """Whoever can publish on the endpoint (it is the operator's socket) cannot
    crash the engine's scheduler: garbage is skipped, another namespace
    whose fingerprint starts with ours is ignored, a real removal still counts."""
    endpoint = f"ipc://{tmp_path / 'forged.sock'}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    feed = DaemonFeed(endpoint, NS.fingerprint())
    try:
        key = offload_keys(1, salt=3)[0]
        ours = NS.fingerprint().encode()
        good = msgpack.packb({"seq": 3, "events": [["removed", kvtier_key(key)]]})
        got, deadline = [], time.monotonic() + 30
        while not got:  # PUB drops until the subscription arrived: resend until it counts
            assert time.monotonic() < deadline
            for frames in ([ours, b"\xc1 not msgpack"], [ours, msgpack.packb({"events": 7})],
                           [ours + b"|other", msgpack.packb({"events": [["removed", b"x" * 16]]})],
                           [ours, msgpack.packb({"events": [["removed", None], "junk"]})], [ours, good]):
                pub.send_multipart(frames)
            time.sleep(0.05)
            got = feed.removed()
        assert set(got) == {kvtier_key(key)}
    finally:
        feed.close()
        pub.close(0)
