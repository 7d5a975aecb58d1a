"""Engine side: CPU KV caches in named POSIX shared memory (the CPU twin of CUDA IPC).

The worker allocates its KV tensors inside one named segment (``ShmKVCache``)
and sends tensor specs (segment name, byte offset, dtype, shape, stride,
block dim); the daemon maps the same segment by name (``mapping.open_specs``)
and copies blocks directly, no serialization and no extra copy.

Tensors are never sent through pipes or queues (that silently copies them);
only names and offsets travel.
"""

from __future__ import annotations

import grp
import itertools
import os
import secrets

import torch

from ..pool.segment import ShmSegment, cleanup_stale
from .specs import dtype_name

KV_PREFIX = "kvtier-kv."
_ALIGN = 4096
_counter = itertools.count()


class ShmKVCache:
    """Client side: KV tensors placed in one shared-memory segment."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float16,
                 mode: int = 0o600, name: str | None = None, group: str | int | None = None):
        """``mode``/``group``: when the daemon runs as another user (the systemd
        service runs as ``kvtier``), use ``mode=0o660, group="kvtier"``."""
        es = torch.empty((), dtype=dtype).element_size()
        sizes = [_numel(s) * es for s in shapes]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        # Segments of this user's engines that died without closing theirs: a daemon
        # running as another user (systemd) may not unlink them, their owner can.
        cleanup_stale(KV_PREFIX)
        self.name = name or f"/{KV_PREFIX}{os.getpid()}.{next(_counter)}.{secrets.token_hex(3)}"
        gid = grp.getgrnam(group).gr_gid if isinstance(group, str) else group
        self.segment = ShmSegment(self.name, max(total, _ALIGN), create=True, mode=mode, group=gid)
        base = torch.frombuffer(self.segment.buffer, dtype=torch.uint8)
        self.offsets = offsets
        self.tensors = [base[o:o + n].view(dtype).view(s) for o, n, s in zip(offsets, sizes, shapes)]

    def specs(self, block_dims: list[int]) -> list[dict]:
        return [tensor_spec(self.name, o, t, d) for o, t, d in zip(self.offsets, self.tensors, block_dims)]

    def close(self) -> None:
        """Unlink the segment; tensors still held by the caller stay valid and
        the memory is unmapped when the last of them is dropped."""
        self.tensors = []
        self.segment.release(unlink=True)


def tensor_spec(segment: str, offset: int, t: torch.Tensor, block_dim: int) -> dict:
    return {"kind": "shm", "seg": segment, "offset": offset, "dtype": dtype_name(t.dtype),
            "shape": list(t.shape), "stride": list(t.stride()), "block_dim": block_dim}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
