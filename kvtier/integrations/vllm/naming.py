"""What a vLLM block is called in kvtier: its namespace and its 16-byte key.

Pure functions over plain values (no vLLM import), so they are the same in
the scheduler process and in every worker process.

* Key: vLLM's offload key is the block hash of a chunk's last block (32-byte
  sha256 by default) plus a 4-byte KV-cache-group index. The group goes into
  the namespace; the hash becomes a kvtier key by blake2b-128, which works
  for any hash length and keeps keys uniformly spread.
* Namespace: everything that changes the bytes of a block or the meaning of
  a hash: model and revision, cache dtype, KV layout, tokens per block,
  tokens per chunk, PP stage, the group, and the hash algorithm with its
  seed (``PYTHONHASHSEED`` changes every vLLM hash). TP rank and size only
  for the per-rank layout: a shared layout (``slices.py``: head slices,
  replicated MLA) names its slicing instead, so every TP size shares it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from ...client import Namespace

log = logging.getLogger("kvtier.vllm")

# vLLM hash algorithms whose values are equal across processes without
# PYTHONHASHSEED; the xxhash ones use a random per-process seed then.
DETERMINISTIC_HASHES = ("sha256", "sha256_cbor")


def kvtier_key(offload_key: bytes) -> bytes:
    """16-byte kvtier key of a vLLM offload key (block hash + 4-byte group)."""
    return hashlib.blake2b(offload_key[:-4], digest_size=16).digest()


@dataclass(frozen=True)
class EngineIdentity:
    """The facts about one vLLM engine that decide whether blocks are shareable."""
    model: str
    revision: str | None
    cache_dtype: str
    kv_layout: str
    tokens_per_block: int
    blocks_per_chunk: int
    tp_size: int
    pp_size: int
    group_id: int
    hash_algo: str
    hash_seed: str | None          # PYTHONHASHSEED, None when unset
    kv_slices: str = ""            # a shared layout's tag (slices.KVSlices.tag); "" = per-rank layout

    def namespace(self, rank: int) -> Namespace:
        """Namespace of worker ``rank`` (the scheduler looks up as rank 0)."""
        seed = self.hash_seed if self.hash_seed is not None else "default"
        extra = (f"vllm,group{self.group_id},chunk{self.blocks_per_chunk},"
                 f"pp{rank // self.tp_size}of{self.pp_size},hash={self.hash_algo}/{seed}")
        if self.kv_slices:  # one namespace for every TP rank and size
            return Namespace(model=f"{self.model}@{self.revision or 'local'}", dtype=self.cache_dtype,
                             layout=self.kv_layout, block_size=self.tokens_per_block,
                             extra=f"{extra},{self.kv_slices}")
        return Namespace(model=f"{self.model}@{self.revision or 'local'}", dtype=self.cache_dtype,
                         layout=self.kv_layout, block_size=self.tokens_per_block,
                         tp_rank=rank % self.tp_size, tp_size=self.tp_size, extra=extra)

    def hashes_shareable(self) -> bool:
        """False when vLLM's block hashes differ per process (nothing would ever hit)."""
        return self.hash_algo in DETERMINISTIC_HASHES or self.hash_seed is not None

    def warn_if_unshareable(self) -> None:
        if not self.hashes_shareable():
            log.warning("kvtier: vLLM prefix_caching_hash_algo=%s with no PYTHONHASHSEED hashes "
                        "blocks with a random per-process seed, so no other engine can ever hit "
                        "them; use sha256 or set PYTHONHASHSEED to the same value everywhere",
                        self.hash_algo)
