"""The GPU data path end to end: CUDA IPC registration, fenced copies, release.

Every test here needs a CUDA device (``gpu`` marker; skipped elsewhere). The
daemon is a real subprocess with ``--gpu on``; the test process (or spawned
worker processes) play the engine with real CUDA KV tensors.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import warnings
import zlib

import pytest
import torch

from kvtier.client import Client, CudaKVCache, Namespace, block_hashes
from tests.conftest import DaemonProc
from tests.helpers import spawn

pytestmark = pytest.mark.gpu
NB = 64  # engine blocks per tensor
SPIN = 500_000_000  # GPU clock cycles of torch.cuda._sleep: a few hundred ms


def ns(name: str, block: int = 16) -> Namespace:
    return Namespace(f"test-{name}", "float16", name, block)


def layout(name: str):
    """(tensors, block_dims, block_factor) on cuda:0 with random contents."""
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))

    def rnd(*shape, dtype=torch.float16):
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    return {
        "flash_attn": ([rnd(2, NB, 16, 8, 128) for _ in range(4)], [1] * 4, 1),       # per layer, K/V split
        "flashinfer": ([rnd(NB, 2, 16, 8, 128) for _ in range(4)], [0] * 4, 1),
        "mla": ([rnd(NB, 16, 576, dtype=torch.bfloat16) for _ in range(4)], [0] * 4, 1),
        "cross_layer": ([rnd(NB, 1 << 20)], [0], 1),                                    # 2 MiB blocks
        "block_factor": ([rnd(2, NB, 16, 8, 128) for _ in range(2)], [1, 1], 2),
    }[name]


def wait_pinned(d, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = d.stats()["pool"]
        if not p["pinning"]:
            assert p["pinned_bytes"] == p["capacity_bytes"], p
            return
        time.sleep(0.1)
    raise AssertionError("pool still pinning")


# Every test's pool is small: the blocks here take tens of MiB, and a GPU node's
# time is short (each GiB of pool costs prefaulting and cudaHostRegister at start).
POOL = dict(pool_size="256MiB", slab_size="16MiB")


@pytest.fixture
def gpu_daemon(daemon_factory):
    def start(copy="auto", env=None):
        # A process of its own: CUDA IPC cannot open a handle in the process that exported it.
        d = daemon_factory(process=True, **POOL, extra=["--gpu", "on"],
                           env={"KVTIER_GPU_COPY": copy, **(env or {})})
        wait_pinned(d)
        return d
    return start


@pytest.fixture(scope="module")
def method_daemons(tmp_path_factory):
    """``get(copy)``: one daemon per copy method for the whole layout matrix
    (15 tests, 3 daemons); each test uses a namespace of its own."""
    started = {}

    def get(copy):
        if copy not in started:
            d = started[copy] = DaemonProc(tmp_path_factory.mktemp(f"gpu-{copy}"), **POOL,
                                           extra=["--gpu", "on"], env={"KVTIER_GPU_COPY": copy})
            wait_pinned(d)
        return started[copy]
    yield get
    for d in started.values():
        d.stop()


# ---- layouts and copy methods -------------------------------------------------------------

@pytest.mark.parametrize("copy", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("name", ["flash_attn", "flashinfer", "mla", "cross_layer", "block_factor"])
def test_every_layout_round_trips_byte_exactly(method_daemons, name, copy):
    d = method_daemons(copy)
    tensors, dims, k = layout(name)
    dim = dims[0]
    with d.client(name=f"engine-{name}") as c:
        c.register_kv_cache(CudaKVCache(tensors), dims, ns(name), block_factor=k)
        hashes = block_hashes(list(range(16 * 8)), 16)
        # Some adjacent ids (runs coalesce), some scattered; k engine blocks per hash.
        src = [2, 3, 4, 5, 10, 11, 40, 41] if k == 1 else list(range(2, 18))
        assert c.store(hashes, src, stream=torch.cuda.current_stream()).wait().done == 8
        for _ in range(3):  # auto: enough rounds to measure both methods
            dst = list(range(NB - 8 * k, NB))
            h = c.load(hashes, dst, stream=torch.cuda.current_stream())
            assert h.wait_event().ok
            for t in tensors:
                assert torch.equal(t.index_select(dim, torch.tensor(dst, device="cuda")),
                                   t.index_select(dim, torch.tensor(src, device="cuda")))
            for t in tensors:
                t.index_fill_(dim, torch.tensor(dst, device="cuda"), 0)
        if k > 1:  # skip on load: the first kvtier block lands without its first sub-block
            dst = list(range(NB - 8 * k + 1, NB))
            # Fenced like every load: the index_fill_ above may still be queued on this stream.
            assert c.load(hashes, dst, skip=1, stream=torch.cuda.current_stream()).wait_event().ok
            for t in tensors:
                for j, e in enumerate(dst):
                    assert torch.equal(t.select(dim, e), t.select(dim, src[j + 1]))
    s = d.stats()
    assert s["gpu"]["enabled"] and s["errors"] == {} and not s["clients"]
    if copy == "kernel":
        assert s["gpu"]["kernel_devices"] == [0], "gather kernels were not usable: DMA ran instead"
    if copy == "auto":
        assert s["gpu"]["throughput_gbps"], "auto mode measured nothing"


def test_device_is_found_by_uuid_whatever_the_daemon_sees(gpu_daemon):
    if "MIG" in os.environ.get("CUDA_VISIBLE_DEVICES", ""):
        pytest.skip("MIG instances are named MIG-<uuid>, not GPU-<uuid>")
    n = torch.cuda.device_count()
    uuids = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    # The daemon sees the devices in reverse order, named by UUID: index 0 here is n-1 there.
    d = gpu_daemon(env={"CUDA_VISIBLE_DEVICES": ",".join(reversed(uuids))})
    assert d.stats()["gpu"]["devices"][n - 1] == uuids[0][4:]
    tensors, dims, _ = layout("flashinfer")
    with d.client() as c:
        c.register_kv_cache(CudaKVCache(tensors), dims, ns("uuid"))
        hashes = block_hashes(list(range(32)), 16)
        stream = torch.cuda.current_stream()  # the tensors' random fill may still be queued on it
        assert c.store(hashes, [0, 1], stream=stream).wait().done == 2
        assert c.load(hashes, [6, 7], stream=stream).wait_event().ok
        assert all(torch.equal(t[6:8], t[0:2]) for t in tensors)


# ---- fences ---------------------------------------------------------------------------------

def _late_fill(t, value, stream):
    """Queue 'spin, then fill' on ``stream``: the fill lands long after the host returns."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        t.fill_(value)


