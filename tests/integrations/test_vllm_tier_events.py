"""The scheduler side's KV events (``events.py``) with vLLM's own types and a real daemon.

The manager announces chunks as vLLM's scheduler will publish them
(``take_events`` -> ``OffloadingEvent``, medium CPU): once each when stored
or found, and as removed when the daemon says it dropped them (its block
event socket) or a lookup finds them gone. The full engine with vLLM's ZMQ
publisher is in ``test_vllm_events.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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
from tests.conftest import REPO  # noqa: E402
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
        good = msgpack.packb({"seq": 3, "tenant": "t", "events": [["removed", kvtier_key(key)]]})
        got, deadline = [], time.monotonic() + 30
        while not got:  # PUB drops until the subscription arrived: resend until it counts
            assert time.monotonic() < deadline
            for frames in ([ours, b"\xc1 not msgpack"], [ours, msgpack.packb({"events": 7})],
                           [ours + b"|other", msgpack.packb({"events": [["removed", b"x" * 16]]})],
                           [ours, msgpack.packb({"events": [["removed", None], "junk"]})], [ours, good]):
                pub.send_multipart(frames)
            time.sleep(0.05)
            got = [k for _, events in feed.messages() for kind, k in events if kind == "removed"]
        assert set(got) == {kvtier_key(key)}
    finally:
        feed.close()
        pub.close(0)


# ---- issue 30, rows 12-13: whose blocks, and which copy ------------------------------------
def test_feed_messages_of_another_tenant_or_of_one_copy_never_remove_a_chunk():
    """Sans-IO: the feed's messages name a tenant; only this engine's count. A RAM
    eviction of a block whose disk copy is complete leaves it a hit; the chunk is
    removed when the disk copy goes too."""
    class Feed:
        def __init__(self):
            self.queue = []

        def messages(self):
            out, self.queue = self.queue, []
            return out

        def close(self):
            pass
    feed = Feed()
    ev = TierEvents(True, feed, tenant=lambda: "a")
    keys = offload_keys(2, salt=7)
    ev.stored(keys)
    ev.take()
    k0, k1 = (kvtier_key(k) for k in keys)
    feed.queue = [("b", [("removed", k0), ("removed", k1)])]  # tenant b's namespace, same fingerprint
    assert ev.take() == []
    feed.queue = [("a", [("disk_stored", k0), ("removed", k0), ("removed", k1)])]
    (gone,) = ev.take()
    assert gone.removed and gone.keys == keys[1:]  # k1 had no disk copy; k0 still has one
    feed.queue = [("a", [("disk_removed", k0)])]
    (gone,) = ev.take()
    assert gone.removed and gone.keys == keys[:1]


def watch(endpoint: str):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, NS.fingerprint().encode())
    sub.connect(endpoint if "://" in endpoint else "ipc://" + endpoint)
    return sub


def seen(sub, want, timeout: float = 30.0) -> bool:
    """Read the watcher until ``want(tenant, kind, key)`` held for some event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            body = msgpack.unpackb(sub.recv_multipart()[1])
            if any(want(body["tenant"], kind, k) for kind, k in body["events"]):
                return True
    return False


def drained(manager) -> list:
    """Everything the manager reports once its feed has nothing more to read."""
    feed = manager.events.feeds[0].sub
    assert feed.poll(30_000)  # the messages the watcher saw reach this feed too
    got = []
    while True:
        got.extend(manager.take_events())
        if not feed.poll(500):
            return got + list(manager.take_events())


