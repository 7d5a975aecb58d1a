"""KV cache layouts: which bytes of the engine's tensors make one kvtier block.

A registration is a list of tensors and, per tensor, the dimension that indexes
engine blocks, so every common layout fits:
  FlashAttention ``(2, num_blocks, ...)`` block_dim=1, FlashInfer
  ``(num_blocks, 2, ...)`` and MLA ``(num_blocks, ...)`` block_dim=0, and
  per-layer lists of any of them.
One kvtier block is ``block_factor`` consecutive engine blocks (in the order
the engine lists them). In the pool a kvtier block is laid out as
``[sub-block 0: tensor 0 bytes, tensor 1 bytes, ...][sub-block 1: ...]``.

Primitives: ``KVLayout(tensors, block_dims, block_factor)``,
``pairs(offsets, engine_ids, skip)`` (pool byte offset, engine block id) per
engine block, ``check_ids(engine_ids)``, ``copy(pool_u8, pairs, to_pool)``
(the routine itself is ``copy.BlockCopier``).
"""

from __future__ import annotations

import numpy as np
import torch

from .copy import BlockCopier, CopyShape
from .runs import Geometry


class KVLayout:
    """Byte geometry of a registered cache plus the copy routine."""

    def __init__(self, tensors: list[torch.Tensor], block_dims: list[int], block_factor: int = 1):
        if not tensors or len(tensors) != len(block_dims):
            raise ValueError("need one block_dim per tensor and at least one tensor")
        if block_factor < 1:
            raise ValueError("block_factor must be >= 1")
        moved, nblocks = [], set()
        for t, d in zip(tensors, block_dims):
            if not -t.dim() <= d < t.dim() or t.dim() == 0:
                raise ValueError(f"block_dim {d} out of range for a {t.dim()}-d tensor")
            m = t.movedim(d, 0)
            moved.append(m)
            nblocks.add(m.shape[0])
        if len(nblocks) != 1:
            raise ValueError(f"tensors disagree on the number of blocks: {sorted(nblocks)}")
        self.moved = moved
        self.num_blocks = nblocks.pop()
        if self.num_blocks == 0:  # nothing to copy, and m[0] below would raise IndexError
            raise ValueError("the KV tensors hold no blocks")
        self.block_factor = block_factor
        self.sub_bytes = [m[0].numel() * m.element_size() for m in moved]
        self.engine_block_bytes = sum(self.sub_bytes)
        self.block_bytes = block_factor * self.engine_block_bytes
        self.tensor_offsets = np.cumsum([0] + self.sub_bytes[:-1]).tolist()
        # Row plans need CPU tensors (numpy views) and a geometry with few pieces per block.
        cpu = all(m.device.type == "cpu" for m in moved)
        self.geometry = Geometry.of(self) if cpu else None
        self.copier = BlockCopier(CopyShape(moved, self.geometry, self.engine_block_bytes,
                                            self.sub_bytes, self.tensor_offsets))

    def pairs(self, offsets: list, engine_ids: np.ndarray, skip: int = 0) -> list[tuple[int, int]]:
        """(pool offset, engine id) per engine block; ``None`` offsets are skipped.

        ``engine_ids`` holds ``block_factor`` ids per kvtier block, minus
        ``skip`` leading sub-blocks of the first kvtier block.
        """
        k, eb = self.block_factor, self.engine_block_bytes
        if k == 1 and not skip:  # the common case, without a Python step per block
            if None not in offsets:
                return list(zip(offsets, engine_ids.tolist()))
            return [(off, e) for off, e in zip(offsets, engine_ids.tolist()) if off is not None]
        ids = engine_ids.tolist()
        out = []
        for i, off in enumerate(offsets):
            if off is None:
                continue
            first = skip if i == 0 else 0
            base = i * k - skip
            out.extend((off + j * eb, ids[base + j]) for j in range(first, k))
        return out

    def pairs_flat(self, offsets: list[int], engine_ids: np.ndarray) -> list[tuple[int, int]]:
        """Pairs for swap: engine block i goes to sub-block i % k of slot i // k
        (the last slot may be partly used)."""
        k, eb = self.block_factor, self.engine_block_bytes
        return [(offsets[i // k] + (i % k) * eb, e) for i, e in enumerate(engine_ids.tolist())]

    def check_ids(self, engine_ids: np.ndarray) -> str | None:
        """Reason the ids are invalid for this cache, or None."""
        if engine_ids.size and (engine_ids.min() < 0 or engine_ids.max() >= self.num_blocks):
            return f"block ids must be in [0, {self.num_blocks})"
        return None

    def copy(self, pool: torch.Tensor, pairs, to_pool: bool) -> None:
        """Move the paired blocks (``copy.BlockCopier`` does the work)."""
        self.copier.copy(pool, pairs, to_pool)
