"""What vLLM blocks are called in kvtier: deterministic keys, namespaces that split what differs."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from kvtier.integrations.vllm.naming import EngineIdentity, kvtier_key

ENGINE = EngineIdentity(model="org/llama", revision="abc", cache_dtype="bfloat16", kv_layout="vllm-LBHNC",
                        tokens_per_block=32, blocks_per_chunk=1, tp_size=2, pp_size=1, group_id=0,
                        hash_algo="sha256", hash_seed=None)


def test_a_vllm_offload_key_maps_to_the_same_16_bytes_in_every_process_whatever_its_group_suffix():
    block_hash = hashlib.sha256(b"tokens").digest()
    key = block_hash + (0).to_bytes(4, "big")
    assert kvtier_key(key) == hashlib.blake2b(block_hash, digest_size=16).digest()
    assert len(kvtier_key(key)) == 16
    assert kvtier_key(key) == kvtier_key(block_hash + (3).to_bytes(4, "big"))  # the group lives in the namespace


def test_everything_that_changes_the_bytes_or_the_hashes_changes_the_namespace():
    base = ENGINE.namespace(0).fingerprint()
    variants = [replace(ENGINE, cache_dtype="float32"), replace(ENGINE, revision="def"),
                replace(ENGINE, tokens_per_block=16), replace(ENGINE, blocks_per_chunk=4),
                replace(ENGINE, group_id=1), replace(ENGINE, hash_seed="0"),
                replace(ENGINE, kv_layout="vllm-NHD"), replace(ENGINE, tp_size=1)]
    fps = {v.namespace(0).fingerprint() for v in variants} | {ENGINE.namespace(1).fingerprint()}
    assert base not in fps and len(fps) == len(variants) + 1


def test_random_per_process_hashes_are_called_unshareable():
    assert ENGINE.hashes_shareable()
    assert not replace(ENGINE, hash_algo="xxhash").hashes_shareable()
    assert replace(ENGINE, hash_algo="xxhash", hash_seed="42").hashes_shareable()


def test_a_shared_tp_layout_gives_every_rank_and_tp_size_one_namespace_and_the_per_rank_layout_does_not():
    """Head slices (or replicated MLA) are the same bytes whatever the TP size:
    one namespace; the per-rank layout keeps one namespace per rank and size."""
    shared = replace(ENGINE, kv_slices="kv=heads/8")
    fps = {replace(shared, tp_size=tp).namespace(r).fingerprint() for tp in (1, 2, 4) for r in range(tp)}
    assert len(fps) == 1
    assert shared.namespace(0).fingerprint() != replace(ENGINE, kv_slices="kv=replicated/1").namespace(0).fingerprint()
    assert ENGINE.namespace(0).fingerprint() != ENGINE.namespace(1).fingerprint()
    assert shared.namespace(0).fingerprint() not in {ENGINE.namespace(r).fingerprint() for r in range(2)}
