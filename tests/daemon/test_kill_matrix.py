"""Client death at every point: everything it held is released within bounds."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvtier.client import Client
from tests.daemon.test_reaping import wait_for
from tests.daemon.test_transfer_finality import stays
from tests.helpers import NS, make_kv, spawn

HASHES = [bytes([i]) * 16 for i in range(16)]


def engine_until(socket: str, point: str, ready: str) -> None:
    """Child engine: get to ``point``, signal the parent, then hang until killed."""
    kv = make_kv(seed=3)
    c = Client(socket, name=f"victim-{point}")
    if point != "hello":
        c.register_kv_cache(kv, [0] * 4, NS)
    if point == "mid-store":
        c.store(HASHES, list(range(16)))
    elif point == "mid-load":
        c.load(HASHES, list(range(16)))        # the parent stored these: pins them
    elif point == "swap":
        assert c.offload({"a": list(range(8)), "b": list(range(8, 16))}).wait().ok
    elif point == "mid-offload":
        c.offload({"a": list(range(8))})
    open(ready, "w").close()
    time.sleep(120)


@pytest.mark.parametrize("point", ["hello", "idle", "mid-store", "mid-load", "swap", "mid-offload"])
def test_sigkill_at_every_point_returns_the_pool_to_baseline(daemon_factory, tmp_path, point):
    d = daemon_factory(process=True, env={"KVTIER_COPY_DELAY_S": "0.3"})
    kv = make_kv(seed=3)
    with d.client(name="survivor") as keeper:
        keeper.register_kv_cache(kv, [0] * 4, NS)
        assert keeper.store(HASHES, list(range(16))).wait().ok
        baseline = d.stats()["pool"]
        ready = str(tmp_path / "ready")
        p, _ = spawn(engine_until, d.socket, point, ready)
        assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
        if point in ("mid-load", "mid-offload"):  # kill while its copy runs (each copy stalls 0.3 s;
            # mid-store's blocks are all the survivor's already: skipped, nothing to copy)
            assert wait_for(lambda: any(c["inflight"] for c in d.stats(check=False)["clients"]
                                        if c["name"] != "survivor"), 10)
        os.kill(p.pid, signal.SIGKILL)
        killed = time.monotonic()
        p.join(10)

        def released():
            s = d.stats()
            return ([c["name"] for c in s["clients"]] == ["survivor"] and s["swap"]["bytes"] == 0
                    and s["pool"]["used_bytes"] == baseline["used_bytes"]
                    and s["namespaces"][0]["writing"] == 0)
        assert wait_for(released, 10)
        latency = time.monotonic() - killed
        assert latency < 5.0, latency  # bound for a loaded CI box; ~0.1 s measured
        s = d.stats()  # integrity checked
        assert s["pool"]["blocks"] == 16 and s["totals"]["reaped"] == 1
        # The survivor's data is intact and nothing half-written is visible.
        assert keeper.lookup(HASHES) == 16
        print(f"\n{point}: reaped and released in {latency:.2f}s")
    kv.close()


def test_a_stopped_client_keeps_its_session_while_its_process_lives(daemon_factory, tmp_path):
    """Liveness comes from the kernel, not from heartbeats: an engine that sends
    nothing for many reap periods (stopped here; an engine whose threads fill
    every core looks the same) keeps its session, swap and registration, goes
    on in the same session when it runs again, and is reaped once its process
    is gone."""
    d = daemon_factory(process=True, env={"KVTIER_HEARTBEAT_S": "0.3", "KVTIER_REAP_AFTER_S": "1.5"})
    ready = str(tmp_path / "ready")
    p, _ = spawn(engine_until, d.socket, "swap", ready)
    assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
    sessions = [c["id"] for c in d.stats()["clients"]]
    assert len(sessions) == 1 and d.stats()["swap"]["bytes"] > 0

    def unchanged() -> bool:
        s = d.stats()
        return [c["id"] for c in s["clients"]] == sessions and s["swap"]["bytes"] > 0
    os.kill(p.pid, signal.SIGSTOP)  # alive but silent
    try:
        assert stays(unchanged, 3.0)  # twice reap_after_s without a frame
        os.kill(p.pid, signal.SIGCONT)
        assert stays(unchanged, 1.0)  # no second HELLO: its pings were answered all along
        assert "silent for" not in d.read_log() and "reaped" not in d.read_log()
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
    assert wait_for(lambda: not d.stats()["clients"] and d.stats()["swap"]["bytes"] == 0, 10)
    # Which kernel fact the reaper sees first depends on timing: the exit itself, the
    # socket the exiting process closed, or (a large process tearing down its memory on
    # a loaded box) silence after the kill. Each reaps the session; what matters is that
    # nothing reaped it while it lived (asserted above).
    assert f"(pid {p.pid}) reaped (" in d.read_log()


def test_a_client_whose_connection_closes_is_reaped_at_once(daemon_factory, tmp_path):
    """The connection's end is the other kernel fact: an engine process that
    lives on but dropped its socket (no BYE) loses its session and swap."""
    d = daemon_factory(process=True, env={"KVTIER_HEARTBEAT_S": "0.3", "KVTIER_REAP_AFTER_S": "60"})
    kv = make_kv(seed=4)
    c = d.client(name="dropper", heartbeat=False)
    c.register_kv_cache(kv, [0] * 4, NS)
    assert c.offload({"a": list(range(8))}).wait().ok
    assert d.stats()["swap"]["bytes"] > 0
    with c.channel.own(time.monotonic() + 5):
        c.channel.close_socket()  # what a crashed ZeroMQ context or a leaked client looks like
    assert wait_for(lambda: not d.stats()["clients"] and d.stats()["swap"]["bytes"] == 0, 10)
    assert "reaped (connection closed)" in d.read_log()
    c.close()
    kv.close()
