"""A resolved transfer is final: once a handle is done, the daemon never reads
or writes that transfer's engine blocks again, and a store that resolved as
failed is never committed - for timeouts, reaps, drains and deaths alike.

Every test runs a real daemon whose copies are slow and cut into small
chunks (``copy_delay_s`` before each 16 KiB chunk, one engine block each), so
a timeout, signal or kill lands in the middle of a copy. Each asserts on
bytes or on what another client can see, over the whole time the old copy
would still have been running.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, engine_mid_transfer, make_kv, spawn

CHUNK_DELAY = 0.3
SLOW = {"KVTIER_COPY_DELAY_S": str(CHUNK_DELAY), "KVTIER_COPY_CHUNK_BYTES": "16KiB"}
BLOCKS = 6                      # 6 chunks: the full copy takes ~1.8 s
HASHES = [bytes([0xA0 + i]) * 16 for i in range(BLOCKS)]
IDS = list(range(BLOCKS))


def stays(pred, seconds: float, interval: float = 0.05) -> bool:
    """``pred`` holds at every check for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not pred():
            return False
        time.sleep(interval)
    return True


def fill(kv, ids, value: float) -> None:
    for t in kv.tensors:
        t[ids] = value


def blocks_equal(kv, ids, value: float) -> bool:
    return all(bool((t[ids] == value).all()) for t in kv.tensors)


def test_a_store_that_timed_out_is_never_committed(daemon_factory):
    d = daemon_factory(process=True, env=SLOW)
    kv = make_kv(seed=1)
    with d.client(name="engine", transfer_timeout=0.5) as engine, d.client(name="other") as other:
        engine.register_kv_cache(kv, [0] * 4, NS)
        other.register_kv_cache(kv, [0] * 4, NS)
        started = time.monotonic()
        result = engine.store(HASHES, IDS).wait()
        # Resolved by the daemon's confirmation shortly after the timeout, not after the copy.
        assert result.failed == tuple(range(BLOCKS)) and "cancelled" in result.error
        assert time.monotonic() - started < BLOCKS * CHUNK_DELAY
        # The engine reuses the blocks at once, as it was told it may.
        fill(kv, IDS, 7.0)
        s = d.stats()
        assert s["namespaces"][0]["writing"] == 0 and s["pool"]["blocks"] == 0
        assert s["totals"]["cancelled"] == 1
        # Until well after the old copy would have ended, nobody ever sees those hashes.
        assert stays(lambda: other.lookup(HASHES) == 0, BLOCKS * CHUNK_DELAY + 0.5)
    kv.close()


def test_a_load_that_timed_out_never_overwrites_what_the_engine_wrote_next(daemon_factory):
    d = daemon_factory(process=True, env=SLOW)
    src, dst = make_kv(seed=2), make_kv(seed=3)
    with d.client(name="writer") as writer, d.client(name="reader", transfer_timeout=0.5) as reader:
        writer.register_kv_cache(src, [0] * 4, NS)
        reader.register_kv_cache(dst, [0] * 4, NS)
        assert writer.store(HASHES, IDS).wait().ok
        started = time.monotonic()
        result = reader.load(HASHES, IDS).wait()
        assert result.failed == tuple(range(BLOCKS)) and "cancelled" in result.error
        assert time.monotonic() - started < BLOCKS * CHUNK_DELAY
        fill(dst, IDS, -3.0)  # the engine recomputes into the same blocks
        assert stays(lambda: blocks_equal(dst, IDS, -3.0), BLOCKS * CHUNK_DELAY + 0.5)
        # The pins went with the cancel: the blocks are loadable again.
        assert d.stats()["totals"]["cancelled"] == 1
        reader.transfer_timeout = 60.0
        assert reader.load(HASHES, IDS).wait().ok
        assert all(torch.equal(a[IDS], b[IDS]) for a, b in zip(src.tensors, dst.tensors))
    src.close()
    dst.close()


def test_sigterm_drains_while_still_serving_and_answers_every_transfer(daemon_factory):
    # Copies (~2.4 s) outlast the client's loss detection (2 missed heartbeats = 2 s).
    d = daemon_factory(process=True, env={**SLOW, "KVTIER_COPY_DELAY_S": "0.4"})
    src, dst = make_kv(seed=4), make_kv(seed=5)
    with d.client(name="a") as a, d.client(name="b") as b:
        a.register_kv_cache(src, [0] * 4, NS)
        b.register_kv_cache(dst, [0] * 4, NS)
        store = a.store(HASHES, IDS)
        assert wait_for(lambda: d.stats(check=False)["clients"][0]["inflight"] == 1, 5)
        d.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: "shutting down: draining" in d.read_log(), 5)
        # Draining, yet serving: pings answered, new work refused at once.
        a.ping()
        refused = b.store([b"\x01" * 16], [0]).wait(timeout=5)
        assert refused.failed == (0,) and "shutting down" in refused.error
        assert b.lookup(HASHES) == 0
        result = store.wait(timeout=10)
        assert result.ok and result.done == BLOCKS  # answered when its copy ended
        # Never declared lost during the drain: once its last copy is answered the
        # daemon exits, and only that hang-up may end the client's connection.
        if not a.connected:
            assert d.proc.wait(10) == 0
        fill(src, IDS, 9.0)
        assert d.proc.wait(10) == 0
        assert blocks_equal(src, IDS, 9.0)
    src.close()
    dst.close()


