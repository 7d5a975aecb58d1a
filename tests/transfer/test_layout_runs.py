"""KVLayout.copy coalesces runs of adjacent blocks; the bytes must be exactly
those of a block-by-block copy, for every layout kind and any pairing."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.transfer.copy import _runs
from kvtier.transfer.layout import KVLayout

BLOCKS = 24


def flashinfer():   # per-layer (num_blocks, 2, tokens, heads, dim): blocks contiguous
    return [torch.randn(BLOCKS, 2, 4, 2, 8) for _ in range(3)], [0, 0, 0]


def flash_attn():   # (2, num_blocks, ...): a block is two separate pieces, copied one by one
    return [torch.randn(2, BLOCKS, 4, 2, 8) for _ in range(2)], [1, 1]


def mixed():        # one tensor of each kind, bf16 next to float32
    return [torch.randn(BLOCKS, 16).to(torch.bfloat16), torch.randn(2, BLOCKS, 8)], [0, 1]


def mla():          # one tensor: a run is one contiguous copy
    return [torch.randn(BLOCKS, 64)], [0]


def random_pairs(rng: random.Random, eb: int, n: int) -> list[tuple[int, int]]:
    """Pool slots and engine ids with adjacent runs, gaps and descending stretches."""
    slots = list(range(n * 2))
    rng.shuffle(slots)
    slots = sorted(slots[:n]) if rng.random() < 0.7 else slots[:n]
    ids = rng.sample(range(BLOCKS), n)
    start = rng.randrange(BLOCKS - n + 1)
    if rng.random() < 0.6:
        ids = list(range(start, start + n))
    return [(s * eb, i) for s, i in zip(slots, ids)]


def expected_block(m: torch.Tensor) -> torch.Tensor:
    return m.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("make", [flashinfer, flash_attn, mixed, mla])
def test_copy_matches_block_by_block_in_both_directions(make):
    rng = random.Random(make.__name__)
    tensors, dims = make()
    layout = KVLayout(tensors, dims)
    moved = [t.movedim(d, 0) for t, d in zip(tensors, dims)]
    eb = layout.engine_block_bytes
    for _ in range(20):
        pairs = random_pairs(rng, eb, rng.randrange(1, 12))
        pool = torch.zeros(2 * 12 * eb, dtype=torch.uint8)
        layout.copy(pool, pairs, to_pool=True)
        want = torch.zeros_like(pool)
        for off, eid in pairs:  # the definition: tensor j's block bytes at off + tensor_offsets[j]
            for m, toff, sub in zip(moved, layout.tensor_offsets, layout.sub_bytes):
                want[off + toff: off + toff + sub] = expected_block(m[eid])
        assert torch.equal(pool, want)

        # Load back into zeroed tensors: exactly the paired blocks come back, nothing else is written.
        targets = [torch.zeros_like(t) for t in tensors]
        KVLayout(targets, dims).copy(pool, pairs, to_pool=False)
        loaded = {eid for _, eid in pairs}
        for t, dst, d in zip(tensors, targets, dims):
            for b in range(BLOCKS):
                src_b, dst_b = t.select(d, b), dst.select(d, b)
                assert torch.equal(dst_b, src_b if b in loaded else torch.zeros_like(src_b))


def test_runs_merge_only_blocks_adjacent_on_both_sides():
    pairs = [(0, 5), (100, 6), (200, 7), (400, 8), (500, 9), (600, 3), (700, 4)]
    assert list(_runs(pairs, 100)) == [(0, 5, 3), (400, 8, 2), (600, 3, 2)]
    assert list(_runs([(0, 1), (100, 0)], 100)) == [(0, 1, 1), (100, 0, 1)]  # descending ids split
    assert list(_runs([], 100)) == []
