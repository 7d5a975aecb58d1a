"""Loads from several clients at once share the copy threads fairly and
stay exact: each client's copy runs one chunk per turn, round-robin between
clients, on ``copy_threads`` threads.

Real daemons (in-process where no process boundary is under test), real
ZeroMQ and shared memory. Copies are slowed and cut into one-block chunks
(``copy_delay_s`` before each 16 KiB chunk) so the orders below are forced
by the length of the copies, not by timing assertions.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from kvtier.client import Client
from kvtier.daemon.config import DaemonConfig, load_config
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, engine_mid_transfer, flip_a_pool_byte, make_kv, spawn

BLOCKS = 32  # SHAPE's whole cache: 32 blocks of 16 KiB
HASHES = [bytes([0xC0, i]) * 8 for i in range(BLOCKS)]
IDS = list(range(BLOCKS))


def slow(delay: float, threads: int | None = None) -> dict:
    env = {"KVTIER_COPY_DELAY_S": str(delay), "KVTIER_COPY_CHUNK_BYTES": "16KiB"}
    if threads is not None:
        env["KVTIER_COPY_THREADS"] = str(threads)
    return env


def same_blocks(a, b, ids_a, ids_b) -> bool:
    return all(torch.equal(x[ids_a], y[ids_b]) for x, y in zip(a.tensors, b.tensors))


def stored(d, src) -> Client:
    """A client that stored ``src``'s 32 blocks under HASHES (still registered)."""
    keeper = d.client(name="keeper")
    keeper.register_kv_cache(src, [0] * 4, NS)
    assert keeper.store(HASHES, IDS).wait().ok
    return keeper


def test_the_default_uses_more_than_one_copy_thread_where_the_machine_has_cores():
    threads = DaemonConfig().copy_threads
    assert threads == min(4, len(os.sched_getaffinity(0)))


def test_four_clients_loading_one_prefix_at_once_each_get_exact_bytes(daemon_factory):
    d = daemon_factory(env=slow(0.01))  # the default copy_threads
    src = make_kv(seed=11)
    caches = [make_kv(seed=20 + i) for i in range(4)]
    with stored(d, src) as keeper:
        engines = [d.client(name=f"engine-{i}") for i in range(4)]
        for c, kv in zip(engines, caches):
            c.register_kv_cache(kv, [0] * 4, NS)
        start, results = threading.Barrier(4), [None] * 4

        def load(i):
            start.wait()
            results[i] = engines[i].load(HASHES, IDS).wait()

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None and r.ok for r in results)
        assert all(same_blocks(src, kv, IDS, IDS) for kv in caches)
        assert d.stats()["totals"]["loads"] == 4
        for c in engines:
            c.close()
        assert keeper.flush(NS) == BLOCKS  # no load left a block pinned
    for kv in (src, *caches):
        kv.close()


def test_a_small_load_sent_after_another_clients_big_one_finishes_first(daemon_factory):
    # One copy thread: the big load's 32 chunks (0.2 s each) would hold the small
    # one for ~6 s if copies ran whole; by turns it waits for one chunk.
    d = daemon_factory(env=slow(0.2, threads=1))
    src, big_kv, small_kv = make_kv(seed=12), make_kv(seed=13), make_kv(seed=14)
    with stored(d, src), d.client(name="big") as big, d.client(name="small") as small:
        big.register_kv_cache(big_kv, [0] * 4, NS)
        small.register_kv_cache(small_kv, [0] * 4, NS)
        big_load = big.load(HASHES, IDS)
        big.ping()  # answered after the load was accepted and queued: the big copy is under way
        assert small.load(HASHES[:1], [5]).wait().ok
        assert not big_load.done()  # the small one ended while the big one still ran
        assert big_load.wait().ok
        assert same_blocks(src, big_kv, IDS, IDS) and same_blocks(src, small_kv, [0], [5])
    for kv in (src, big_kv, small_kv):
        kv.close()


