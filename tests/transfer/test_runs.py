"""Run planning and the two run copiers, on CPU tensors.

The GPU path moves bytes as planned runs (per-run DMA or gather kernels)
instead of KVLayout.copy; both copiers are device-agnostic, so here they run
on CPU tensors and must leave the pool and the engine blocks byte-identical
to what KVLayout.copy produces, for every supported layout.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.transfer.gpu_copy import RunCopier
from kvtier.transfer.layout import KVLayout
from kvtier.transfer.runs import Geometry, TensorRuns, block_pieces, coalesce, word_bytes

NB = 12  # engine blocks per tensor


def _filled(shape, seed, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def layouts():
    """name -> (tensors, block_dims, block_factor) covering the layouts engines use."""
    padded = torch.zeros(NB, 2, 8, 40, dtype=torch.float16)[..., :32]  # rows padded to 40
    padded.copy_(_filled(padded.shape, 9))
    return {
        # FlashAttention per layer (2, num_blocks, block, heads, dim): K and V are two pieces.
        "flash_attn": ([_filled((2, NB, 4, 2, 16), s) for s in range(3)], [1] * 3, 1),
        # FlashInfer (num_blocks, 2, ...): one contiguous piece per block.
        "flashinfer": ([_filled((NB, 2, 4, 2, 16), s) for s in range(3, 5)], [0] * 2, 1),
        # MLA (num_blocks, block, latent): one tensor per layer, contiguous blocks.
        "mla": ([_filled((NB, 4, 72), s, torch.bfloat16) for s in range(5, 7)], [0] * 2, 1),
        # One cross-layer tensor: adjacent blocks coalesce into long runs.
        "cross_layer": ([_filled((NB, 8192), 7)], [0], 1),
        "block_factor_2": ([_filled((2, NB, 4, 2, 16), s) for s in range(2)], [1, 1], 2),
        "padded_rows": ([padded], [0], 1),
    }


def _plan(name, slots, seed, skip=0):
    tensors, dims, k = layouts()[name]
    layout = KVLayout(tensors, dims, k)
    rng = np.random.default_rng(seed)
    nblocks = min(len(slots), NB // k)
    ids = rng.permutation(NB)[: nblocks * k - skip]
    offsets = [s * layout.block_bytes for s in slots[:nblocks]]
    return tensors, dims, layout, layout.pairs(offsets, ids, skip), (max(slots) + 1) * layout.block_bytes


def _run(method, layout, pool, pairs, to_pool, boundary=0):
    copier = RunCopier(layout, Geometry.of(layout))
    units, merged = copier.plan(pairs, boundary)
    if method == "dma":
        copier.dma(pool, merged, to_pool)
    else:
        copier.kernel(pool, units, to_pool)


def _check_both_directions(name, method, slots, seed, skip=0, boundary=0):
    tensors, dims, layout, pairs, size = _plan(name, slots, seed, skip)
    expected_pool = torch.zeros(size, dtype=torch.uint8)
    layout.copy(expected_pool, pairs, to_pool=True)
    pool = torch.zeros(size, dtype=torch.uint8)
    _run(method, layout, pool, pairs, True, boundary)
    assert torch.equal(pool, expected_pool), "store moved different bytes than KVLayout.copy"
    # Load back into zeroed engine tensors: the touched blocks come back exactly.
    originals = [t.clone() for t in tensors]
    expected = [torch.zeros_like(t) for t in tensors]
    KVLayout(expected, dims, layout.block_factor).copy(pool, pairs, to_pool=False)
    for t in tensors:
        t.zero_()
    _run(method, layout, pool, pairs, False, boundary)
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want), "load wrote different bytes than KVLayout.copy"
    for got, orig, dim in zip(tensors, originals, dims):
        for _, eid in pairs:
            assert torch.equal(got.select(dim, eid), orig.select(dim, eid))


@pytest.mark.parametrize("method", ["dma", "kernel"])
@pytest.mark.parametrize("name", sorted(layouts()))
def test_run_copiers_match_kvlayout_copy(name, method):
    # Slots 0,1,2 adjacent (coalescing candidates), then scattered ones.
    _check_both_directions(name, method, [0, 1, 2, 7, 4, 9], seed=1)


@pytest.mark.parametrize("method", ["dma", "kernel"])
def test_skip_on_load_of_a_block_factor_cache(method):
    _check_both_directions("block_factor_2", method, [3, 4, 0], seed=2, skip=1)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(layouts())), method=st.sampled_from(["dma", "kernel"]),
       slots=st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True), seed=st.integers(0, 99),
       boundary_slots=st.sampled_from([0, 1, 2, 5]))
def test_any_placement_moves_the_same_bytes(name, method, slots, seed, boundary_slots):
    layout = _plan(name, slots, seed)[2]
    _check_both_directions(name, method, slots, seed, boundary=boundary_slots * layout.block_bytes)


def test_flash_attention_block_is_two_pieces_k_and_v():
    t = torch.zeros(2, NB, 4, 2, 16, dtype=torch.float16)
    m = t.movedim(1, 0)
    offsets, piece = block_pieces(m.shape[1:], m.stride()[1:], 2)
    assert piece == 4 * 2 * 16 * 2
    assert offsets.tolist() == [0, NB * piece]  # V starts num_blocks blocks after K


def test_contiguous_block_is_one_piece_and_size_one_dims_do_not_split():
    assert [x.tolist() if hasattr(x, "tolist") else x for x in block_pieces((2, 1, 8), (8, 999, 1), 4)] \
        == [[0], 64]


def test_too_scattered_layout_has_no_geometry():
    t = torch.zeros(NB, 64, 64).transpose(1, 2)  # every element its own piece
    assert block_pieces(t.shape[1:], t.stride()[1:], 4) is None
    assert Geometry.of(KVLayout([t], [0])) is None


def test_coalesce_merges_runs_adjacent_on_both_sides_only():
    r = TensorRuns(0, np.array([0, 100, 200, 500, 600]), np.array([1000, 1100, 1300, 1400, 1500]),
                   np.full(5, 100))
    c = coalesce(r)
    # 0+100 adjacent both sides; 200 is engine-adjacent but not pool-adjacent; 500,600 merge.
    assert c.engine.tolist() == [0, 200, 500] and c.pool.tolist() == [1000, 1300, 1400]
    assert c.nbytes.tolist() == [200, 100, 200]
    assert c.total == r.total


def test_coalesce_never_crosses_a_pinning_chunk():
    r = TensorRuns(0, np.arange(0, 800, 100), np.arange(0, 800, 100), np.full(8, 100))
    c = coalesce(r, boundary=400)
    assert c.pool.tolist() == [0, 400] and c.nbytes.tolist() == [400, 400]


def test_word_bytes_is_the_largest_common_power_of_two():
    assert word_bytes(np.array([0, 64, 128]), np.array([8])) == 8
    assert word_bytes(np.array([0, 6])) == 2
    assert word_bytes(np.array([3])) == 1
    assert word_bytes(np.array([], dtype=np.int64)) == 8


def test_copy_jobs_are_taken_round_robin_between_owners():
    """A client with many queued copies delays another's next copy by one job,
    not by all of them (fair scheduling between clients)."""
    import threading

    from kvtier.transfer.worker import CopyWorker
    gate, running = threading.Event(), threading.Event()
    order = []
    worker = CopyWorker(1)
    try:
        worker.submit("block", lambda: (running.set(), gate.wait()), owner="hog")
        assert running.wait(10)  # the only thread is busy while the rest is queued
        for i in range(5):
            worker.submit(f"hog-{i}", lambda i=i: order.append(f"hog-{i}"), owner="hog")
        worker.submit("good-0", lambda: order.append("good-0"), owner="good")
        worker.submit("good-1", lambda: order.append("good-1"), owner="good")
        gate.set()
        assert worker.drain(10)
    finally:
        worker.close()
    # FIFO would run all five of the hog's first; round-robin alternates.
    assert order == ["hog-0", "good-0", "hog-1", "good-1", "hog-2", "hog-3", "hog-4"]