TENANT_B = """
import json, sys
sys.path.insert(0, {repo!r})
from kvtier.client import Client
from kvtier.integrations.vllm.groups import TierGroup
from kvtier.integrations.vllm.manager import KVTierManager
from kvtier.integrations.vllm.worker import KVTierWorker
from tests.integrations.test_vllm_tier_events import offload_keys, store
from tests.integrations.test_vllm_worker import K, LAYERS, NS, PAGE, canonical_caches
from tests.privileges import drop_to
drop_to({uid})
sock = sys.argv[1]
worker = KVTierWorker(canonical_caches(seed=5)[0], NS, K, sock, name="tenant-b-worker")
manager = KVTierManager([TierGroup(0, NS, LAYERS * PAGE)], K, sock, name="tenant-b-scheduler")
store(worker, manager, offload_keys(3, salt=12), job=1)  # the same chunks, in its own namespace
with Client(sock, name="tenant-b") as c:
    print(json.dumps({{"flushed": c.flush(NS)}}))
manager.shutdown(); worker.shutdown()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the other tenant runs as another uid")
def test_another_tenant_flushing_its_namespace_of_the_same_fingerprint_removes_nothing_of_ours(tmp_path):
    """Tenant B (another uid) stores the same chunks under the same fingerprint
    and flushes its own namespace. Before: A's engine reported all of A's
    chunks removed while A still hit them. After: nothing."""
    from tests.conftest import DaemonProc
    from tests.daemon.test_tenants import ATTACKER
    run = tempfile.mkdtemp(prefix="kvt-vllm-tenants-")
    os.chmod(run, 0o755)
    endpoint = str(tmp_path / "events.sock")
    d = DaemonProc(tmp_path, env={"KVTIER_SOCKET_MODE": "666"}, extra=["--events", endpoint],
                   socket=os.path.join(run, "kvtier.sock"))
    watcher = watch(endpoint)
    caches, _ = canonical_caches(seed=3)
    worker = KVTierWorker(caches, NS, K, d.socket, name="tenant-a-worker")
    manager = KVTierManager([TierGroup(0, NS, LAYERS * PAGE)], K, d.socket, name="tenant-a-scheduler",
                            events=TierEvents(True, DaemonFeed(endpoint, NS.fingerprint())))
    try:
        keys = offload_keys(3, salt=12)
        store(worker, manager, keys, job=1)
        (stored,) = manager.take_events()
        assert not stored.removed
        out = subprocess.run([sys.executable, "-c", TENANT_B.format(repo=REPO, uid=ATTACKER), d.socket],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["flushed"] == 3  # its own 3 chunks
        assert seen(watcher, lambda tenant, kind, k: kind == "removed" and tenant != "uid0")
        reported = drained(manager)
        print(f"\nafter tenant B's flush, A's engine reported: {[(e.removed, len(e.keys)) for e in reported]}")
        assert not any(e.removed for e in reported)
        manager.prefetch("r2", keys)
        assert all(manager.lookup(k, req("r2")) == vllm_base.LookupResult.HIT for k in keys)
    finally:
        watcher.close(0)
        manager.shutdown()
        worker.shutdown()
        d.stop()
        shutil.rmtree(run, ignore_errors=True)


def test_a_ram_eviction_of_a_block_on_disk_is_not_announced_as_removed(daemon_factory, tmp_path):
    """With the disk tier, A's chunks reach the disk, then another engine's stores
    evict them from RAM: lookups still hit (from disk), so nothing is removed.
    Before: every chunk was reported removed. Once the disk copy goes too
    (an operator's flush), they are."""
    from tests.daemon.test_disk_tier import disk_env, evict_ram, written
    from tests.helpers import NS as OTHER_NS, make_kv
    endpoint = str(tmp_path / "events.sock")
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tmp_path / "disk", "16MiB"),
                       extra=["--events", endpoint])
    watcher = watch(endpoint)
    caches, _ = canonical_caches(seed=3)
    worker = KVTierWorker(caches, NS, K, d.socket, name="vllm-worker-disk")
    manager = KVTierManager([TierGroup(0, NS, LAYERS * PAGE)], K, d.socket, name="vllm-scheduler-disk",
                            events=TierEvents(True, DaemonFeed(endpoint, NS.fingerprint())))
    kv = make_kv(seed=4)
    try:
        keys = offload_keys(3, salt=13)
        store(worker, manager, keys, job=1)
        assert written(d, 3)
        with d.client(name="other-engine") as c:
            c.register_kv_cache(kv, [0] * 4, OTHER_NS)
            evict_ram(d, c, range(100, 108))
        assert seen(watcher, lambda tenant, kind, k: kind == "removed")  # A's blocks left RAM
        reported = drained(manager)
        print(f"\nafter A's chunks left RAM (still on disk): {[(e.removed, len(e.keys)) for e in reported]}")
        assert not any(e.removed for e in reported)
        manager.prefetch("r3", keys)
        assert all(manager.lookup(k, req("r3")) == vllm_base.LookupResult.HIT for k in keys)
        with d.client(name="operator") as c:
            c.flush(NS)
        assert sorted(k for e in events_of(manager, 1) for k in e.keys if e.removed) == sorted(keys)
    finally:
        watcher.close(0)
        manager.shutdown()
        worker.shutdown()
        kv.close()
