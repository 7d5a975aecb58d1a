"""Real vLLM engines at TP=1 and TP=2 share prefixes through one real daemon; MLA is stored once.

Three long-lived engines (``vllm_engines.LiveEngine``), started together: a
tiny Llama with 2 KV heads at TP=1 and at TP=2 (each rank's OpenMP threads
on its own core), and a tiny DeepSeek-V2-style MLA model (latent 512 + rope
64, block 16) at TP=2. Each Llama engine is its own process, so its hits are
blocks the other stored; the MLA engine (vLLM's CPU build keeps no prefix
cache of its own for MLA) loads its prefix back from kvtier on both ranks.
A TP=1 MLA engine uses the same namespace (``test_vllm_tp_layout.py``).

The reference for tokens is vLLM computing the whole prompt itself in the
same engine (``fresh``: vLLM reads no cached prefix, neither its own nor
kvtier's) - vLLM alone's answer, at the engine's TP size.

MLA: vLLM's CPU build turns its own prefix cache off for MLA models, and
its MLA output after a loaded prefix can differ from a full prefill even
when the loaded bytes are exact; vLLM alone is not always stable there. So
the test runs vLLM alone's check first - the prompt computed in full twice -
and compares kvtier's answer with it only where those two agree (they did
in every run so far); pool bytes and hits are checked always.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import DaemonProc
from tests.integrations.vllm_example import example, require_vllm
from tests.integrations.vllm_engines import LiveEngine, busy_neighbours, make_tiny_mla

PREFIX, SUFFIX = 128, 8


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(PREFIX + SUFFIX)]


def ns_bytes(daemon, tag: str) -> int:
    found = [n for n in daemon.stats()["namespaces"] if n["fingerprint"].endswith(tag)]
    assert len(found) <= 1, found
    return found[0]["bytes"] if found else 0


def ns_stats(daemon, tag: str) -> dict:
    (found,) = [n for n in daemon.stats()["namespaces"] if n["fingerprint"].endswith(tag)]
    return found


def hits(engine) -> int:
    return int(engine.metrics().get("vllm:external_prefix_cache_hits", 0))


def _delta(after: dict, before: dict, name: str) -> int:
    return int(after.get(name, 0) - before.get(name, 0))


def started(*engines):
    for e in engines:
        e.wait_ready()
    return engines


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-tp")
    llama = example().make_tiny_llama(str(tmp / "llama"), hidden=256)  # 2 KV heads: one per TP=2 rank
    mla = make_tiny_mla(str(tmp / "mla"))
    daemon = DaemonProc(tmp, pool_size="256MiB", slab_size="4MiB")
    out: dict = {}
    engines: list[LiveEngine] = []
    try:
        engines[:] = [LiveEngine("llama-tp1", llama, tmp, tp=1, socket=daemon.socket),
                      LiveEngine("llama-tp2", llama, tmp, tp=2, socket=daemon.socket),
                      LiveEngine("mla-tp2", mla, tmp, tp=2, socket=daemon.socket, block_size=16)]
        one, two, m2 = started(*engines)
        p1, p2 = [prompt(1)], [prompt(2)]
        out["tp1_p1_fresh"] = one.generate(p1, fresh=True)          # stores P1 from TP=1
        out["bytes_p1"] = ns_bytes(daemon, "kv=heads/2")
        out["tp2_p1"], out["tp2_hits_p1"] = two.generate(p1), hits(two)   # loads it at TP=2
        out["bytes_after_tp2_p1"] = ns_bytes(daemon, "kv=heads/2")
        out["tp2_p1_fresh"] = two.generate(p1, fresh=True)
        out["tp2_p2_fresh"] = two.generate(p2, fresh=True)          # stores P2 from TP=2
        out["bytes_p2"] = ns_bytes(daemon, "kv=heads/2") - out["bytes_p1"]
        out["tp1_p2"], out["tp1_hits_p2"] = one.generate(p2), hits(one)   # loads it at TP=1
        out["tp1_p2_fresh"] = one.generate(p2, fresh=True)

        q = [prompt(3)]
        out["mla_full"] = m2.generate(q)                            # nothing stored yet: computed; stored
        out["mla_bytes"] = ns_bytes(daemon, "kv=replicated/1")
        out["mla_full_again"] = m2.generate(q, fresh=True)          # vLLM alone's second run
        before, pool = m2.metrics(), ns_stats(daemon, "kv=replicated/1")
        with busy_neighbours():  # CPU contention: ranks, daemon and scheduler all run late
            out["mla_loaded"] = m2.generate(q)                      # the prefix from kvtier, on both ranks
            # Four prompts sharing q's prefix at once: looked up together, each chunk
            # (stored by one rank) loaded by both ranks for every prompt.
            batch = [q[0][:PREFIX] + prompt(10 + i)[:SUFFIX] for i in range(3)] + q
            out["mla_batch"] = m2.generate(batch)
        out["mla_hits"] = _delta(m2.metrics(), before, "vllm:external_prefix_cache_hits")
        after = ns_stats(daemon, "kv=replicated/1")
        out["mla_pool_loads"] = {k: after[k] - pool[k] for k in ("hits", "loaded", "load_failed")}
        out["mla_failed_receives"] = open(m2.log).read().count("vLLM recomputes")
        (tmp / "results.json").write_text(json.dumps(out))  # for the record: BENCHMARKS.md cites these
        yield out
    finally:
        for e in engines:
            e.quit()
        for e in engines:
            e.close()
        daemon.stop()


CHUNKS = PREFIX // 32          # full 32-token chunks of the Llama prompts
HEAD_SLICE = 2 * 32 * 128 * 2  # one KV head of one chunk: 2 layers x 32 tokens x (K+V 64+64) x bf16
MLA_BLOCK = 2 * 16 * 576 * 2   # one MLA block: 2 layers x 16 tokens x (512 + 64) x bf16


def test_a_tp2_engine_hits_what_a_tp1_engine_stored_and_answers_like_vllm_alone(runs):
    assert runs["tp2_hits_p1"] >= PREFIX - 32
    assert runs["tp2_p1"] == runs["tp2_p1_fresh"]
    assert runs["tp2_p1"] == runs["tp1_p1_fresh"]  # and like the TP=1 engine (vLLM's TP=1 and TP=2 agree here)


def test_a_tp1_engine_hits_what_a_tp2_engine_stored_and_answers_like_vllm_alone(runs):
    assert runs["tp1_hits_p2"] >= PREFIX - 32
    assert runs["tp1_p2"] == runs["tp1_p2_fresh"]  # the TP=2 engine's KV, loaded: vLLM TP=1's own tokens
    # Not compared with the TP=2 engine's own tokens: on prompt 2, vLLM alone at TP=1 and at
    # TP=2 stopped agreeing on the 2-core dev machine (seen on 2026-11-27 at this session's
    # base commit too, with no kvtier hit involved); that is vLLM's numerics, not kvtier's.


def test_both_tp_sizes_store_one_copy_in_one_namespace(runs):
    """P1 from TP=1 and P2 from TP=2: each prefix is every KV head of every
    chunk once; the TP=2 engine re-storing P1 adds nothing."""
    assert runs["bytes_p1"] == CHUNKS * 2 * HEAD_SLICE
    assert runs["bytes_p2"] == CHUNKS * 2 * HEAD_SLICE
    assert runs["bytes_after_tp2_p1"] == runs["bytes_p1"]


def test_mla_is_stored_once_by_a_tp2_engine_and_loaded_back_by_both_ranks(runs):
    """Pool bytes for the MLA namespace = one replica per block (not one per
    rank); after vLLM dropped its own cache the whole prefix hits kvtier."""
    assert runs["mla_bytes"] == (PREFIX + SUFFIX) // 16 * MLA_BLOCK
    assert runs["mla_hits"] >= PREFIX


def test_every_mla_hit_under_cpu_contention_is_loaded_by_both_ranks(runs):
    """With a busy neighbour on every core, every hit the scheduler reported
    (q again, then four prompts sharing its prefix at once) was loaded by
    both ranks: the daemon counts two loads per block vLLM counted as a hit
    and no failed one, and no load came back failed to vLLM (which would
    recompute)."""
    pool = runs["mla_pool_loads"]
    assert runs["mla_hits"] >= 5 * PREFIX
    assert pool["load_failed"] == 0
    assert pool["loaded"] == 2 * runs["mla_hits"] // 16
    assert runs["mla_failed_receives"] == 0


def test_an_mla_prefix_from_kvtier_answers_like_a_full_prefill_where_vllm_alone_is_stable(runs):
    """vLLM alone run twice (full prefills) first; where it agrees with itself,
    the answer after a prefix loaded from kvtier must be the same."""
    if runs["mla_full"] == runs["mla_full_again"]:  # vLLM alone is stable for this prompt
        assert runs["mla_loaded"] == runs["mla_full"]
