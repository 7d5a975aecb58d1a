"""CPU KV caches in named POSIX shared memory: the CPU twin of CUDA IPC.

The worker allocates its KV tensors inside one named segment (``ShmKVCache``)
and sends tensor specs (segment name, byte offset, dtype, shape, stride,
block dim); the daemon maps the same segment by name (``open_specs``) and
copies blocks directly, no serialization and no extra copy.

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
from .layout import DTYPES, dtype_name

KV_PREFIX = "kvtier-kv."
_ALIGN = 4096
_counter = itertools.count()


class SpecError(ValueError):
    """A tensor spec from a client is invalid (the client's fault)."""


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


def open_specs(specs: list, max_tensors: int = 4096, gpu_uuids: list[str] | None = None) -> tuple[list, list[int], list]:
    """Daemon side: map each spec's segment (once per name) and build the tensors.

    CUDA specs go to ``cuda.open_cuda_specs`` (imported only then, so CPU
    daemons never load CUDA code); ``gpu_uuids`` is the daemon's device table,
    None without a CUDA data path. One registration uses one kind."""
    if not isinstance(specs, list) or not 0 < len(specs) <= max_tensors:
        raise SpecError(f"tensors must be a list of 1..{max_tensors} specs")
    kinds = {s.get("kind", "shm") if isinstance(s, dict) else None for s in specs}
    if "cuda" in kinds:
        if kinds != {"cuda"}:
            raise SpecError("a registration must not mix cuda and shm tensors")
        from .cuda import open_cuda_specs
        return open_cuda_specs(specs, gpu_uuids, max_tensors)
    segments: dict[str, ShmSegment] = {}
    tensors, dims = [], []
    try:
        for i, spec in enumerate(specs):
            seg_name, offset, dtype, shape, stride, block_dim = _check(spec, i)
            if seg_name not in segments:
                if not seg_name.lstrip("/").startswith(KV_PREFIX) or "/" in seg_name.lstrip("/"):
                    raise SpecError(f"tensor {i}: segment name must start with /{KV_PREFIX}")
                try:
                    segments[seg_name] = ShmSegment(seg_name, populate=False)
                except Exception as exc:
                    raise SpecError(f"tensor {i}: cannot open {seg_name}: {exc}") from None
            seg = segments[seg_name]
            es = torch.empty((), dtype=dtype).element_size()
            extent = extent_bytes(shape, stride, es)
            if offset % es or offset + extent > seg.size:
                raise SpecError(f"tensor {i}: bytes [{offset}, {offset + extent}) outside "
                                f"segment of {seg.size} bytes or misaligned")
            base = torch.frombuffer(seg.buffer, dtype=torch.uint8)
            count = (seg.size - offset) // es
            tensors.append(base[offset:offset + count * es].view(dtype).as_strided(shape, stride))
            dims.append(block_dim)
    except BaseException:
        tensors.clear()
        base = None  # the last view: a segment cannot be unmapped under it
        for seg in segments.values():
            seg.close()
        raise
    return tensors, dims, list(segments.values())


def _check(spec, i):
    if not isinstance(spec, dict) or spec.get("kind", "shm") != "shm":
        raise SpecError(f"tensor {i}: expected a shm tensor spec")
    seg, offset = spec.get("seg"), spec.get("offset")
    if not isinstance(seg, str) or not 0 < len(seg) < 256:
        raise SpecError(f"tensor {i}: seg must be a segment name")
    if not _is_int(offset) or offset < 0:
        raise SpecError(f"tensor {i}: offset must be an int >= 0")
    return (seg, offset, *check_geometry(spec, i))


def check_geometry(spec: dict, i: int) -> tuple[torch.dtype, list, list, int]:
    """``(dtype, shape, stride, block_dim)`` of spec ``i``, validated; the part
    shm and cuda specs share."""
    dtype, shape, stride, block_dim = (spec.get(k) for k in ("dtype", "shape", "stride", "block_dim"))
    if dtype not in DTYPES:
        raise SpecError(f"tensor {i}: unsupported dtype {dtype!r}")
    for name, v in (("shape", shape), ("stride", stride)):
        if not isinstance(v, list) or not 0 < len(v) <= 8 or not all(_is_int(x) and 0 <= x < 2**40 for x in v):
            raise SpecError(f"tensor {i}: {name} must be a list of 1..8 non-negative ints")
    if len(shape) != len(stride):
        raise SpecError(f"tensor {i}: shape and stride lengths differ")
    if not _is_int(block_dim) or not 0 <= block_dim < len(shape):
        raise SpecError(f"tensor {i}: block_dim out of range")
    return DTYPES[dtype], shape, stride, block_dim


def extent_bytes(shape: list[int], stride: list[int], elem_bytes: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 if empty)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * elem_bytes if all(shape) else 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
