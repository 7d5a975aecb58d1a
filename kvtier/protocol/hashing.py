"""Deterministic chained block hashes for the prefix cache.

Two engines share blocks only if they compute the same keys, so the hash must
be identical across processes and hosts: blake2b over the parent digest and
the block's token ids (little-endian int64), keyed by a fixed seed. Python's
``hash()`` is randomized per process and must never be used for block keys.

Primitives: ``block_hashes(tokens, block_size, seed=..., extra=b"")``,
``chain_hash(parent, tokens, extra=b"")``.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from .arrays import HASH_BYTES

DEFAULT_SEED = b"kvtier-block-hash-v1"
ROOT = bytes(HASH_BYTES)


def chain_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"",
               seed: bytes = DEFAULT_SEED) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES, key=seed[:64])
    h.update(parent)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    if extra:  # e.g. LoRA id or multimodal content hash
        h.update(len(extra).to_bytes(4, "little"))
        h.update(extra)
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, seed: bytes = DEFAULT_SEED,
                 extra: bytes = b"") -> list[bytes]:
    """Hashes of every *full* block of ``tokens``; a partial tail is not hashed."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start:start + block_size], extra, seed)
        out.append(parent)
    return out
