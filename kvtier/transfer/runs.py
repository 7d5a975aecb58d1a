"""Copy runs: the contiguous byte ranges one block transfer touches.

The GPU data path cannot afford one strided ``copy_`` per engine block (each
makes a device temporary and costs microseconds of Python), so a transfer is
planned as byte runs instead: for every engine block and tensor, the pieces of
the block that are contiguous in the engine tensor, paired with where they go
in the pool. Runs adjacent on both sides merge into one copy (the allocator
hands out adjacent slots, engines often hand out adjacent block ids), except
across a pinning chunk boundary, where one DMA must not span two host
registrations.

Everything here is plain numpy: no device, no torch.cuda.

Primitives: ``block_pieces(shape, stride, elem_bytes)``,
``Geometry.of(layout)``, ``Geometry.unit_runs(pairs)``, ``Geometry.row_plans(pairs)``,
``coalesce(runs, boundary)``, ``word_bytes(*arrays)``, ``pairs_array(pairs)``.

Row plans serve the CPU copy routine: every piece of every block becomes whole
rows of ``row`` bytes (the largest power of two dividing every offset and the
piece size), so one numpy fancy-index statement per tensor moves any number of
scattered pieces; tensors with the same block geometry share one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_PIECES = 256  # more pieces per block than this: the layout is too scattered for runs
MAX_ROW = 1 << 16  # row bytes cap: bigger rows save no index work worth having


def block_pieces(shape, stride, elem_bytes: int, max_pieces: int = MAX_PIECES):
    """Split one block (a tensor of ``shape``/``stride`` in elements) into
    contiguous pieces: ``(offsets, piece_bytes)`` with byte offsets from the
    block's first element in row-major order, or None if there would be more
    than ``max_pieces``. A zero-size block has no pieces."""
    shape, stride = [int(s) for s in shape], [int(s) for s in stride]
    if any(s == 0 for s in shape):
        return np.zeros(0, np.int64), 0
    # Longest row-major-contiguous suffix of dims; size-1 dims never break it.
    expected, split = 1, 0
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1:
            continue
        if stride[i] != expected:
            split = i + 1
            break
        expected *= shape[i]
    piece = int(np.prod(shape[split:], dtype=np.int64)) if split < len(shape) else 1
    count = int(np.prod(shape[:split], dtype=np.int64)) if split else 1
    if count > max_pieces:
        return None
    offsets = np.zeros(1, np.int64)
    for size, st in zip(shape[:split], stride[:split]):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * st).reshape(-1)
    return offsets * elem_bytes, piece * elem_bytes


@dataclass(frozen=True)
class TensorRuns:
    """Runs of one registered tensor: byte offsets into its storage and the pool."""
    tensor: int
    engine: np.ndarray      # int64 byte offsets from the tensor's storage start
    pool: np.ndarray        # int64 byte offsets into the pool
    nbytes: np.ndarray      # int64 run lengths

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())


@dataclass(frozen=True)
class _TensorGeom:
    storage: int            # tensors with equal values share one storage (same bytes)
    base: int               # byte offset of engine block 0 in the storage
    block_stride: int       # bytes between engine blocks
    pieces: np.ndarray      # byte offsets of the pieces inside a block
    piece_bytes: int
    pool_offset: int        # where this tensor's bytes start inside a pool sub-block


class Geometry:
    """Per-tensor block geometry of a ``KVLayout``, for run planning."""

    def __init__(self, tensors: list[_TensorGeom], engine_block_bytes: int):
        self.tensors = tensors
        self.engine_block_bytes = engine_block_bytes
        self._groups = self.groups()

    @classmethod
    def of(cls, layout, max_pieces: int = MAX_PIECES) -> "Geometry | None":
        """None when some tensor's block splits into too many pieces."""
        geoms, storages = [], {}
        for m, toff in zip(layout.moved, layout.tensor_offsets):
            es = m.element_size()
            split = block_pieces(m.shape[1:], m.stride()[1:], es, max_pieces)
            if split is None:
                return None
            pieces, piece_bytes = split
            # Views of one mapping made by separate frombuffer calls have separate
            # storage objects over the same bytes: the address and size say they alias.
            st = m.untyped_storage()
            sid = storages.setdefault((m.device.type, st.data_ptr(), st.nbytes()), len(storages))
            geoms.append(_TensorGeom(sid, m.storage_offset() * es, m.stride(0) * es, pieces, piece_bytes,
                                     int(toff)))
        return cls(geoms, layout.engine_block_bytes)

    def unit_runs(self, pairs) -> list[TensorRuns]:
        """One run per (engine block, tensor, piece), in pair order, unmerged."""
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        pool_off, eids = arr[:, 0], arr[:, 1]
        out = []
        for t, g in enumerate(self.tensors):
            if g.piece_bytes == 0 or not len(arr):
                continue
            k = len(g.pieces)
            eng = (g.base + eids * g.block_stride)[:, None] + g.pieces[None, :]
            pool = (pool_off + g.pool_offset)[:, None] + np.arange(k, dtype=np.int64)[None, :] * g.piece_bytes
            n = eng.size
            out.append(TensorRuns(t, eng.reshape(-1), pool.reshape(-1), np.full(n, g.piece_bytes, np.int64)))
        return out

    def groups(self) -> list[tuple[int, ...]]:
        """Tensors with the same block geometry (per-layer caches: all of them)."""
        by_key: dict[tuple, list[int]] = {}
        for t, g in enumerate(self.tensors):
            if g.piece_bytes:
                by_key.setdefault((g.block_stride, g.pieces.tobytes(), g.piece_bytes), []).append(t)
        return [tuple(ts) for ts in by_key.values()]

    def row_plans(self, pairs, max_row: int = MAX_ROW) -> list["RowPlan"]:
        """Row plans for ``pairs`` (see RowPlan): per group of same-geometry
        tensors, one plan for those sharing a storage with others and one for
        the rest (the same rows, each from its own origin)."""
        arr = pairs_array(pairs)
        if not len(arr):
            return []
        out = []
        for ts in self._groups:
            out.extend(self._row_plans(ts, arr[:, 0], arr[:, 1], max_row))
        return out

    def _row_plans(self, tensors, pool_off: np.ndarray, eids: np.ndarray, max_row: int) -> list["RowPlan"]:
        g = self.tensors[tensors[0]]
        k, piece = len(g.pieces), g.piece_bytes
        bases = np.array([self.tensors[t].base for t in tensors], dtype=np.int64)
        toffs = np.array([self.tensors[t].pool_offset for t in tensors], dtype=np.int64)
        block = eids * g.block_stride
        within = np.arange(0, k * piece, piece, dtype=np.int64)
        # Every start is a sum of these terms: a power of two dividing each divides them all.
        acc = piece | max_row
        for part in (bases, toffs, block, pool_off, g.pieces):
            acc |= int(np.bitwise_or.reduce(part))
        row = acc & -acc
        lane = np.arange(piece // row, dtype=np.int64)
        # Rows from each tensor's own origin, in pool order: (block, piece, lane).
        eng = (block // row)[:, None, None] + (g.pieces // row)[None, :, None] + lane
        pool = (pool_off // row)[:, None, None] + (within // row)[None, :, None] + lane
        by_storage: dict[int, list[int]] = {}
        for i, t in enumerate(tensors):
            by_storage.setdefault(self.tensors[t].storage, []).append(i)
        plans, alone = [], []
        for members in by_storage.values():
            if len(members) == 1:
                alone.append(members[0])
                continue
            # One gather for all of them, block-major (block, tensor, piece, lane): pool order.
            m = np.array(members)
            e = (eng[:, None] + (bases[m] // row)[None, :, None, None]).reshape(-1)
            p = (pool[:, None] + (toffs[m] // row)[None, :, None, None]).reshape(-1)
            plans.append(RowPlan(((tensors[members[0]], 0, 0),), row, e, p, _stretches(p)))
        if alone:
            p = pool.reshape(-1)
            plans.append(RowPlan(tuple((tensors[i], int(bases[i] // row), int(toffs[i] // row)) for i in alone),
                                 row, eng.reshape(-1), p, _stretches(p)))
        return plans


def _stretches(pool: np.ndarray) -> np.ndarray:
    """Bounds of the spans whose pool rows are consecutive: [0, ..., len]."""
    breaks = np.flatnonzero(np.diff(pool) != 1) + 1
    return np.concatenate(([0], breaks, [len(pool)]))


@dataclass(frozen=True)
class RowPlan:
    """Gathers/scatters in rows of ``row`` bytes: for each member
    ``(tensor, engine_origin, pool_origin)``, engine row ``engine_origin +
    engine[i]`` of the tensor's storage pairs with pool row ``pool_origin +
    pool[i]``. ``stretches`` bounds the spans ``[stretches[j], stretches[j + 1])``
    whose pool rows are consecutive (gathered or scattered without a temporary)."""
    members: tuple[tuple[int, int, int], ...]
    row: int
    engine: np.ndarray      # int64 row indices
    pool: np.ndarray        # int64 row indices
    stretches: np.ndarray   # int64, first 0, last len(pool)

    @property
    def nbytes(self) -> int:
        return len(self.engine) * self.row


def pairs_array(pairs) -> np.ndarray:
    """``(n, 2)`` int64 array of (pool offset, engine block id) pairs."""
    if isinstance(pairs, np.ndarray):
        return pairs.reshape(-1, 2).astype(np.int64, copy=False)
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def coalesce(runs: TensorRuns, boundary: int = 0) -> TensorRuns:
    """Merge consecutive runs that are adjacent in both the engine tensor and
    the pool; never merge across a multiple of ``boundary`` pool bytes."""
    n = len(runs.nbytes)
    if n <= 1:
        return runs
    eng, pool, size = runs.engine, runs.pool, runs.nbytes
    joins = (eng[1:] == eng[:-1] + size[:-1]) & (pool[1:] == pool[:-1] + size[:-1])
    if boundary:
        joins &= (pool[1:] // boundary) == (pool[:-1] // boundary)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    totals = np.add.reduceat(size, starts)
    return TensorRuns(runs.tensor, eng[starts], pool[starts], totals)


def word_bytes(*arrays: np.ndarray, limit: int = 8) -> int:
    """Largest power of two <= ``limit`` dividing every value (word size for
    gather kernels: 8-byte loads move the same bytes with 8x fewer indices)."""
    w = limit
    for a in arrays:
        if len(a):
            acc = int(np.bitwise_or.reduce(np.asarray(a, dtype=np.int64)))
            while w > 1 and acc % w:
                w //= 2
    return w