def test_a_drain_past_its_deadline_cancels_and_still_answers(daemon_factory):
    d = daemon_factory(process=True, env={**SLOW, "KVTIER_DRAIN_TIMEOUT_S": "0.5"})
    src, dst = make_kv(seed=6), make_kv(seed=7)
    half = BLOCKS // 2
    with d.client(name="writer") as writer, d.client(name="reader") as reader:
        writer.register_kv_cache(src, [0] * 4, NS)
        reader.register_kv_cache(dst, [0] * 4, NS)
        assert writer.store(HASHES[:half], IDS[:half]).wait().ok
        load = reader.load(HASHES[:half], IDS[:half])       # runs first on the copy thread
        store = writer.store(HASHES[half:], IDS[half:])     # queued behind it
        assert wait_for(lambda: sum(c["inflight"] for c in d.stats(check=False)["clients"]) == 2, 5)
        d.proc.send_signal(signal.SIGTERM)
        stored, loaded = store.wait(timeout=10), load.wait(timeout=10)
        # Answered by the daemon ("cancelled"), or - if its exit was noticed before
        # the answer was read - failed because its process is gone. Never "done".
        assert stored.failed == tuple(range(BLOCKS - half)) and loaded.failed == tuple(range(half))
        assert d.read_log().count("cancelled (daemon shutting down)") == 2
        fill(src, IDS, 5.0)
        fill(dst, IDS, -5.0)
        assert d.proc.wait(60) == 0  # a clean exit (a loaded machine took over 10 s to get there)
        assert blocks_equal(src, IDS, 5.0) and blocks_equal(dst, IDS, -5.0)
    src.close()
    dst.close()


def test_a_client_killed_mid_store_leaves_no_visible_block(daemon_factory, tmp_path):
    d = daemon_factory(process=True, env=SLOW)
    ready = str(tmp_path / "ready")
    p, _ = spawn(engine_mid_transfer, d.socket, ready, "store", HASHES, IDS, 8, 60)
    assert wait_for(lambda: os.path.exists(ready), 120)  # a new interpreter: slow when busy
    assert wait_for(lambda: d.stats(check=False)["namespaces"][0]["writing"] == BLOCKS, 5)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    kv = make_kv(seed=9)
    with d.client(name="observer") as observer:
        observer.register_kv_cache(kv, [0] * 4, NS)
        assert wait_for(lambda: d.stats()["namespaces"][0]["writing"] == 0, 5)
        assert stays(lambda: observer.lookup(HASHES) == 0, BLOCKS * CHUNK_DELAY)
        assert d.stats()["pool"]["blocks"] == 0
    kv.close()


def test_a_daemon_killed_mid_copy_fails_the_transfer_and_nothing_half_written_survives(daemon_factory):
    d = daemon_factory(process=True, env=SLOW)
    kv = make_kv(seed=10)
    c = d.client(name="engine", transfer_timeout=60.0)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        h = c.store(HASHES, IDS)
        assert wait_for(lambda: d.stats(check=False)["namespaces"][0]["writing"] == BLOCKS, 5)
        d.proc.kill()
        d.proc.wait(10)
        # The daemon's death is what frees the blocks: no 60 s timeout needed.
        result = h.wait(timeout=10)
        assert result.failed == tuple(range(BLOCKS)) and h.held_blocks == ()
        # A new daemon on the same socket starts empty; the client comes back by itself.
        d2 = subprocess_daemon_like(d)
        assert wait_for(lambda: c.connected, 15)
        assert c.lookup(HASHES) == 0
        d2.stop()
    finally:
        c.close()
        kv.close()


def subprocess_daemon_like(d):
    from tests.conftest import DaemonProc
    return DaemonProc(d.log_path.parent, socket=d.socket)


def test_close_never_gives_up_blocks_a_stopped_daemon_may_still_write(daemon_factory):
    """A daemon stopped (SIGSTOP) mid-load cannot confirm the cancel that
    close() sends: close(timeout) returns False and leaves the handle pending,
    its blocks held. Resumed, the daemon confirms; a second close() finishes,
    and from then on nothing writes the blocks the engine reuses. (Before:
    close gave up after 5 s, failed the handle and released the blocks, and
    the resumed daemon wrote into blocks the engine had reused.)"""
    d = daemon_factory(process=True, env=SLOW)
    src, dst = make_kv(seed=11), make_kv(seed=12)
    with d.client(name="writer") as writer:
        writer.register_kv_cache(src, [0] * 4, NS)
        assert writer.store(HASHES, IDS).wait().ok
    reader = d.client(name="reader")
    reader.register_kv_cache(dst, [0] * 4, NS)
    load = reader.load(HASHES, IDS)
    assert wait_for(lambda: d.stats(check=False)["clients"][0]["inflight"] == 1, 5)
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        assert reader.close(timeout=1.0) is False
        assert not load.done() and load.held_blocks == tuple(IDS)
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    assert reader.close() is True
    assert load.done() and load.held_blocks == ()
    fill(dst, IDS, -7.0)  # the engine reuses the blocks
    assert stays(lambda: blocks_equal(dst, IDS, -7.0), BLOCKS * CHUNK_DELAY + 0.5)
    src.close()
    dst.close()