def test_store_waits_for_the_kernels_that_wrote_the_blocks(gpu_daemon):
    d = gpu_daemon()
    kv = torch.zeros(NB, 1 << 19, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    with d.client() as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns("fence-store"))
        # Control: unfenced, the daemon copies before the fill ran (stale zeros).
        _late_fill(kv[1], 3, s)
        stale_hash = block_hashes(list(range(16)), 16)
        assert c.store(stale_hash, [1]).wait().done == 1
        s.synchronize()
        # Fenced: the daemon's stream waits on the event recorded after the fill.
        _late_fill(kv[2], 7, s)
        hashes = block_hashes(list(range(100, 116)), 16)
        assert c.store(hashes, [2], stream=s).wait().done == 1
        assert c.load(hashes, [9]).wait_event().ok
        assert torch.equal(kv[9], torch.full_like(kv[9], 7)), "store read the blocks before they were written"
        assert c.load(stale_hash, [10]).wait_event().ok
        if not torch.equal(kv[10], torch.zeros_like(kv[10])):
            warnings.warn("the unfenced control did not read stale bytes: the race was not exercised")


def test_load_waits_until_the_engine_is_done_with_the_destination(gpu_daemon):
    d = gpu_daemon()
    kv = torch.zeros(NB, 1 << 19, device="cuda", dtype=torch.float16)
    kv[0].fill_(5)
    s = torch.cuda.Stream()
    with d.client() as c:
        c.register_kv_cache(CudaKVCache([kv]), [0], ns("fence-load"))
        hashes = block_hashes(list(range(16)), 16)
        assert c.store(hashes, [0]).wait().done == 1
        # The engine still writes block 4 (a late kernel); the load must land after it.
        _late_fill(kv[4], 9, s)
        h = c.load(hashes, [4], stream=s)
        after = torch.cuda.Stream()
        assert h.wait_event(after).ok
        with torch.cuda.stream(after):
            got = kv[4].clone()  # ordered after the daemon's copy by the event
        after.synchronize()
        assert torch.equal(got, torch.full_like(got, 5)), "load landed before the engine's last write"


# ---- processes ------------------------------------------------------------------------------

TOKENS = list(range(5000, 5000 + 16 * 6))


def engine_stores(socket: str) -> list:
    tensors, dims, _ = layout("flash_attn")
    with Client(socket, name="gpu-a") as c:
        c.register_kv_cache(CudaKVCache(tensors), dims, ns("shared"))
        assert c.store(block_hashes(TOKENS, 16), list(range(10, 16)), stream=torch.cuda.current_stream()).wait().ok
    return [t[:, 10:16].cpu().numpy().tobytes() for t in tensors]


def engine_loads(socket: str) -> list:
    tensors = [torch.zeros(2, NB, 16, 8, 128, device="cuda", dtype=torch.float16) for _ in range(4)]
    with Client(socket, name="gpu-b") as c:
        c.register_kv_cache(CudaKVCache(tensors), [1] * 4, ns("shared"))
        hashes = block_hashes(TOKENS, 16)
        hits = c.lookup(hashes)
        assert c.load(hashes[:hits], list(range(30, 30 + hits)), stream=torch.cuda.current_stream()).wait_event().ok
        torch.cuda.synchronize()
    return [hits, [t[:, 30:30 + hits].cpu().numpy().tobytes() for t in tensors]]


