"""The CPU copy routine: engine blocks <-> pool bytes, as few native calls as possible.

Bytes move as row plans (``runs.Geometry.row_plans``): per group of
same-geometry tensors the pieces of all paired blocks become rows of one
power-of-two size, and each tensor is one numpy fancy-index gather or
scatter (or a torch ``index_select`` into consecutive pool rows) between a
row view of its storage and a row view of the pool. A Python copy per piece
cost ~2-3 us, which made 32-layer caches with small pieces move at a few
percent of memory bandwidth. Layouts without row plans (GPU tensors, blocks
of more than ``runs.MAX_PIECES`` pieces) take the strided path: one
``copy_`` per tensor per run of adjacent blocks.

The daemon calls it per chunk of pairs and checks for cancellation in between
(``daemon/copies.py``); the CUDA path is ``gpu.py`` + ``gpu_copy.py``.

Primitives: ``BlockCopier(CopyShape(...)).copy(pool_u8, pairs, to_pool)``, ``.copy_strided(...)``,
``Cancelled``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .runs import pairs_array


class Cancelled(Exception):
    """A copy stopped because its op was cancelled (CPU: between chunks; CUDA:
    before anything was queued). Not a failure to log: the op ends as cancelled."""


class CopyShape(NamedTuple):
    """What the routine needs of a registered cache (``layout.KVLayout`` makes
    it): the engine tensors with their block dim first, their row plans
    (``runs.Geometry``; None: strided path only) and byte sizes per block.
    Not the layout itself: no reference cycle, so dropping a registration's
    layout unmaps its memory at once."""
    moved: list
    geometry: object
    engine_block_bytes: int
    sub_bytes: list
    tensor_offsets: list


MAX_STRETCHES = 16          # more consecutive pool spans than this: one gather/scatter via a temporary
CHUNK_BYTES = 512 << 10     # temporary per gather/scatter step


class BlockCopier:
    def __init__(self, layout: CopyShape):
        self.layout = layout
        # Blocks that are one contiguous byte run are copied as raw bytes.
        self.flat = [_byte_view(m) if m[0].is_contiguous() else None for m in layout.moved]
        self._storage = [_storage_numpy(m) for m in layout.moved] if layout.geometry is not None else None
        self._row_views: dict[tuple[int, int], np.ndarray] = {}

    def copy(self, pool: torch.Tensor, pairs, to_pool: bool) -> None:
        """Copy between kvtier pool bytes (a 1-D uint8 tensor) and engine blocks.

        One gather/scatter per group of tensors sharing a storage (a client's
        shared-memory segment: one for all layers), else one per tensor: a
        torch ``index_select`` straight into consecutive pool rows, or numpy
        fancy indexing (both release the GIL while rows move). Layouts without
        row plans (GPU tensors, blocks of more than ``runs.MAX_PIECES`` pieces)
        take the strided path.
        """
        if self.layout.geometry is None or pool.device.type != "cpu":
            return self.copy_strided(pool, pairs, to_pool)
        arr = pairs_array(pairs)
        if not len(arr):
            return
        pool_np = pool.numpy()
        for plan in self.layout.geometry.row_plans(arr):
            row, e_idx, p_idx = plan.row, plan.engine, plan.pool
            pool_rows = pool_np[: len(pool_np) // row * row].reshape(-1, row)
            spans = len(plan.stretches) - 1
            direct = spans == 1 or (spans <= MAX_STRETCHES and len(p_idx) >= 4 * spans)
            edges = plan.stretches.tolist()
            for t, e0, p0 in plan.members:
                eng, prows = self._rows(t, row)[e0:], pool_rows[p0:]
                if direct:  # few consecutive pool spans: straight into or out of them
                    for lo, hi in zip(edges, edges[1:]):
                        if hi - lo == 1:  # one row: plain indexing is a memcpy
                            e, p = int(e_idx[lo]), int(p_idx[lo])
                            if to_pool:
                                prows[p] = eng[e]
                            else:
                                eng[e] = prows[p]
                            continue
                        span = prows[int(p_idx[lo]): int(p_idx[lo]) + hi - lo]
                        if to_pool:  # torch: a row gather into ``out`` is one memcpy per row
                            torch.index_select(torch.from_numpy(eng), 0, torch.from_numpy(e_idx[lo:hi]),
                                               out=torch.from_numpy(span))
                        else:
                            eng[e_idx[lo:hi]] = span
                    continue
                step = max(1, CHUNK_BYTES // row)  # bounds the temporary (it stays in cache)
                for lo in range(0, len(p_idx), step):
                    e, p = e_idx[lo:lo + step], p_idx[lo:lo + step]
                    if to_pool:
                        prows[p] = eng[e]
                    else:
                        eng[e] = prows[p]

    def _rows(self, t: int, row: int) -> np.ndarray:
        """Tensor ``t``'s whole storage as rows of ``row`` bytes (cached)."""
        view = self._row_views.get((t, row))
        if view is None:
            st = self._storage[t]
            view = st[: len(st) // row * row].reshape(-1, row)
            self._row_views[(t, row)] = view  # a race only builds the same view twice
        return view

    def copy_strided(self, pool: torch.Tensor, pairs, to_pool: bool) -> None:
        """The copy by strided ``copy_`` per run of adjacent blocks; no temporaries.

        Blocks adjacent on both sides (the allocator hands out adjacent slots)
        form a run, copied with one ``copy_`` per tensor: a strided view of
        the run's pool rows against the tensor's contiguous blocks. Per-block
        copies cost ~2-3 us each, which dominated per-layer layouts.
        """
        eb = self.layout.engine_block_bytes
        for off, eid, n in _runs(pairs, eb):
            layout = self.layout
            for m, flat, sub, toff in zip(layout.moved, self.flat, layout.sub_bytes, layout.tensor_offsets):
                if flat is not None and (n == 1 or sub == eb):  # contiguous on both sides: 1-D, cheapest
                    p, e = pool[off + toff: off + toff + n * sub], flat[eid * sub: (eid + n) * sub]
                elif flat is not None:
                    p = pool[off: off + n * eb].view(n, eb)[:, toff: toff + sub]
                    e = flat[eid * sub: (eid + n) * sub].view(n, sub)
                else:  # blocks not contiguous in the engine tensor: one by one
                    for j in range(n):
                        p = pool[off + j * eb + toff: off + j * eb + toff + sub].view(m.dtype).view(m.shape[1:])
                        (p.copy_(m[eid + j]) if to_pool else m[eid + j].copy_(p))
                    continue
                (p.copy_(e) if to_pool else e.copy_(p))


def _runs(pairs: list[tuple[int, int]], stride: int):
    """(pool offset, engine id, length) of maximal runs where both the pool
    offset (by ``stride``) and the engine id (by 1) advance together."""
    i = 0
    while i < len(pairs):
        off, eid = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n][0] == off + n * stride and pairs[i + n][1] == eid + n:
            n += 1
        yield off, eid, n
        i += n


def _storage_numpy(m: torch.Tensor) -> np.ndarray:
    """A uint8 numpy array over ``m``'s whole storage (shares memory)."""
    st = m.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)).numpy()


def _byte_view(m: torch.Tensor) -> torch.Tensor | None:
    """uint8 view where engine block b is bytes [b*sub, (b+1)*sub), or None."""
    es = m.element_size()
    sub = m[0].numel() * es
    if m.shape[0] > 1 and m.stride(0) * es != sub:
        return None  # blocks contiguous but not adjacent (padding between)
    try:
        return m.reshape(-1).view(torch.uint8) if m.is_contiguous() else None
    except RuntimeError:
        return None
