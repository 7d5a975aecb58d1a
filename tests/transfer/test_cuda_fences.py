"""Fences and devices: one worker's unfired fence never stalls another client's
copies; TP ranks each register their own GPU (needs a GPU, two for the last test).

A worker's store is fenced by an interprocess event recorded on its stream
behind a long kernel: until that kernel ends, the daemon must not read the
blocks. Meanwhile another client's copies must run - the daemon waits for
fences at its fence gate, not on its (single, by default) copy thread. A
worker killed while its fence is pending is reaped; its copy is cancelled,
never run, and the others keep going.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kvtier.client import Client, CudaKVCache, Namespace, block_hashes
from kvtier.transfer.events import FENCE_RING
from kvtier.transfer.gpu import MAX_OPEN_EVENTS
from tests.transfer.test_cuda import gpu_daemon  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu
NB = 16
LONG_SPIN = 6_000_000_000  # GPU clock cycles: ~3 s at 2 GHz, far longer than another client's copy


def ns(name: str) -> Namespace:
    return Namespace(f"test-{name}", "float16", name, 16)


def other_client_round_trip(d, name: str) -> None:
    kv = torch.randn(NB, 1 << 16, device="cuda").half()
    with Client(d.socket, name=name) as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns(name))
        keys = block_hashes(list(range(32)), 16)
        assert c.store(keys, [0, 1], stream=torch.cuda.current_stream()).wait(timeout=30).done == 2
        assert c.load(keys, [8, 9], stream=torch.cuda.current_stream()).wait_event().ok
        # This stream only: ``torch.cuda.synchronize()`` would also wait for a hung
        # worker's spin on another stream of this process, the very thing under test.
        torch.cuda.current_stream().synchronize()
        assert torch.equal(kv[8:10], kv[0:2])


def test_a_hung_workers_fence_does_not_hold_up_another_clients_copies(gpu_daemon):  # noqa: F811
    d = gpu_daemon()
    kv = torch.zeros(NB, 1 << 16, device="cuda", dtype=torch.float16)
    slow = torch.cuda.Stream()
    with Client(d.socket, name="hung") as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns("hung"))
        with torch.cuda.stream(slow):
            torch.cuda._sleep(LONG_SPIN)
            kv[3].fill_(4)
        spin_done = torch.cuda.Event()
        spin_done.record(slow)
        held = c.store(block_hashes(list(range(16)), 16), [3], stream=slow)
        other_client_round_trip(d, "other")
        assert not spin_done.query(), "the spin ended before the other client finished: nothing was shown"
        assert not held.done()
        assert held.wait(timeout=60).done == 1  # and the fenced store read the final bytes
        assert c.load(block_hashes(list(range(16)), 16), [5]).wait_event().ok
        torch.cuda.synchronize()
        assert torch.equal(kv[5], torch.full_like(kv[5], 4))


def _worker_with_a_pending_fence(socket: str, q) -> None:
    kv = torch.zeros(NB, 1 << 16, device="cuda", dtype=torch.float16)
    c = Client(socket, name="doomed")
    c.register_kv_cache(CudaKVCache([kv]), [0], ns("doomed"))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(LONG_SPIN * 8)
    c.store(block_hashes(list(range(16)), 16), [1], stream=s)
    q.put("sent")
    time.sleep(600)  # killed by the test


def test_a_worker_killed_with_its_fence_pending_is_reaped_and_stalls_no_one(gpu_daemon):  # noqa: F811
    d = gpu_daemon()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker_with_a_pending_fence, args=(d.socket, q))
    p.start()
    try:
        assert q.get(timeout=120) == "sent"
        other_client_round_trip(d, "before-kill")  # its fence is pending: others run
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        deadline = time.monotonic() + 30
        while d.stats()["clients"] and time.monotonic() < deadline:
            time.sleep(0.1)
        s = d.stats()
        # Its store was cancelled at the gate (never copied) and committed nothing.
        assert s["clients"] == [] and s["totals"]["reaped"] == 1 and s["totals"]["cancelled"] == 1
        assert all(n["stored"] == 0 for n in s["namespaces"] if "doomed" in n["fingerprint"])
        assert s["errors"].get("COPY_FAILED", 0) == 0
        other_client_round_trip(d, "after-kill")
    finally:
        if p.is_alive():
            p.kill()


def test_a_pending_fence_is_not_moved_forward_by_the_next_transfers(gpu_daemon):  # noqa: F811
    """Each transfer's fence is its own event for the next FENCE_RING transfers:
    a store fenced behind a long kernel, then FENCE_RING - 1 quick fences on another stream,
    leave the first fence where it was (one shared event would now mean
    'after the quick ones' - and on a busy engine, never)."""
    assert FENCE_RING < MAX_OPEN_EVENTS  # the daemon never reopens a handle still in use
    d = gpu_daemon()
    kv = torch.randn(NB, 1 << 16, device="cuda").half()
    slow, quick = torch.cuda.Stream(), torch.cuda.Stream()
    with Client(d.socket, name="ring") as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns("ring"))
        with torch.cuda.stream(slow):
            torch.cuda._sleep(LONG_SPIN)
        first = c.store(block_hashes(list(range(16)), 16), [0], stream=slow)
        handles = {bytes(c._fences.ring.record(quick).ipc_handle()) for _ in range(FENCE_RING - 2)}
        keys = block_hashes(list(range(1000, 1016)), 16)
        assert c.store(keys, [1], stream=quick).wait(timeout=30).done == 1  # not behind the spin
        assert not first.done() and len(handles) == FENCE_RING - 2
        assert first.wait(timeout=60).done == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_each_tp_rank_registers_its_own_gpu_and_blocks_cross_between_them(gpu_daemon):  # noqa: F811
    """Two ranks, each with its KV on its own GPU (as TP workers are): the
    daemon maps each registration by its device's UUID, and a block stored
    from GPU 0 loads byte-exact into GPU 1."""
    d = gpu_daemon()
    kv0 = torch.randn(NB, 1 << 16, device="cuda:0").half()
    kv1 = torch.zeros(NB, 1 << 16, device="cuda:1", dtype=torch.float16)
    keys = block_hashes(list(range(32)), 16)
    with Client(d.socket, name="rank0") as r0, Client(d.socket, name="rank1") as r1:
        r0.register_kv_cache(CudaKVCache([kv0]), [0], ns("tp"))
        r1.register_kv_cache(CudaKVCache([kv1]), [0], ns("tp"))
        assert r0.store(keys, [2, 3], stream=torch.cuda.current_stream(0)).wait(timeout=30).done == 2
        assert r1.load(keys, [5, 6], stream=torch.cuda.current_stream(1)).wait_event(
            torch.cuda.current_stream(1)).ok
        torch.cuda.synchronize(1)
        assert torch.equal(kv1[5:7].cpu(), kv0[2:4].cpu())


def test_a_forged_fence_fails_that_transfer_alone_and_the_daemon_serves_on(gpu_daemon):  # noqa: F811
    """A client that sends bytes which are no event handle (or another
    process's stale one) gets that store failed; its other transfers and
    other clients go on."""
    d = gpu_daemon()
    kv = torch.randn(NB, 1 << 16, device="cuda").half()
    with Client(d.socket, name="forger") as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns("forged"))
        r = c.store(block_hashes(list(range(16)), 16), [0], event=b"\x07" * 64).wait(timeout=60)
        assert r.failed == (0,)
        assert c.store(block_hashes(list(range(16)), 16), [0], stream=torch.cuda.current_stream()).wait().done == 1
    other_client_round_trip(d, "bystander")
    s = d.stats()
    assert s["clients"] == [] and all(n["writing"] == 0 for n in s["namespaces"])