def _run(target, *args):
    p, q = spawn(target, *args)
    status, value = q.get(timeout=120)
    p.join(30)
    assert status == "ok", value
    return value


def test_two_worker_processes_share_blocks_byte_exactly(gpu_daemon):
    d = gpu_daemon()
    expected = _run(engine_stores, d.socket)
    hits, got = _run(engine_loads, d.socket)
    assert hits == 6 and got == expected
    ns_row = d.stats()["namespaces"][0]
    assert (ns_row["stored"], ns_row["loaded"]) == (6, 6)


def engine_holds_gpu_memory(socket: str, nbytes: int, q) -> None:
    kv = torch.ones(NB, nbytes // NB, device="cuda", dtype=torch.uint8)
    c = Client(socket, name="doomed")
    c.register_kv_cache(CudaKVCache([kv]), [0], ns("doomed"))
    torch.cuda.synchronize()
    q.put("registered")
    time.sleep(600)  # killed by the test


def test_a_killed_workers_gpu_memory_comes_back(gpu_daemon):
    d = gpu_daemon()
    gib = 2 << 30
    baseline = torch.cuda.mem_get_info()[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=engine_holds_gpu_memory, args=(d.socket, gib, q))
    p.start()
    assert q.get(timeout=120) == "registered"
    assert torch.cuda.mem_get_info()[0] < baseline - gib  # the worker's KV (and context) is in use
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    # The daemon notices the dead pid, drops the registration and closes the IPC mapping;
    # only then can the driver give the worker's allocation back.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not d.stats()["clients"] and torch.cuda.mem_get_info()[0] > baseline - (256 << 20):
            break
        time.sleep(0.2)
    free = torch.cuda.mem_get_info()[0]
    assert free > baseline - (256 << 20), f"{(baseline - free) >> 20} MiB still held after the reap"
    assert d.stats()["totals"]["reaped"] == 1


def test_an_engine_gets_its_kv_memory_back_once_the_daemon_let_go(gpu_daemon):
    """Per-layer views of one buffer (a cross-layer layout, HF's one cache tensor)
    are shared over CUDA IPC once. PyTorch keeps shared memory (in its IPC
    "limbo") while any reference counter it handed out is unreleased; the daemon
    imports the buffer once and releases one. So once the daemon has dropped
    the registration and the engine frees the buffer, the memory comes back."""
    d = gpu_daemon()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    buf = torch.ones(4, NB, 1 << 15, device="cuda", dtype=torch.float16)  # 4 layers x 64 blocks x 64 KiB
    c, kv = d.client(name="views"), CudaKVCache([buf[i] for i in range(4)])
    c.register_kv_cache(kv, [0] * 4, ns("views"))
    assert c.store(block_hashes(list(range(16)), 16), [0], stream=torch.cuda.current_stream()).wait().done == 1
    c.close()
    deadline = time.monotonic() + 30
    while d.stats()["clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    kv.close()  # the engine lets go of its views and then of the buffer
    del c, kv, buf
    while time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        if torch.cuda.memory_allocated() <= baseline:
            break
        time.sleep(0.1)
    held = torch.cuda.memory_allocated() - baseline
    assert held <= 0, f"{held >> 20} MiB of the engine's KV still held after the daemon let go"


def test_a_copy_that_fails_part_way_leaves_nothing_of_it_in_flight():
    """The daemon's copy engine, in this process: an op whose copy routine raises
    (as out-of-memory in the kernel path's temporaries would) after it queued
    copies behind a long kernel. When the error reaches the daemon, the op is
    reported failed and its slots reused: nothing of it may still be queued."""
    from kvtier.transfer.gpu import GpuContext
    from kvtier.transfer.layout import KVLayout
    pool = torch.zeros(32 << 20, dtype=torch.uint8)
    ctx = GpuContext(pool, 16 << 20, "dma")
    try:
        while ctx.pinned.pinning:  # pinned: a copy into it is asynchronous (pageable memory would block)
            time.sleep(0.01)
        assert ctx.pinned.complete
        kv = torch.randn(NB, 1 << 15, device="cuda").half()  # 64 KiB blocks
        torch.cuda.synchronize()
        engine = ctx.engine(KVLayout([kv], [0]), 0)
        real_dma, calls = engine.runs.dma, []

        def dma_then_fail(pool_, runs, to_pool):
            calls.append(len(runs))
            torch.cuda._sleep(SPIN)  # on the engine's stream: the first copy waits behind it
            real_dma(pool_, runs, to_pool)
            raise RuntimeError("injected: a later copy of the op could not be queued")
        engine.runs.dma = dma_then_fail
        pairs = [(0, 3), (1 << 20, 9)]  # (pool offset, engine block): two runs, not adjacent
        with pytest.raises(RuntimeError, match="injected"):
            engine.copy(pool, pairs, True)
        assert calls and engine.stream.query(), "the failed op's queued copy was still in flight"
        assert torch.equal(pool[:1 << 16], kv[3].cpu().view(torch.uint8).reshape(-1))  # and it had landed
    finally:
        ctx.close()
