"""KVLayout.copy moves rows (one gather/scatter per storage group); the bytes
must be exactly those of the slow definition, block by block and tensor by
tensor, for any layout, any pairing, and tensors that share one storage (as
the daemon maps a client's shared-memory segment) or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.transfer.layout import KVLayout
from kvtier.transfer.runs import Geometry

NB = 16


def _shared(shapes, dtype, seed):
    """Tensors carved from one buffer, each view made separately (like open_specs)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(np.prod(s)) for s in shapes]
    buf = torch.randn(sum(sizes) + 64, generator=g).to(dtype)
    out, at = [], 0
    for s, n in zip(shapes, sizes):
        out.append(buf[at:at + n].view(s))
        at += n + 8  # a gap: tensors need not be back to back
    return out


def _separate(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


LAYOUTS = {
    # name: (shapes, block_dims, dtype, block_factor)
    "per_layer": ([(NB, 2, 4, 2, 8)] * 4, [0] * 4, torch.float16, 1),
    "flash_attn": ([(2, NB, 4, 2, 8)] * 3, [1] * 3, torch.float16, 1),
    "mixed": ([(NB, 16), (2, NB, 8), (NB, 3)], [0, 1, 0], torch.float32, 1),
    "odd_pieces": ([(NB, 3)] * 3, [0] * 3, torch.float16, 1),  # 6-byte pieces: 2-byte rows
    "block_factor_2": ([(2, NB, 4, 8)] * 2, [1, 1], torch.bfloat16, 2),
    "one_tensor": ([(NB, 256)], [0], torch.float16, 1),
}


def _reference_store(layout: KVLayout, pool: torch.Tensor, pairs) -> None:
    """The definition: tensor j's engine block ``eid`` goes to ``off + tensor_offsets[j]``."""
    for off, eid in pairs:
        for m, toff, sub in zip(layout.moved, layout.tensor_offsets, layout.sub_bytes):
            pool[off + toff: off + toff + sub] = m[eid].contiguous().view(-1).view(torch.uint8)


def _reference_load(layout: KVLayout, pool: torch.Tensor, pairs) -> None:
    for off, eid in pairs:
        for m, toff, sub in zip(layout.moved, layout.tensor_offsets, layout.sub_bytes):
            m[eid].copy_(pool[off + toff: off + toff + sub].view(m.dtype).view(m.shape[1:]))


def _case(name, shared, seed):
    shapes, dims, dtype, k = LAYOUTS[name]
    tensors = (_shared if shared else _separate)(shapes, dtype, seed)
    return tensors, dims, k


def _pairs(layout, slots, ids):
    eb = layout.engine_block_bytes
    return [(s * eb, i) for s, i in zip(slots, ids)]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(LAYOUTS)), shared=st.booleans(), seed=st.integers(0, 50),
       slots=st.lists(st.integers(0, 23), min_size=0, max_size=12, unique=True), data=st.data())
def test_rows_copy_equals_the_block_by_block_definition(name, shared, seed, slots, data):
    """Store then load, any slots (adjacent runs, gaps, descending) and any
    distinct engine ids: pool and engine bytes equal the slow reference, and
    nothing outside the paired blocks is written."""
    tensors, dims, k = _case(name, shared, seed)
    layout = KVLayout(tensors, dims, k)
    ids = data.draw(st.lists(st.integers(0, NB - 1), min_size=len(slots), max_size=len(slots), unique=True))
    pairs = _pairs(layout, slots, ids)
    size = 25 * layout.engine_block_bytes
    pool, want = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    layout.copy(pool, pairs, to_pool=True)
    _reference_store(layout, want, pairs)
    assert torch.equal(pool, want)

    # Load into wiped tensors of the same kind: exactly the paired blocks return.
    targets, _, _ = _case(name, shared, seed + 1000)
    for t in targets:
        t.zero_()
    expected, _, _ = _case(name, shared, seed + 1000)
    for t in expected:
        t.zero_()
    KVLayout(targets, dims, k).copy(pool, pairs, to_pool=False)
    _reference_load(KVLayout(expected, dims, k), pool, pairs)
    for got, ref in zip(targets, expected):
        assert torch.equal(got, ref)


def test_tensors_of_one_storage_move_in_a_single_plan():
    """A per-layer cache in one segment is one gather (the daemon's case);
    separate allocations share one plan of rows with an origin each."""
    shapes, dims, dtype, _ = LAYOUTS["per_layer"]
    one = KVLayout(_shared(shapes, dtype, 1), dims)
    plans = one.geometry.row_plans([(0, 3), (one.engine_block_bytes, 4)])
    assert len(plans) == 1 and len(plans[0].members) == 1
    apart = KVLayout(_separate(shapes, dtype, 1), dims)
    plans = apart.geometry.row_plans([(0, 3)])
    assert len(plans) == 1 and len(plans[0].members) == len(shapes)


def test_rows_are_the_largest_power_of_two_dividing_every_offset():
    t = torch.zeros(NB, 3, dtype=torch.float16)  # 6-byte blocks
    plan = Geometry.of(KVLayout([t], [0])).row_plans([(0, 1), (256, 2)])[0]
    assert plan.row == 2 and plan.engine.tolist() == [3, 4, 5, 6, 7, 8]
    t = torch.zeros(NB, 512, dtype=torch.uint8)
    plan = Geometry.of(KVLayout([t], [0])).row_plans([(1024, 5), (1536, 6)])[0]
    assert plan.row == 512 and plan.engine.tolist() == [5, 6] and plan.pool.tolist() == [2, 3]
    assert plan.stretches.tolist() == [0, 2]  # consecutive pool rows: one span, no temporary


@pytest.mark.parametrize("to_pool", [True, False])
def test_pairs_given_as_an_array_move_the_same_bytes(to_pool):
    shapes, dims, dtype, _ = LAYOUTS["flash_attn"]
    tensors = _shared(shapes, dtype, 3)
    layout = KVLayout(tensors, dims)
    pairs = _pairs(layout, [4, 1, 2], [7, 0, 9])
    a, b = torch.randint(0, 255, (6 * layout.engine_block_bytes,), dtype=torch.uint8), None
    b = a.clone()
    layout.copy(a, pairs, to_pool)
    layout.copy(b, np.array(pairs), to_pool)
    assert torch.equal(a, b)
