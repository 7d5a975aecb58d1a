"""A subscriber that never reads the event socket cannot grow the daemon (issue 30, row 7).

Every store and flush publishes block events; ZeroMQ queues them per
subscriber until it reads. The daemon holds at most ``EVENTS_HWM`` messages
of at most ``MAX_EVENTS_PER_MESSAGE`` events for each subscriber; past that
it drops new messages and counts them (stats ``events``, metric
``kvtier_events_dropped``), and it keeps serving. A real daemon process, a
real subscriber that connects, subscribes to everything and then stops reading.
"""

from __future__ import annotations

import psutil
import torch
import zmq

from kvtier.client import Namespace, ShmKVCache
from kvtier.daemon.listen import EVENTS_HWM
from kvtier.daemon.server import MAX_EVENTS_PER_MESSAGE
from tests.daemon.test_attacks import serves_a_good_client
from tests.daemon.test_events import wait_until_subscribed
from tests.helpers import make_kv

MiB = 2**20
BLOCKS = 4096  # per store: one message of 4,096 events (~100 KiB) before, 8 of 512 after
TINY = Namespace("tiny-blocks", "float16", "flashinfer", 1)  # 64 B blocks: many events, little pool


def test_a_subscriber_that_never_reads_cannot_grow_the_daemon(daemon_factory, tmp_path):
    events = "ipc://" + str(tmp_path / "events.sock")
    d = daemon_factory(process=True, extra=["--events", events])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)  # it holds next to nothing itself: the backlog would be the daemon's
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    probe = make_kv(seed=2)
    wait_until_subscribed(d, sub, probe)  # from here on it never reads again
    kv = ShmKVCache([(BLOCKS, 2, 1, 1, 4)] * 4, torch.float16)
    daemon = psutil.Process(d.proc.pid)
    try:
        with d.client(name="churn") as c:
            c.register_kv_cache(kv, [0] * 4, TINY)

            def churn(rounds: int) -> None:  # a tenant's ordinary stores and flushes
                for r in range(rounds):
                    hashes = [r.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(8) for i in range(BLOCKS)]
                    assert c.store(hashes, list(range(BLOCKS))).wait().ok
                    assert c.flush(TINY) == BLOCKS
            churn(4)
            before = daemon.memory_info().rss
            churn(300)
            grown = daemon.memory_info().rss - before
        s = d.stats()["events"]
        print(f"\nsubscriber that never reads, 300 x (store {BLOCKS} + flush): daemon RSS +{grown / MiB:.1f} MiB; "
              f"events published {s['published']}, dropped {s['dropped']} in {s['dropped_messages']} messages")
        assert grown < 24 * MiB  # at most EVENTS_HWM x ~15 KiB (~4 MiB) waits for the subscriber
        assert s["dropped"] > 0 and s["dropped_messages"] > 0
        assert s["published"] + s["dropped"] >= 300 * 2 * BLOCKS
        assert EVENTS_HWM * MAX_EVENTS_PER_MESSAGE * 40 < 24 * MiB  # ~40 B an event, msgpack'd: the bound holds
        assert serves_a_good_client(d)
    finally:
        sub.close(0)
        kv.close()
        probe.close()
