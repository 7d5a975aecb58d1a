"""The engine-neutral adapter (``EngineKV``) driven the way the vLLM worker drives it.

The engine's KV cache is what vLLM's worker hands over: one uint8 tensor
per layer of ``(num_blocks, padded_page)``, registered as the unpadded
views ``[:, :page]``, two engine blocks per kvtier block. Jobs are submitted
by id, polled with ``finished``, waited for at preemption and at shutdown.
Every scenario runs on CPU tensors here (adopted into shared memory) and on
CUDA tensors where a GPU exists (registered over CUDA IPC, fenced on the
engine's stream); the bytes loaded must equal the bytes stored, and the
padding must never be touched.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.client import Client, Namespace, block_hashes
from kvtier.integrations.engine_kv import EngineKV, kv_device
from kvtier.protocol.errors import ErrorCode
from kvtier.transfer.cuda import export_specs
from tests.helpers import until_finished

LAYERS, BLOCKS, PAGE, PAD, K = 3, 24, 4096, 512, 2
NS = Namespace("engine-kv-test", "uint8", "vllm-canonical", 16 * K)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def engine_caches(device: str, seed: int | None):
    """vLLM's canonical per-layer tensors (padded pages) and the views it registers."""
    g = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randint(0, 256, (BLOCKS, PAGE + PAD), generator=g, dtype=torch.uint8)
               if seed is not None else torch.zeros(BLOCKS, PAGE + PAD, dtype=torch.uint8)
               for _ in range(LAYERS)]
    tensors = [t.to(device) for t in tensors]
    return tensors, [t[:, :PAGE] for t in tensors]


def attach(daemon, device: str, seed: int | None, name: str):
    tensors, views = engine_caches(device, seed)
    engine = EngineKV(views, [0] * LAYERS, Client(daemon.socket, name=name, require_daemon=False), NS,
                      block_factor=K)
    return engine, tensors


def blocks(tensors, ids) -> list[bytes]:
    return [t[i].cpu().numpy().tobytes() for i in ids for t in tensors]


def poll(engine: EngineKV, job_ids: set[int], timeout: float = 30.0) -> dict:
    """``finished`` until every job in ``job_ids`` reported (as the worker's get_finished loop)."""
    return until_finished(engine.finished, job_ids, timeout)


def start_daemon(daemon_factory, device: str, env=None):
    """In-process for CPU caches; for CUDA a daemon process with its CUDA data path
    (CUDA IPC cannot open a handle in the process that exported it)."""
    gpu = device == "cuda"
    return daemon_factory(process=gpu, pool_size="32MiB", slab_size="1MiB",
                          extra=["--gpu", "on"] if gpu else [], env=env)


