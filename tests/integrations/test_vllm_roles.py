"""vLLM's ``kv_role`` with kvtier, and which blocks an engine stores.

vLLM's offloading scheduler never looks at ``kv_role`` (nor does LMCache's
multi-process connector: LMCache #5143), so kvtier's manager honours it: a
``kv_producer`` fills the pool and never loads from it, a ``kv_consumer``
loads and never stores. And vLLM's ``offload_prompt_only`` (its default, true)
decides whether blocks completed while decoding are stored: they are not, so
a pool shared by many engines holds prompts (what the next request or turn
shares), not each answer's tail.

Real engines in process (``vllm_in_process.py``), a real daemon. The first
process runs the references without kvtier and a producer that stores two
prompts' prefixes (8 chunks each) while decoding 16 tokens past a 9th chunk
boundary; a new process runs a consumer on the same prefixes with two more
chunks each, and a second producer on the first prompts.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import DaemonProc
from tests.integrations.test_vllm_hybrid import run_engines
from tests.integrations.vllm_example import example, require_vllm

PREFIX_TOKENS = 256          # 8 chunks of 32 tokens; each prompt has 24 more (no full 9th chunk)
MAX_TOKENS = 16              # decoding completes the 9th chunk (280 + 15 tokens computed > 288)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    ex = example()
    tmp = tmp_path_factory.mktemp("vllm-roles")
    llama = ex.make_tiny_llama(str(tmp / "tiny-llama"))
    first = [ex.shared_prefix_prompts(PREFIX_TOKENS, 1, seed=s)[0] for s in (1, 2)]
    longer = [p + [(7 * i) % 500 + 1 for i in range(64)] for p in first]  # two new chunks after each prefix
    files = {}
    for name, prompts in (("first", first), ("longer", longer)):
        files[name] = tmp / f"prompts-{name}.json"  # not {plan}.json: run_engines writes those
        files[name].write_text(json.dumps(prompts))
    daemon = DaemonProc(tmp, pool_size="128MiB", slab_size="4MiB")
    try:
        def args(prompts, **kw):
            return ex.engine_command(llama, str(files[prompts]), socket=daemon.socket, max_tokens=MAX_TOKENS,
                                     **kw)[3:]
        (ref, ref_longer, producer), _ = run_engines(ex, [
            args("first", kvtier=False), args("longer", kvtier=False), args("first", kv_role="kv_producer")],
            tmp, "first")
        after_producer = daemon.stats()
        (consumer, producer_again), _ = run_engines(ex, [
            args("longer", kv_role="kv_consumer"), args("first", kv_role="kv_producer")], tmp, "second")
        yield {"ref": ref, "ref_longer": ref_longer, "producer": producer, "after_producer": after_producer,
               "consumer": consumer, "producer_again": producer_again, "after": daemon.stats()}
    finally:
        daemon.stop()


def blocks(status) -> int:
    (ns,) = status["namespaces"]
    return ns["blocks"]


def test_a_producer_stores_each_prompts_full_chunks_and_no_block_completed_while_decoding(runs):
    """Two prompts of 8 full chunks and a partial one; decoding fills the 9th
    chunk of each, and vLLM's offload_prompt_only (default) keeps it out."""
    assert runs["producer"]["tokens"] == runs["ref"]["tokens"]
    assert runs["producer"]["metrics"]["vllm:kv_offload_store_bytes"] > 0
    assert blocks(runs["after_producer"]) == 2 * (PREFIX_TOKENS // 32)


def test_a_consumer_loads_the_prefix_and_stores_nothing(runs):
    """The consumer's prompts have two chunks the pool lacks: it loads the 8
    it has, computes the rest, answers as vLLM alone, and stores none of it."""
    c = runs["consumer"]
    assert c["tokens"] == runs["ref_longer"]["tokens"]
    assert c["metrics"]["vllm:external_prefix_cache_hits"] >= 2 * (PREFIX_TOKENS - 32)
    assert c["metrics"]["vllm:kv_offload_load_bytes"] > 0
    assert c["metrics"].get("vllm:kv_offload_store_bytes", 0) == 0
    assert blocks(runs["after"]) == blocks(runs["after_producer"])


def test_a_producer_never_loads_what_the_pool_holds(runs):
    """The second producer runs prompts whose prefixes are all in the pool: it
    prefills them itself (no external hit, nothing loaded), as vLLM alone."""
    p = runs["producer_again"]
    assert p["tokens"] == runs["ref"]["tokens"]
    assert p["metrics"].get("vllm:external_prefix_cache_hits", 0) == 0
    assert p["metrics"].get("vllm:kv_offload_load_bytes", 0) == 0
