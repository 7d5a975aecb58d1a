"""One worker's unfired fence never stalls another client's copies (needs a GPU).

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
from tests.transfer.test_cuda import gpu_daemon  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu
NB = 16
LONG_SPIN = 4_000_000_000  # GPU clock cycles: seconds, far longer than another client's copy


def ns(name: str) -> Namespace:
    return Namespace(f"test-{name}", "float16", name, 16)


def other_client_round_trip(d, name: str) -> None:
    kv = torch.randn(NB, 1 << 16, device="cuda").half()
    with Client(d.socket, name=name) as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns(name))
        keys = block_hashes(list(range(32)), 16)
        assert c.store(keys, [0, 1], stream=torch.cuda.current_stream()).wait(timeout=30).done == 2
        assert c.load(keys, [8, 9], stream=torch.cuda.current_stream()).wait_event().ok
        torch.cuda.synchronize()
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
