"""Engine side: CPU KV caches in sealed anonymous memory the daemon is handed.

The worker allocates its KV tensors in one ``memfd`` (``ShmKVCache``), fully
backed (so every page is charged to the engine, not to the daemon that
reads it) and sealed against shrinking and growing (so nobody, the engine
included, can truncate it under the daemon's mapping: no SIGBUS). The
client hands the file descriptor itself to the daemon over the Unix socket
(SCM_RIGHTS, ``kvtier.client.handover``); specs then refer to it by its
position in that hand-over, never by a name. Nothing appears in /dev/shm,
so no other process can open an engine's KV by guessing or listing names.

``adopt.adopt_tensors(tensors)`` moves the storages under CPU tensors an
engine already allocated into such memory (the tensor objects and their
views follow), for integrations that must register memory the engine allocated.

Tensors are never sent through pipes or queues (that silently copies them);
only a descriptor, offsets and geometry travel.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os

import torch

from ..pool.segment import cleanup_stale
from .specs import dtype_name

KV_PREFIX = "kvtier-kv."
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_ALIGN = 4096
_counter = itertools.count()


class SealedMemory:
    """One memfd of ``size`` bytes: allocated now, sealed, mapped shared."""

    def __init__(self, size: int, label: str):
        size = max(-(-size // _ALIGN) * _ALIGN, _ALIGN)
        self.name = f"memfd:{label}"
        self.fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Reserve every page now (charged to this process; a full tmpfs fails
            # here, not as SIGBUS later) - the daemon refuses sparse memory.
            os.posix_fallocate(self.fd, 0, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self.mmap = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size

    def close(self) -> None:
        """Close the descriptor; the mapping lives on while tensors use it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ShmKVCache:
    """Client side: KV tensors placed in one sealed memfd.

    ``mode``, ``group`` and ``name`` are accepted for compatibility and
    ignored: the memory has no name and is reachable only through the
    descriptor this process hands to the daemon."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float16,
                 mode: int = 0o600, name: str | None = None, group: str | int | None = None):
        es = torch.empty((), dtype=dtype).element_size()
        sizes = [_numel(s) * es for s in shapes]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        # Named segments of this user's engines from before KV memory was handed over
        # as descriptors (and died without closing theirs): nobody else can unlink them.
        cleanup_stale(KV_PREFIX)
        self.memory = SealedMemory(total, f"{KV_PREFIX}{os.getpid()}.{next(_counter)}")
        self.name = self.memory.name
        base = torch.frombuffer(self.memory.mmap, dtype=torch.uint8)
        self.offsets = offsets
        self.tensors = [base[o:o + n].view(dtype).view(s) for o, n, s in zip(offsets, sizes, shapes)]

    @classmethod
    def _adopted(cls, memory: SealedMemory, tensors: list, offsets: list[int]) -> "ShmKVCache":
        self = cls.__new__(cls)
        self.memory, self.name, self.tensors, self.offsets = memory, memory.name, tensors, offsets
        return self

    def fds(self) -> list[int]:
        """Descriptors to hand to the daemon (spec ``fd`` indexes this list)."""
        if self.memory.fd < 0:
            raise ValueError("this KV cache was closed")
        return [self.memory.fd]

    def specs(self, block_dims: list[int]) -> list[dict]:
        return [tensor_spec(0, o, t, d) for o, t, d in zip(self.offsets, self.tensors, block_dims)]

    def close(self) -> None:
        """Close the descriptor; tensors still held by the caller stay valid and
        the memory is freed when the last of them (and the daemon's mapping) is gone."""
        self.tensors = []
        self.memory.close()


def tensor_spec(fd_index: int, offset: int, t: torch.Tensor, block_dim: int) -> dict:
    return {"kind": "fd", "fd": fd_index, "offset": offset, "dtype": dtype_name(t.dtype),
            "shape": list(t.shape), "stride": list(t.stride()), "block_dim": block_dim}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
