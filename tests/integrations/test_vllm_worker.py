"""vLLM's worker side (``KVTierWorker``) with vLLM's own types, without an engine.

vLLM builds ``CanonicalKVCaches`` and ``GPULoadStoreSpec`` and calls
``submit_store``/``submit_load``/``get_finished``/``wait``/``shutdown``;
here the test makes those calls with real vLLM objects over CPU tensors
and a real daemon, including the cases a full engine rarely produces (a
load starting mid-chunk, a job that is not whole chunks, preemption). The
full-engine runs are in ``test_vllm.py``.
"""

from __future__ import annotations

import pytest
import torch

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from kvtier.client import Namespace, block_hashes  # noqa: E402
from kvtier.integrations.vllm.manager import KVTierSpecs  # noqa: E402
from kvtier.integrations.vllm.worker import KVTierWorker  # noqa: E402
from tests.helpers import until_finished  # noqa: E402

LAYERS, BLOCKS, PAGE, PADDED, K = 2, 16, 2048, 2304, 2
NS = Namespace("vllm-worker-test", "bfloat16", "vllm-NHD", 16 * K)


def canonical_caches(seed: int | None):
    """One padded uint8 tensor per layer, as vLLM's CPU worker allocates them."""
    g = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randint(0, 256, (BLOCKS, PADDED), generator=g, dtype=torch.uint8) if seed is not None
               else torch.zeros(BLOCKS, PADDED, dtype=torch.uint8) for _ in range(LAYERS)]
    caches = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(t, PADDED) for t in tensors],
        group_data_refs=[[vllm_base.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
    return caches, tensors


def gpu_spec(ids: list[int], first_index: int = 0):
    return vllm_base.GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[first_index])


def finished(worker: KVTierWorker, jobs: set[int], timeout: float = 30.0) -> dict:
    return until_finished(worker.get_finished, jobs, timeout)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


def test_vllms_calls_move_chunks_between_two_workers_byte_exactly(daemon):
    caches_a, written = canonical_caches(seed=1)
    caches_b, read = canonical_caches(seed=None)
    a = KVTierWorker(caches_a, NS, K, daemon.socket, name="vllm-worker-a")
    b = KVTierWorker(caches_b, NS, K, daemon.socket, name="vllm-worker-b")
    try:
        keys = block_hashes(list(range(2 * 16 * K)), 16 * K)
        assert a.submit_store(1, gpu_spec([4, 5, 6, 7]), KVTierSpecs(keys))
        (r,) = finished(a, {1}).values()
        assert r.success and r.transfer_size == 4 * LAYERS * PAGE
        # The request's block 1 is already computed: vLLM asks for blocks 1..3 of the two chunks.
        assert b.submit_load(9, KVTierSpecs(keys), gpu_spec([10, 11, 12], first_index=1))
        (r,) = finished(b, {9}).values()
        assert r.success
        assert torch.equal(torch.stack(read)[:, 10:13, :PAGE], torch.stack(written)[:, 5:8, :PAGE])
        assert not torch.stack(read)[:, :, PAGE:].any(), "padding was written"
    finally:
        a.shutdown()
        b.shutdown()


def test_a_job_that_is_not_whole_chunks_is_refused_as_a_value(daemon):
    caches, _ = canonical_caches(seed=2)
    w = KVTierWorker(caches, NS, K, daemon.socket, name="vllm-worker")
    try:
        keys = block_hashes(list(range(2 * 16 * K)), 16 * K)
        w.submit_store(1, gpu_spec([0, 1, 2]), KVTierSpecs(keys))  # 3 blocks for 2 chunks of 2
        w.submit_load(2, KVTierSpecs(keys), gpu_spec([0, 1, 2]))
        got = finished(w, {1, 2})
        assert got[1].success and not got[2].success  # a dropped store is only a later miss
    finally:
        w.shutdown()
    assert daemon.stats()["namespaces"][0]["stored"] == 0


def test_preempted_jobs_are_waited_for_and_still_reported(daemon):
    caches, _ = canonical_caches(seed=3)
    w = KVTierWorker(caches, NS, K, daemon.socket, name="vllm-worker")
    try:
        keys = block_hashes(list(range(2 * 16 * K)), 16 * K)
        w.submit_store(1, gpu_spec([0, 1, 2, 3]), KVTierSpecs(keys))
        w.wait({1})
        assert w.held(1) == ()
        assert finished(w, {1})[1].success
    finally:
        w.shutdown()


def test_a_load_waited_for_within_the_step_is_reported_by_the_next_get_finished(daemon):
    """vLLM 0.33's sync loads: the connector submits an expedited load and
    waits for it before the step's forward; the blocks hold the chunks when
    ``wait`` returns, and that step's ``get_finished`` (called after the
    forward) reports the load, failed or not, with no further waiting."""
    caches_a, written = canonical_caches(seed=4)
    caches_b, read = canonical_caches(seed=None)
    a = KVTierWorker(caches_a, NS, K, daemon.socket, name="vllm-worker-a")
    b = KVTierWorker(caches_b, NS, K, daemon.socket, name="vllm-worker-b")
    try:
        keys = block_hashes(list(range(2 * 16 * K)), 16 * K)
        a.submit_store(1, gpu_spec([0, 1, 2, 3]), KVTierSpecs(keys))
        assert finished(a, {1})[1].success
        assert b.submit_load(2, KVTierSpecs(keys), gpu_spec([8, 9, 10, 11]), expedited=True)
        b.wait({2})
        assert torch.equal(torch.stack(read)[:, 8:12, :PAGE], torch.stack(written)[:, 0:4, :PAGE])
        (r,) = b.get_finished()
        assert (r.job_id, r.success) == (2, True)
        lost = block_hashes(list(range(5000, 5000 + 2 * 16 * K)), 16 * K)  # nobody stored these
        b.submit_load(3, KVTierSpecs(lost), gpu_spec([4, 5, 6, 7]), expedited=True)
        b.wait({3})
        (r,) = b.get_finished()
        assert (r.job_id, r.success) == (3, False)
    finally:
        a.shutdown()
        b.shutdown()
