"""Tensor specs: how an engine describes its KV tensors to the daemon.

Shared by both sides: the engine builds specs (``shm.py``, ``cuda.py``), the
daemon validates and maps them (``mapping.py``). A spec is a msgpack map:
``kind`` ("fd": memory handed over as a descriptor, or "cuda"), dtype, shape, stride, the dimension that indexes
engine blocks, and where the memory is.

Primitives: ``DTYPES``, ``dtype_name``, ``SpecError``, ``NoCudaPath``, ``CannotShare``, ``check_geometry``,
``extent_bytes``, ``is_int``, ``normalize_uuid``.
"""

from __future__ import annotations

import torch

DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
    "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


class SpecError(ValueError):
    """A tensor spec from a client is invalid (the client's fault)."""


class NoCudaPath(SpecError):
    """A valid CUDA spec, sent to a daemon that has no CUDA data path."""


class CannotShare(ValueError):
    """Engine side: PyTorch cannot export this memory over CUDA IPC (expandable
    segments on older torch, a custom allocator's pool). The engine keeps
    running without kvtier. Here, not in ``cuda.py``: CPU engines catch it
    without importing the CUDA modules."""


def check_geometry(spec: dict, i: int) -> tuple[torch.dtype, list, list, int]:
    """``(dtype, shape, stride, block_dim)`` of spec ``i``, validated; the part
    shm and cuda specs share."""
    dtype, shape, stride, block_dim = (spec.get(k) for k in ("dtype", "shape", "stride", "block_dim"))
    if dtype not in DTYPES:
        raise SpecError(f"tensor {i}: unsupported dtype {dtype!r}")
    for name, v in (("shape", shape), ("stride", stride)):
        if not isinstance(v, list) or not 0 < len(v) <= 8 or not all(is_int(x) and 0 <= x < 2**40 for x in v):
            raise SpecError(f"tensor {i}: {name} must be a list of 1..8 non-negative ints")
    if len(shape) != len(stride):
        raise SpecError(f"tensor {i}: shape and stride lengths differ")
    if not is_int(block_dim) or not 0 <= block_dim < len(shape):
        raise SpecError(f"tensor {i}: block_dim out of range")
    return DTYPES[dtype], shape, stride, block_dim


def extent_bytes(shape: list[int], stride: list[int], elem_bytes: int) -> int:
    """Bytes from a tensor's first element to one past its last (0 if empty)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * elem_bytes if all(shape) else 0


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def normalize_uuid(uuid: str) -> str:
    """``GPU-1a2b...`` (nvidia-smi, CUDA_VISIBLE_DEVICES) and ``1A2B...`` (torch) -> ``1a2b...``."""
    u = str(uuid).strip().lower()
    return u[4:] if u.startswith("gpu-") else u