def test_a_cancelled_load_beside_another_clients_load_releases_its_blocks(daemon_factory):
    d = daemon_factory(env=slow(0.1, threads=4))
    src, late_kv, other_kv = make_kv(seed=15), make_kv(seed=16), make_kv(seed=17)
    with stored(d, src) as keeper, d.client(name="late", transfer_timeout=0.5) as late, \
            d.client(name="other") as other:
        late.register_kv_cache(late_kv, [0] * 4, NS)
        other.register_kv_cache(other_kv, [0] * 4, NS)
        late_load, other_load = late.load(HASHES, IDS), other.load(HASHES, IDS)
        result = late_load.wait()  # ~3 s of copy, cancelled after 0.5 s
        assert result.failed == tuple(range(BLOCKS)) and "cancelled" in result.error
        assert other_load.wait().ok and same_blocks(src, other_kv, IDS, IDS)
        assert d.stats()["totals"]["cancelled"] == 1
        assert keeper.flush(NS) == BLOCKS
    for kv in (src, late_kv, other_kv):
        kv.close()


def test_sigkill_of_a_client_mid_copy_on_several_threads_releases_everything(daemon_factory, tmp_path):
    d = daemon_factory(process=True, env=slow(0.1, threads=4))
    src, other_kv = make_kv(seed=19), make_kv(seed=20)
    with stored(d, src) as keeper, d.client(name="other") as other:
        other.register_kv_cache(other_kv, [0] * 4, NS)
        baseline = d.stats()["pool"]["used_bytes"]
        ready = str(tmp_path / "ready")
        p, _ = spawn(engine_mid_transfer, d.socket, ready, "load", HASHES, IDS, 18, 120)
        assert wait_for(lambda: os.path.exists(ready), 120)
        assert wait_for(lambda: any(c["inflight"] for c in d.stats(check=False)["clients"]
                                    if c["name"] == "victim"), 10)
        other_load = other.load(HASHES, IDS)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert other_load.wait().ok and same_blocks(src, other_kv, IDS, IDS)

        def released():
            s = d.stats()
            return (sorted(c["name"] for c in s["clients"]) == ["keeper", "other"]
                    and s["pool"]["used_bytes"] == baseline)
        assert wait_for(released, 30)
        assert d.stats()["totals"]["reaped"] == 1
        assert keeper.flush(NS) == BLOCKS  # the killed load's pins are gone too
    for kv in (src, other_kv):
        kv.close()


def test_a_corrupt_block_fails_in_every_chunked_load_that_reads_it_and_the_rest_arrive_exact(daemon_factory):
    d = daemon_factory(process=True, env={**slow(0.01, threads=4), "KVTIER_CHECKSUMS": "1"})
    src, a_kv, b_kv = make_kv(seed=21), make_kv(seed=22), make_kv(seed=23)
    with stored(d, src), d.client(name="a") as a, d.client(name="b") as b:
        a.register_kv_cache(a_kv, [0] * 4, NS)
        b.register_kv_cache(b_kv, [0] * 4, NS)
        # Corrupt one byte of block 9 inside the daemon's pool (bit rot, a stray write).
        flip_a_pool_byte(d.proc.pid, src.tensors[0][9])
        results = [h.wait() for h in (a.load(HASHES, IDS), b.load(HASHES, IDS))]
        good = [i for i in IDS if i != 9]
        for r, kv in zip(results, (a_kv, b_kv)):
            assert r.failed == (9,)  # reported, so the engine recomputes block 9
            assert same_blocks(src, kv, good, good)
        assert a.lookup(HASHES[:9]) == 9 and a.lookup(HASHES[9:10]) == 0  # the corrupt block is gone
        assert d.stats()["errors"]["CHECKSUM"] >= 1
    for kv in (src, a_kv, b_kv):
        kv.close()


def test_copy_threads_out_of_range_or_not_a_number_is_refused_naming_the_key():
    for raw in ("0", "65", "-1", "four", "2.5", "1e9"):
        try:
            load_config(env={"KVTIER_CONFIG": os.devnull, "KVTIER_COPY_THREADS": raw})
        except ValueError as exc:
            assert "copy_threads" in str(exc), (raw, exc)
        else:
            raise AssertionError(f"copy_threads={raw!r} was accepted")
