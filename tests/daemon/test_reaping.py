"""A client killed with SIGKILL mid-store/mid-load leaves nothing behind."""

from __future__ import annotations

import os
import signal
import time

from kvtier.client import Client
from tests.helpers import NS, make_kv, spawn


def store_then_hang(socket: str, ready_path: str) -> None:
    """Child engine: start a big store, tell the parent, then wait to be killed."""
    kv = make_kv(seed=5)
    c = Client(socket, name="victim")
    c.register_kv_cache(kv, [0] * 4, NS)
    c.store([bytes([i]) * 16 for i in range(32)], list(range(32)))  # copy is stalled by the daemon
    open(ready_path, "w").close()
    time.sleep(60)


def wait_for(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False


def test_killed_mid_store_leaves_no_blocks_or_pins(daemon_factory, tmp_path):
    # Every copy stalls 1 s, so the store is certainly in flight when we kill.
    d = daemon_factory(process=True, extra=["--log-level", "INFO"], env={"KVTIER_COPY_DELAY_S": "1.0"})
    ready = str(tmp_path / "ready")
    p, _ = spawn(store_then_hang, d.socket, ready)
    assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
    s = d.stats()
    assert s["namespaces"][0]["writing"] == 32  # reserved but invisible
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    killed_at = time.monotonic()

    # The daemon notices the dead pid, abandons the store and frees the space.
    # (The namespace, empty and unregistered, may already be forgotten.)
    def clean():
        s = d.stats()
        return not s["clients"] and s["pool"]["used_bytes"] == 0 and all(n["writing"] == 0 for n in s["namespaces"])
    assert wait_for(clean, 30)
    print(f"\nreaped {time.monotonic() - killed_at:.2f} s after the kill")
    s = d.stats()
    assert all(n["blocks"] == 0 and n["stored"] == 0 for n in s["namespaces"])
    assert s["totals"]["reaped"] == 1
    # No half-written block is visible to anyone.
    kv = make_kv()
    with d.client() as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup([bytes([i]) * 16 for i in range(32)]) == 0
    kv.close()
    # The dead engine's KV segment was unlinked by the daemon.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-kv.{p.pid}.")]
    assert "reaped (process exited)" in d.read_log()


def load_then_hang(socket: str, ready_path: str) -> None:
    kv = make_kv()
    c = Client(socket, name="loader")
    c.register_kv_cache(kv, [0] * 4, NS)
    c.load([bytes([i]) * 16 for i in range(16)], list(range(16)))  # pins 16 blocks
    open(ready_path, "w").close()
    time.sleep(60)


def test_killed_mid_load_releases_pins(daemon_factory, tmp_path):
    d = daemon_factory(process=True, env={"KVTIER_COPY_DELAY_S": "0.5"})
    kv = make_kv(seed=9)
    hashes = [bytes([i]) * 16 for i in range(16)]
    with d.client(name="writer") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, list(range(16))).wait().ok
        ready = str(tmp_path / "ready")
        p, _ = spawn(load_then_hang, d.socket, ready)
        assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert wait_for(lambda: len(d.stats()["clients"]) == 1, 10)
        # Pins drop once the stalled copy finishes; the blocks stay cached and flushable.
        assert wait_for(lambda: d.stats()["pool"]["blocks"] == 16, 5)
        assert wait_for(lambda: c.flush() == 16, 5)
        s = d.stats()
        assert s["pool"]["used_bytes"] == 0 and s["pool"]["blocks"] == 0
    kv.close()
