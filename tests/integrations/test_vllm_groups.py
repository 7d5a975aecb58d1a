"""Hybrid models' KV cache groups with vLLM's own types, a real daemon, no engine.

A hybrid model (sliding-window layers next to full attention) has several
KV cache groups over the same tensors, each with its own block ids. Here the
test makes vLLM's calls the way its scheduler and workers do for such a model:
every group's chunks stored and loaded byte-exactly in the group's own
namespace, a load failing in one group failing the whole job, a windowed
group answered chunk by chunk. The real engines are in ``test_vllm_hybrid.py``.
"""

from __future__ import annotations

import pytest
import torch

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base", reason="vLLM is not installed")
from kvtier.client import Namespace  # noqa: E402
from kvtier.integrations.vllm.groups import TierGroup, split_job  # noqa: E402
from kvtier.integrations.vllm.manager import KVTierManager, KVTierSpecs  # noqa: E402
from kvtier.integrations.vllm.naming import kvtier_key  # noqa: E402
from kvtier.integrations.vllm.spec import _check_offloadable, _windowed  # noqa: E402
from kvtier.integrations.vllm.worker import KVTierWorker  # noqa: E402
from tests.helpers import until_finished  # noqa: E402

LAYERS, BLOCKS, PAGE, PADDED, K = 2, 24, 1024, 1280, 2
SWA, FULL = 0, 1   # vLLM's group ids: the window group first, as vLLM orders Gemma's
NAMESPACES = [Namespace("vllm-hybrid-test", "bfloat16", "vllm-NHD", 16, extra=f"group{g}") for g in (SWA, FULL)]
GROUPS = [TierGroup(SWA, NAMESPACES[0], LAYERS * PAGE, windowed=True), TierGroup(FULL, NAMESPACES[1], LAYERS * PAGE)]


def hybrid_caches(seed: int | None):
    """Two groups over the same two layer tensors, as vLLM's hybrid allocator
    lays them out (each group's layers alias the tensors, with their own block ids)."""
    g = torch.Generator().manual_seed(seed or 0)
    tensors = [torch.randint(0, 256, (BLOCKS, PADDED), generator=g, dtype=torch.uint8) if seed is not None
               else torch.zeros(BLOCKS, PADDED, dtype=torch.uint8) for _ in range(LAYERS)]
    refs = [vllm_base.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]
    caches = vllm_base.CanonicalKVCaches(tensors=[vllm_base.CanonicalKVCacheTensor(t, PADDED) for t in tensors],
                                         group_data_refs=[list(refs), list(refs)])
    return caches, tensors


def offload_keys(group: int, n: int, salt: str = "") -> list[bytes]:
    return [vllm_base.make_offload_key(f"chunk{salt}-{i}".encode().ljust(32, b"."), group) for i in range(n)]


def spec(swa_ids: list[int], full_ids: list[int], swa_first: int, full_first: int = 0):
    return vllm_base.GPULoadStoreSpec(swa_ids + full_ids, group_sizes=[len(swa_ids), len(full_ids)],
                                      block_indices=[swa_first, full_first])


def finished(worker, jobs: set[int]) -> dict:
    return until_finished(worker.get_finished, jobs, 30.0)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


def test_a_job_is_split_into_whole_chunks_per_group():
    """Group after group, as vLLM lists them: a load may start mid-chunk; a
    store's first chunk whose first blocks a window already freed is left out
    (never half stored); blocks that do not make chunks are reported per group."""
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    load, problems = split_job([[a, b], [c]], [7, 8, 9, 4, 5], [3, 2], [5, 0], 2, is_load=True)
    assert problems == []
    assert [(t.position, t.hashes, t.block_ids, t.skip) for t in load] == [(0, [a, b], [7, 8, 9], 1),
                                                                          (1, [c], [4, 5], 0)]
    # The window group's blocks start at block 3, the second block of chunk a.
    store, problems = split_job([[a, b], [c]], [8, 9, 10, 4, 5], [3, 2], [3, 0], 2, is_load=False)
    assert problems == []
    assert [(t.position, t.hashes, t.block_ids) for t in store] == [(0, [b], [9, 10]), (1, [c], [4, 5])]
    _, problems = split_job([[a], [c]], [1, 2, 3], [1, 2], [0, 0], 2, is_load=False)
    assert len(problems) == 1 and problems[0].startswith("group 0")


