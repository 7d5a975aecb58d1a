"""The opt-in PUB stream reports blocks stored and removed, per namespace, in order."""

from __future__ import annotations

import time

import msgpack
import zmq

from tests.daemon.test_swap import prefix_chain
from kvtier.client import Namespace
from tests.helpers import NS, make_kv


def collect(sub, until_count: int, timeout: float = 5.0) -> list:
    msgs, deadline = [], time.monotonic() + timeout
    while sum(len(b["events"]) for _, b in msgs) < until_count and time.monotonic() < deadline:
        if sub.poll(100):
            topic, body = sub.recv_multipart()
            msgs.append((topic.decode(), msgpack.unpackb(body)))
    return msgs


PROBE = Namespace("subscription-probe", "float16", "flashinfer", 16)


def wait_until_subscribed(d, sub, kv, timeout: float = 10.0) -> None:
    """Store probe blocks until the subscriber sees one: subscriptions travel in
    order, so the namespace's subscription (sent first) is in place too."""
    deadline, i = time.monotonic() + timeout, 0
    with d.client(name="probe") as c:
        c.register_kv_cache(kv, [0] * 4, PROBE)
        while time.monotonic() < deadline:
            c.store([bytes([0xEE, i % 256]) * 8], [0]).wait()
            i += 1
            if sub.poll(50):
                topic, _ = sub.recv_multipart()
                assert topic.decode() == PROBE.fingerprint()
                c.flush(PROBE)  # its removals are filtered out with the probe's topic
                return
    raise AssertionError("the event subscription never became live")


def test_event_stream_reports_stores_evictions_and_flush_in_order(daemon_factory, tmp_path):
    events = "ipc://" + str(tmp_path / "events.sock")
    d = daemon_factory(pool_size="1MiB", slab_size="1MiB", extra=["--events", events])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, NS.fingerprint().encode())  # one namespace only
    sub.setsockopt(zmq.SUBSCRIBE, PROBE.fingerprint().encode())  # readiness probe, sent after it
    sub.connect(events)
    kv = make_kv(seed=1)
    wait_until_subscribed(d, sub, kv)
    chain = prefix_chain(80)
    with d.client() as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(chain[:64], [i % 32 for i in range(64)]).wait().ok  # fills the pool
        assert c.store(chain[64:], [i % 32 for i in range(16)]).wait().ok  # evicts 16
        assert c.flush() == 64
    msgs = [(t, b) for t, b in collect(sub, 64 + 16 + 16 + 64) if t != PROBE.fingerprint()]
    sub.close(0)
    assert {t for t, _ in msgs} == {NS.fingerprint()}
    seqs = [b["seq"] for _, b in msgs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    flat = [(kind, bytes(h)) for _, b in msgs for kind, h in b["events"]]
    stored_first = [h for k, h in flat[:64]]
    assert all(k == "stored" for k, _ in flat[:64]) and set(stored_first) == set(chain[:64])
    # The second store evicted 16 old blocks (tails of the chain first) before committing.
    evicted = [h for k, h in flat[64:80]]
    assert all(k == "removed" for k, _ in flat[64:80])
    assert set(evicted) == set(chain[48:64])
    assert [k for k, _ in flat[80:96]] == ["stored"] * 16
    assert sorted(h for _, h in flat[96:]) == sorted(chain[:48] + chain[64:])
    assert all(k == "removed" for k, _ in flat[96:])
    kv.close()