@pytest.fixture
def daemon(daemon_factory):
    return start_daemon(daemon_factory, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefix_stored_by_one_engine_loads_byte_exact_into_another_even_from_mid_chunk(daemon_factory, device):
    daemon = start_daemon(daemon_factory, device)
    writer, written = attach(daemon, device, seed=1, name="engine-a")
    reader, read = attach(daemon, device, seed=None, name="engine-b")
    try:
        assert writer.enabled and writer.on_gpu == (device == "cuda")
        keys = block_hashes(list(range(3 * 16 * K)), 16 * K)
        writer.submit(1, False, keys, [2, 3, 4, 5, 6, 7])
        (done,) = poll(writer, {1}).values()
        assert (done.is_load, done.result.done, done.result.ok, done.engine_blocks) == (False, 3, True, 6)

        # vLLM loads from mid-chunk when the first engine block is already computed: skip=1.
        reader.submit(7, True, keys, [11, 12, 13, 14, 15], skip=1)
        (done,) = poll(reader, {7}).values()
        assert done.is_load and done.result.ok
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        assert blocks([t[:, :PAGE] for t in read], range(11, 16)) == blocks([t[:, :PAGE] for t in written],
                                                                               range(3, 8))
        assert all(not t[:, PAGE:].any() for t in read), "the padding was written"
    finally:
        writer.close()
        reader.close()
    ns = daemon.stats()["namespaces"][0]
    assert (ns["stored"], ns["loaded"]) == (3, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_and_shutdown_return_only_once_the_daemon_let_go_of_the_blocks(daemon_factory, device):
    daemon = start_daemon(daemon_factory, device)
    writer, _ = attach(daemon, device, seed=2, name="engine-a")
    keys = block_hashes(list(range(4 * 16 * K)), 16 * K)
    writer.submit(1, False, keys[:2], [0, 1, 2, 3])
    writer.submit(2, False, keys[2:], [4, 5, 6, 7])
    assert writer.held(1) == (0, 1, 2, 3) or writer.held(1) == ()  # () if the daemon was that quick
    writer.wait({1})  # vLLM preempts the request: job 1's blocks are reused right after
    assert writer.held(1) == ()
    assert set(poll(writer, {1, 2})) == {1, 2}  # its result still comes from finished()
    writer.submit(3, True, keys, list(range(8, 16)))
    writer.close()  # shutdown with a load in flight: returns after the daemon answered it
    assert daemon.stats()["clients"] == []
    ns = daemon.stats()["namespaces"][0]
    assert (ns["stored"], ns["writing"]) == (4, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_cache_the_daemon_refuses_leaves_the_engine_running_with_every_transfer_failed(daemon_factory,
                                                                                         device):
    # A daemon that allows fewer copy pieces per block than this layout needs refuses it.
    d = start_daemon(daemon_factory, device, env={"KVTIER_MAX_COPY_PIECES": "2"})
    engine, _ = attach(d, device, seed=3, name="refused")
    try:
        assert not engine.enabled and "max_copy_pieces" in engine.refused
        keys = block_hashes(list(range(16 * K)), 16 * K)
        engine.submit(1, False, keys, [0, 1])
        engine.submit(2, True, keys, [2, 3])
        got = poll(engine, {1, 2})
        assert got[1].result.failed == (0,) and got[2].result.failed == (0,)
        assert "kvtier disabled" in got[2].result.error
    finally:
        engine.close()
    assert d.stats()["errors"]["BAD_ARGUMENT"] == 1


class UnshareableKV:
    """KV memory PyTorch refuses to export over CUDA IPC, as ``_share_cuda_`` refuses
    expandable segments on older torch or a custom allocator's pool (a RuntimeError)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def specs(self, block_dims):
        def refuse(t):
            raise RuntimeError("expandable segments are not supported for IPC")
        return export_specs(self.tensors, block_dims, "GPU-5f0c1a2b-0000-1111-2222-333344445555", share=refuse)

    def close(self):
        self.tensors = []


def test_memory_pytorch_cannot_share_leaves_the_engine_running_without_kvtier(daemon):
    _, views = engine_caches("cpu", seed=6)
    engine = EngineKV(views, [0] * LAYERS, Client(daemon.socket, name="unshareable", require_daemon=False), NS,
                      block_factor=K, kv=UnshareableKV(views))
    try:
        assert not engine.enabled and "cannot share this memory over CUDA IPC" in engine.refused
        assert engine.refusal.code == ErrorCode.BAD_ARGUMENT and engine.refusal.side == "client"
        keys = block_hashes(list(range(16 * K)), 16 * K)
        engine.submit(1, True, keys, [0, 1])
        assert poll(engine, {1})[1].result.failed == (0,)
    finally:
        engine.close()
    assert daemon.stats()["namespaces"] == []  # nothing reached the daemon


def test_without_a_daemon_the_engine_starts_at_once_and_its_loads_fail(tmp_path):
    tensors, views = engine_caches("cpu", seed=4)
    engine = EngineKV(views, [0] * LAYERS, Client(str(tmp_path / "none.sock"), require_daemon=False), NS,
                      block_factor=K)
    try:
        assert engine.enabled  # not refused: degraded until a daemon appears
        keys = block_hashes(list(range(16 * K)), 16 * K)
        engine.submit(1, True, keys, [0, 1])
        (done,) = poll(engine, {1}).values()
        assert done.result.failed == (0,) and "unavailable" in done.result.error
    finally:
        engine.close()


def test_a_job_id_in_flight_cannot_be_submitted_twice(daemon):
    engine, _ = attach(daemon, "cpu", seed=5, name="dup")
    try:
        keys = block_hashes(list(range(16 * K)), 16 * K)
        engine.submit(1, False, keys, [0, 1])
        with pytest.raises(ValueError, match="already in flight"):
            engine.submit(1, False, keys, [0, 1])
    finally:
        engine.close()


def test_kv_tensors_must_all_live_on_one_kind_of_device():
    assert kv_device([torch.zeros(2)]) == "cpu"
    with pytest.raises(ValueError, match="all be on the CPU or all on CUDA"):
        kv_device([torch.zeros(2), torch.zeros(2, device="meta")])
