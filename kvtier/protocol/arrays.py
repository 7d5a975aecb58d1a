"""Packed binary arrays carried in ``bytes`` fields.

Hashes are ``HASH_BYTES``-byte digests concatenated; block ids and failure
indices are little-endian int32. Packing as one ``bin`` field costs ~2.5 us per
1000 entries where a msgpack list costs ~40 us (measured on the 2-core dev machine).
"""

from __future__ import annotations

import numbers
from typing import Iterable, Sequence

import numpy as np

from .errors import ErrorCode, ProtocolError

HASH_BYTES = 16
_I32 = np.dtype("<i4")
_HASH = np.dtype(f"V{HASH_BYTES}")
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def pack_hashes(hashes: Sequence[bytes] | bytes) -> bytes:
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        data = bytes(hashes)
    else:
        sizes = set(map(len, hashes))  # one C-level pass, not a Python check per hash
        if sizes - {HASH_BYTES}:
            bad = next(iter(sizes - {HASH_BYTES}))
            raise ValueError(f"block hash must be {HASH_BYTES} bytes, got {bad}")
        data = b"".join(hashes)
    if len(data) % HASH_BYTES:
        raise ValueError(f"packed hashes must be a multiple of {HASH_BYTES} bytes")
    return data


def unpack_hashes(data: bytes) -> list[bytes]:
    """Split packed hashes into a list of digests (dict keys)."""
    if len(data) % HASH_BYTES:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT,
                            f"hashes field is {len(data)} bytes, not a multiple of {HASH_BYTES}")
    return np.frombuffer(data, dtype=_HASH).tolist()


def pack_ids(ids: Iterable[int] | np.ndarray) -> bytes:
    arr = np.asarray(ids if not isinstance(ids, range) else list(ids))
    if arr.size and not _int32_values(arr):
        raise ValueError("block ids must be a flat sequence of integers in int32 range "
                         f"(got a {arr.dtype} array of shape {arr.shape})")
    return np.ascontiguousarray(arr, dtype=_I32).tobytes()


def _int32_values(arr: np.ndarray) -> bool:
    if arr.ndim != 1:
        return False
    if arr.dtype.kind == "O":  # ints beyond int64 come as Python objects
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) for x in arr):
            return False
    elif arr.dtype.kind not in "iu":  # the int32 cast would truncate 1.5 -> 1 and take bools as 0/1
        return False
    return _I32_MIN <= arr.min() and arr.max() <= _I32_MAX


def unpack_ids(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"id array is {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype=_I32)
