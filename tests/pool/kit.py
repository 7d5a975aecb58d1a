"""Small builders shared by the index tests: keys, chains, a tiny pool."""

from __future__ import annotations

import hashlib

from kvtier.pool import BlockIndex, SlabAllocator

SLAB = 16 * 1024
BLOCK_A = 4096   # 4 blocks per slab
BLOCK_B = 8192   # 2 blocks per slab


def key(tag: str, i: int = 0) -> bytes:
    """A 16-byte block hash, like the ones clients send (stable across runs)."""
    return hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest()


def chain(tag: str, n: int, start: int = 0) -> list[bytes]:
    return [key(tag, i) for i in range(start, start + n)]


def make_index(slabs: int = 4, events: bool = False, policy=None) -> BlockIndex:
    return BlockIndex(SlabAllocator(slabs * SLAB, SLAB), policy, events=events)


def stored(idx: BlockIndex, ns, keys: list[bytes], failed=()) -> int:
    """Run a whole two-phase store and return how many blocks were committed."""
    plan = idx.prepare_store(ns, keys)
    n = idx.complete_store(plan, failed)
    idx.check_integrity()
    return n


def present(ns, keys: list[bytes]) -> list[bool]:
    """Which keys are READY, read without touching the policy (lookup would)."""
    return [ns.entry(k) is not None and ns.entry(k).state == "ready" for k in keys]