def test_every_groups_chunks_move_byte_exactly_between_two_workers(daemon):
    """Worker A stores both groups' chunks (different block ids in the same
    tensors); worker B, another engine of the model, loads them into its own
    block ids: each group's bytes land where vLLM asked, nothing else is written."""
    caches_a, written = hybrid_caches(seed=1)
    caches_b, read = hybrid_caches(seed=None)
    a = KVTierWorker(caches_a, NAMESPACES, K, daemon.socket, name="vllm-worker-a")
    b = KVTierWorker(caches_b, NAMESPACES, K, daemon.socket, name="vllm-worker-b")
    try:
        swa, full = offload_keys(SWA, 2), offload_keys(FULL, 2)
        specs = KVTierSpecs(groups=[[kvtier_key(k) for k in swa], [kvtier_key(k) for k in full]])
        assert a.submit_store(1, spec([2, 3, 4, 5], [10, 11, 12, 13], 0), specs)
        (r,) = finished(a, {1}).values()
        assert r.success and r.transfer_size == 8 * LAYERS * PAGE
        # B holds the request's first block already: vLLM loads blocks 1..3 of each group.
        assert b.submit_load(2, specs, spec([20, 21, 22], [6, 7, 8], 1, 1))
        (r,) = finished(b, {2}).values()
        assert r.success
        got, want = torch.stack(read), torch.stack(written)
        assert torch.equal(got[:, 20:23, :PAGE], want[:, 3:6, :PAGE])
        assert torch.equal(got[:, 6:9, :PAGE], want[:, 11:14, :PAGE])
        untouched = [i for i in range(BLOCKS) if i not in (6, 7, 8, 20, 21, 22)]
        assert not got[:, untouched].any() and not got[:, :, PAGE:].any()
        ns = {n["fingerprint"]: n["blocks"] for n in daemon.stats()["namespaces"]}
        assert ns == {NAMESPACES[0].fingerprint(): 2, NAMESPACES[1].fingerprint(): 2}
    finally:
        a.shutdown()
        b.shutdown()


def test_a_load_that_fails_in_one_group_fails_the_whole_job(daemon):
    """The full-attention group's chunks are in the pool, the window group's
    are not (evicted since the lookup): the job fails, so vLLM recomputes the
    request instead of reading a window that was never written."""
    caches_a, _ = hybrid_caches(seed=2)
    caches_b, _ = hybrid_caches(seed=None)
    a = KVTierWorker(caches_a, NAMESPACES, K, daemon.socket, name="vllm-worker-a")
    b = KVTierWorker(caches_b, NAMESPACES, K, daemon.socket, name="vllm-worker-b")
    try:
        full = [kvtier_key(k) for k in offload_keys(FULL, 1)]
        a.submit_store(1, spec([], [4, 5], 0), KVTierSpecs(groups=[[], full]))
        assert finished(a, {1})[1].success
        swa = [kvtier_key(k) for k in offload_keys(SWA, 1)]
        b.submit_load(2, KVTierSpecs(groups=[swa, full]), spec([8, 9], [10, 11], 0))
        assert not finished(b, {2})[2].success
        b.submit_load(3, KVTierSpecs(groups=[[], full]), spec([], [10, 11], 0))
        assert finished(b, {3})[3].success  # the full group alone loads: the failure was the window's
    finally:
        a.shutdown()
        b.shutdown()


