"""One Client shared by threads: a thread blocked on a transfer never delays another's lookup."""

from __future__ import annotations

import statistics
import threading
import time

from tests.helpers import NS, make_kv


def test_lookup_is_not_held_back_by_a_thread_waiting_on_a_transfer(daemon_factory):
    # Every copy stalls 1 s on the copy thread (inline copies off), so the
    # waiting thread sits in wait() for the whole test.
    d = daemon_factory(env={"KVTIER_COPY_DELAY_S": "1.0", "KVTIER_INLINE_COPY_BYTES": "0"})
    kv = make_kv(seed=1)
    hashes = [bytes([i]) * 16 for i in range(8)]
    with d.client(name="shared") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        results = []
        waiter = threading.Thread(target=lambda: results.append(c.store(hashes, list(range(8))).wait()))
        waiter.start()
        time.sleep(0.1)
        latencies = []
        for _ in range(50):
            t = time.perf_counter()
            assert c.lookup(hashes) == 0  # not committed yet: the store is still copying
            latencies.append(time.perf_counter() - t)
        assert waiter.is_alive()  # all 50 lookups ran while the other thread waited
        waiter.join(10)
        assert results and results[0].ok
        assert c.lookup(hashes) == 8
    # Before the socket-owner design, each lookup queued behind the waiter's 50 ms polls.
    assert statistics.median(latencies) < 0.05, latencies  # was ~0.1 s; ~0.0004 s now
    kv.close()


def test_many_threads_share_one_client(daemon):
    kv = make_kv(seed=2)
    with daemon.client(name="threads") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        errors = []

        def worker(t: int):
            try:
                for rep in range(20):  # distinct hashes per thread and rep: all strict checks
                    mine = [bytes([t, rep, i]) + bytes(13) for i in range(4)]
                    assert c.store(mine, [t * 4 + i for i in range(4)]).wait().ok
                    assert c.lookup(mine) == 4
                    assert c.load(mine, [t * 4 + i for i in range(4)]).wait().ok
            except Exception as exc:  # noqa: BLE001 - reported to the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert c.stats()["namespaces"][0]["stored"] == 6 * 20 * 4
    kv.close()
