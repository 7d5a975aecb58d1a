"""Client session loss: what an engine sees when the daemon forgets it."""

from __future__ import annotations

import time

from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

# Reap a silent client after 0.5 s; every copy stalls 5 s so a store is still in flight.
FAST_REAP = {"KVTIER_HEARTBEAT_S": "0.2", "KVTIER_REAP_AFTER_S": "0.5", "KVTIER_COPY_DELAY_S": "5"}


def test_forgotten_client_fails_inflight_transfers_at_once(daemon_factory):
    d = daemon_factory(env=FAST_REAP)
    kv = make_kv(seed=2)
    hashes = [bytes([i]) * 16 for i in range(4)]
    # No heartbeat thread: the client goes silent and the daemon reaps it mid-store.
    c = d.client(name="stalled", heartbeat=False)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        h = c.store(hashes, [0, 1, 2, 3])
        assert wait_for(lambda: not d.stats(check=False)["clients"], 10)
        # The next call hears NOT_CONNECTED. discard is a no-op then (the swap
        # went with the session), like lookup returning 0 ...
        c.discard("never-offloaded")
        assert not c.connected and c.lookup(hashes) == 0
        # ... and the store the daemon abandoned resolves now, not after
        # transfer_timeout (60 s).
        t = time.monotonic()
        assert h.done()
        r = h.wait()
        assert time.monotonic() - t < 1.0
        assert r.failed == (0, 1, 2, 3) and "no longer knows" in r.error
    finally:
        c.close()
        kv.close()
