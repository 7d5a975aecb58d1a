"""A store's copy runs on the daemon's copy thread alone, not on an OpenMP team.

Torch splits a store's gather (``index_select``) over one OpenMP thread per
core unless told otherwise, and an OpenMP region waits for its slowest
thread: with CPU engines keeping the cores busy, one descheduled thread held
every store (BENCHMARKS.md 13.4). The daemon runs torch with one thread; its
copy threads are its parallelism. Seen from outside: a daemon started with
``OMP_NUM_THREADS`` at the core count stores and loads large chains byte for
byte without starting a single thread more.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import NS, make_kv

CORES = len(os.sched_getaffinity(0))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.skipif(CORES < 2, reason="one core: torch starts no team either way")
def test_large_stores_start_no_openmp_team_in_the_daemon(daemon_factory):
    d = daemon_factory(process=True, pool_size="128MiB", slab_size="8MiB",
                       env={"OMP_NUM_THREADS": str(CORES), "KVTIER_COPY_THREADS": "1"})
    kv = make_kv(shape=(128, 2, 16, 8, 128), seed=3)  # 256 KiB blocks (4 layers), 32 MiB
    with d.client(name="engine", heartbeat=False) as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = [bytes([7, i]) + bytes(14) for i in range(kv.tensors[0].shape[0])]
        ids = list(range(len(hashes)))
        assert c.store(hashes[:2], ids[:2]).wait().ok  # the copy thread and the rest are up
        before = threads(d.proc.pid)
        for round_ in range(3):  # whole caches: well past inline_copy_bytes, gathers of many rows
            hs = [bytes([8 + round_]) + h[1:] for h in hashes]
            assert c.store(hs, ids).wait().ok
        assert threads(d.proc.pid) == before
        want = [t.clone() for t in kv.tensors]
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, ids).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(kv.tensors, want))
    kv.close()