def test_a_window_group_is_looked_up_chunk_by_chunk_a_full_group_as_a_prefix(daemon):
    """vLLM scans a sliding-window group from the end for a run of hits as
    long as the window; the chunks before it need not be in the pool. So the
    window group's answers are per chunk, the full group's a prefix. A group
    costs one round trip, when vLLM first looks into it (a miss in the first
    group, after which vLLM stops, costs one)."""
    caches, _ = hybrid_caches(seed=3)
    worker = KVTierWorker(caches, NAMESPACES, K, daemon.socket, name="vllm-worker")
    manager = KVTierManager(GROUPS, K, daemon.socket, name="vllm-scheduler")
    try:
        swa, full = offload_keys(SWA, 4), offload_keys(FULL, 4)
        stored_swa = [kvtier_key(k) for k in swa[2:]]           # the window before chunk 4 only
        stored_full = [kvtier_key(k) for k in full[:1] + full[2:]]  # chunk 1 missing
        worker.submit_store(1, spec([0, 1, 2, 3], [4, 5, 6, 7, 8, 9], 0), KVTierSpecs(groups=[stored_swa, stored_full]))
        assert finished(worker, {1})[1].success
        ctx = vllm_base.ReqContext(req_id="r1")
        for keys in (swa, full):
            manager.expect("r1", keys)
        assert manager.round_trips == 0
        hit = vllm_base.LookupResult.HIT
        assert [manager.lookup(k, ctx) == hit for k in full] == [True, False, False, False]
        assert manager.round_trips == 1  # one per group vLLM looks into, when it first does
        assert [manager.lookup(k, ctx) == hit for k in swa] == [False, False, True, True]
        assert manager.round_trips == 2
        # Keys the scheduler lists group after group reach the worker apart.
        specs = manager.prepare_load(swa[2:] + full[:1], ctx)
        assert specs.groups == [stored_swa, stored_full[:1]]
    finally:
        manager.shutdown()
        worker.shutdown()


def test_a_job_naming_more_groups_than_the_worker_registered_is_refused_as_a_value(daemon):
    """A forged or mismatched job (three groups for a two-group cache) moves
    nothing: the load fails (vLLM recomputes), the store is dropped."""
    caches, _ = hybrid_caches(seed=4)
    w = KVTierWorker(caches, NAMESPACES, K, daemon.socket, name="vllm-worker")
    try:
        keys = KVTierSpecs(groups=[[kvtier_key(k)] for k in offload_keys(SWA, 3)])
        three = vllm_base.GPULoadStoreSpec([1, 2, 3, 4, 5, 6], group_sizes=[2, 2, 2], block_indices=[0, 0, 0])
        w.submit_store(1, three, keys)
        w.submit_load(2, keys, three)
        got = finished(w, {1, 2})
        assert got[1].success and not got[2].success
    finally:
        w.shutdown()
    assert all(ns["stored"] == 0 for ns in daemon.stats()["namespaces"])


def test_window_groups_are_told_apart_and_state_groups_refused_by_name():
    """What the spec reads off vLLM's KV cache config: a sliding-window group
    is looked up chunk by chunk, a full one as a prefix, and a Mamba state
    group (not a run of token blocks) stops the engine's start with its name."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                            SlidingWindowSpec)
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], window), KVCacheGroupSpec(["l1"], full), KVCacheGroupSpec(["l2"], mamba)])
    assert [_windowed(cfg, g) for g in (0, 1)] == [True, False]
    for g in (0, 1):
        _check_offloadable(cfg, g)
    with pytest.raises(NotImplementedError, match="group 2 holds \\['MambaSpec'\\]"):
        _check_offloadable(cfg, 2)


def test_kv_events_tell_groups_apart_and_follow_each_groups_daemon_feed():
    """The same tokens make chunks in every group (one block hash, group in
    the key): each is announced on vLLM's KV event stream, and the daemon's
    removal in one group's namespace removes that group's chunk only."""
    from kvtier.integrations.vllm.events import TierEvents

    class Feed:  # one namespace's removals, as DaemonFeed.messages returns them (this engine's tenant)
        def __init__(self):
            self.gone: list[bytes] = []

        def messages(self):
            out, self.gone = self.gone, []
            return [("tenant-a", [("removed", k) for k in out])] if out else []

        def close(self):
            pass

    feeds = {SWA: Feed(), FULL: Feed()}
    ev = TierEvents(True, feeds, tenant=lambda: "tenant-a")
    swa, full = offload_keys(SWA, 2, salt="e"), offload_keys(FULL, 2, salt="e")
    ev.stored(swa + full)
    ev.stored(full)                                  # once each
    (stored,) = ev.take()
    assert not stored.removed and stored.keys == swa + full
    feeds[FULL].gone = [kvtier_key(full[1])]          # the same hash as swa[1], in the full group's namespace
    (removed,) = ev.take()
    assert removed.removed and removed.keys == [full[1]]
    ev.missing([swa[0]])                             # a window lookup found it gone
    (removed,) = ev.take()
    assert removed.keys == [swa[0]]
