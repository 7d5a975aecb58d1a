"""Tenants sharing a node's remote tier cannot crowd each other out (issue 30), against
real daemons and a real three-master Redis Cluster stalled with SIGSTOP (alive,
silent) while the flood is queued:

- loads waiting for a fetch count toward their user's ``max_transfers_per_user``.

No timing assertions: the figures in RELIABILITY.md are what these tests print with ``-s``.
"""

from __future__ import annotations

import signal

import pytest

from kvtier.client import block_hashes
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv
from tests.remote.conftest import running_cluster
from tests.remote.test_two_nodes import (TOKENS, engine_blocks, node, remote_stats, store_prefix,  # noqa: F401
                                         wait_remote, _secret_file)


@pytest.fixture
def own_cluster():
    """A cluster this test stops and resumes."""
    yield from running_cluster()


def stalled(cl):
    """SIGSTOP every master; the caller SIGCONTs them (``resumed``) in a finally."""
    for p in cl.procs:
        p.send_signal(signal.SIGSTOP)


def resumed(cl):
    for p in cl.procs:
        p.send_signal(signal.SIGCONT)


def test_loads_waiting_on_a_stalled_fetch_count_toward_the_users_transfer_cap(daemon_factory, own_cluster):
    """``max_transfers_per_user`` 4 and the store stalled: 48 loads of blocks only the store
    holds, one block each. 4 wait for their fetch, the other 44 are refused OVER_LIMIT at once
    (before: all 48 sat in the daemon uncounted; the disk tier's twin is in
    tests/daemon/test_disk_trust.py). Meanwhile the daemon answers a lookup of a chain in
    its RAM; once the store answers, the 4 load byte for byte and the cap is free again."""
    cl = own_cluster
    a = node(daemon_factory, cl.url)
    prompts = [[t + 1_800_000 + 10_000 * k for t in TOKENS] for k in range(4)]
    expected = [b for k, p in enumerate(prompts) for b in store_prefix(a, p, seed=40 + k)]
    wait_remote(a, "written", 48)
    hashes = [h for p in prompts for h in block_hashes(p, 16)]
    b = node(daemon_factory, cl.url, env={"KVTIER_REMOTE_TIMEOUT_S": "30", "KVTIER_MAX_TRANSFERS_PER_USER": "4"})
    local = [t + 1_900_000 for t in TOKENS]
    store_prefix(b, local, seed=45)
    wait_remote(b, "written", 12)  # nothing of B's own in flight to the store when it stalls
    kv, kv2 = make_kv(seed=98), make_kv(seed=97)
    layers = len(kv.tensors)
    with b.client(name="engine", transfer_timeout=120.0) as c, b.client(name="other") as other:
        c.register_kv_cache(kv, [0] * layers, NS)
        other.register_kv_cache(kv2, [0] * layers, NS)
        stalled(cl)
        try:
            handles = [c.load([h], [i % 32]) for i, h in enumerate(hashes)]
            wait_for(lambda: sum(h.done() for h in handles) >= 44, 10)
            refused = [h for h in handles if h.done()]
            waiting, counted = len(b.daemon.remote.fetching), remote_stats(b).get("loads_waiting")
            served = other.lookup(block_hashes(local, 16))  # from RAM: no probe, no wait
        finally:
            resumed(cl)
        print(f"\nstalled fetches, cap 4: {waiting} loads waiting, {len(refused)} of 48 refused at once; "
              f"a RAM lookup meanwhile: {served} of 12 hits")
        assert waiting == counted == 4 and len(refused) == 44 and served == 12
        assert all("max_transfers_per_user" in h.wait().error for h in refused)  # OVER_LIMIT
        rest = [h.wait() for h in handles if h not in refused]
        assert len(rest) == 4 and all(r.ok for r in rest)
        assert engine_blocks(kv, range(4)) == expected[:4 * layers]
        assert c.load(hashes[4:8], [4, 5, 6, 7]).wait().ok  # the cap is free again
        assert remote_stats(b)["loads_waiting"] == 0
    kv.close()
    kv2.close()
