"""How a chunk's KV becomes kvtier blocks that every TP size agrees on (no vLLM import).

Pure values, the same in the scheduler and in every worker. Three layouts,
chosen per engine by ``plan``:

* **Head slices** - attention whose KV heads are split over the TP ranks, in
  a layout where each head's bytes of a block are contiguous and do not
  depend on how many heads a rank holds (vLLM's CPU attention:
  ``[blocks, heads, tokens, 2 * head_size]``). Slice ``h`` of a chunk is KV
  head ``h`` of every layer and is one kvtier block, keyed
  ``slice_key(chunk key, h)``. A rank holding heads ``[a, b)`` stores and
  loads slices ``a..b-1`` only, so TP=1 and TP=2 engines of one model write
  and read the same blocks, and a TP=2 engine's two ranks together store one
  copy. The scheduler counts a chunk as a hit only when *every* slice is in
  the pool (``all_keys``), so each rank can load its part; a slice evicted
  between lookup and load fails that rank's load and vLLM recomputes.
  No block is ever torn: each slice is one whole kvtier block, committed by
  the daemon on its own.
* **Replicated** - ranks hold identical bytes (MLA's latent KV; attention
  with fewer KV heads than ranks): one rank writes each chunk (``writes``:
  rotating by key, so the copies spread over the ranks), every holder loads
  it. Pool bytes: one copy, not one per rank. The scheduler's lookup sees
  the replica only once its writer's copy committed (the daemon keeps a
  block being written out of lookups), so a hit is loadable by every rank,
  whichever rank wrote it and however late the other rank's part ran.
* **Per rank** - anything else (layouts with tokens outside heads, context
  parallelism): each rank its own namespace, as before; nothing is shared
  across TP sizes.

Slice keys are cheap, because the scheduler makes them for every waiting
request every step and a worker for every chunk it moves: slice 0's key is
the chunk's key, slice ``h``'s is the chunk's key XOR a fixed 16-byte mask
(one blake2b per slice count, not per key; a whole list in one numpy XOR).
So a lookup can ask for slice 0 of every chunk first - on a miss exactly the
per-rank layout's round trip - and for the other slices only of the chunks
that hit. Two chunks' slice keys collide only when their keys differ by a
fixed mask difference, which is as hard to arrange as two chunk keys
colliding (a 128-bit birthday bound either way).

Primitives: ``KVSlices`` (``held_keys``, ``all_keys``, ``keys``, ``writes``,
``engine_id``, ``tag``), ``plan``, ``slice_key``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16  # a kvtier key (naming.kvtier_key)


@functools.lru_cache(maxsize=64)
def _masks(slices: int) -> np.ndarray:
    """``(slices, 16)`` uint8: what slice ``h``'s key is XORed with (slice 0: nothing)."""
    out = np.zeros((slices, KEY_BYTES), np.uint8)
    for h in range(1, slices):
        digest = hashlib.blake2b(b"kvtier vllm head slice" + h.to_bytes(2, "big"), digest_size=KEY_BYTES).digest()
        out[h] = np.frombuffer(digest, np.uint8)
    out.flags.writeable = False
    return out


def slice_keys(chunk_keys: Sequence[bytes], first: int, count: int, slices: int) -> list[bytes]:
    """Keys of slices ``first..first+count-1`` of each chunk, chunk after chunk."""
    if slices == 1:
        return list(chunk_keys)
    if not chunk_keys:
        return []
    joined = b"".join(chunk_keys)
    if len(joined) != KEY_BYTES * len(chunk_keys):
        raise ValueError(f"chunk keys must be {KEY_BYTES} bytes each")
    raw = (np.frombuffer(joined, np.uint8).reshape(-1, 1, KEY_BYTES) ^ _masks(slices)[first:first + count]).tobytes()
    return [raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def slice_key(chunk_key: bytes, index: int, slices: int) -> bytes:
    """kvtier key of slice ``index`` of a chunk (the chunk's own key for slice 0 or when not sliced)."""
    if slices == 1 or index == 0:
        return chunk_key
    return slice_keys([chunk_key], index, 1, slices)[0]


@dataclass(frozen=True)
class KVSlices:
    slices: int         # kvtier blocks per chunk (1: not sliced)
    first: int          # the first slice this rank holds
    count: int          # slices this rank holds, consecutive
    replicas: int       # ranks holding these same slices
    replica: int        # this rank's index among them
    shared: bool        # False: per-rank layout (the namespace names the rank)
    kind: str           # "heads", "replicated" or "per-rank"

    def __post_init__(self):
        if not (1 <= self.count and 0 <= self.first and self.first + self.count <= self.slices
                and 0 <= self.replica < self.replicas):
            raise ValueError(f"inconsistent slices: {self}")

    def held_keys(self, chunk_key: bytes) -> list[bytes]:
        """Keys of the slices this rank holds, in its local order."""
        return slice_keys([chunk_key], self.first, self.count, self.slices)

    def all_keys(self, chunk_key: bytes) -> list[bytes]:
        """Keys of every slice: a chunk is a hit only when all are present."""
        return slice_keys([chunk_key], 0, self.slices, self.slices)

    def keys(self, chunk_keys: Sequence[bytes], held: bool = False) -> list[bytes]:
        """``all_keys`` (or ``held_keys``) of many chunks, chunk after chunk, in one go."""
        if held:
            return slice_keys(chunk_keys, self.first, self.count, self.slices)
        return slice_keys(chunk_keys, 0, self.slices, self.slices)

    def writes(self, chunk_key: bytes) -> bool:
        """Whether this rank stores the chunk (one writer among identical replicas)."""
        return self.replicas == 1 or int.from_bytes(chunk_key[:8], "big") % self.replicas == self.replica

    def engine_id(self, block_id: int, local: int) -> int:
        """Row of local slice ``local`` of engine block ``block_id`` in the worker's sliced view."""
        return block_id * self.count + local

    def tag(self) -> str:
        """What goes into a shared namespace: the slicing every writer and reader agrees on."""
        return f"kv={self.kind}/{self.slices}"


PER_RANK = KVSlices(1, 0, 1, 1, 0, False, "per-rank")


def plan(tp_size: int, tp_rank: int, total_kv_heads: int, replicated: bool, head_major: bool) -> KVSlices:
    """The layout of rank ``tp_rank`` (the scheduler plans as rank 0).

    ``replicated``: every rank holds the same bytes (MLA). ``head_major``: the
    attention layout keeps each head's bytes of a block contiguous and
    independent of the rank's head count (see the module docstring)."""
    if replicated:
        return KVSlices(1, 0, 1, tp_size, tp_rank, True, "replicated")
    if not head_major or total_kv_heads < 1:
        return PER_RANK
    if total_kv_heads % tp_size == 0:
        per = total_kv_heads // tp_size
        return KVSlices(total_kv_heads, tp_rank * per, per, 1, 0, True, "heads")
    if tp_size % total_kv_heads == 0:  # fewer heads than ranks: each head on tp/heads ranks
        rep = tp_size // total_kv_heads
        return KVSlices(total_kv_heads, tp_rank // rep, 1, rep, tp_rank % rep, True, "heads")
    return PER_RANK
