"""Hugging Face continuous batching on kvtier, with real transformers and a real daemon.

A tiny random Llama (built here from a seed, so every process has the same
weights; nothing is downloaded) runs HF's continuous batching with a paged
cache of 16 blocks of 8 tokens: far too small for the workload, so HF must
preempt requests. Every test compares each request's tokens with
``model.generate`` on that request alone: kvtier may change where KV comes
from, never what the model outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

try:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvtier.integrations.transformers import KVTierContinuousBatchingManager
    MISSING = ""
except ImportError as exc:
    MISSING = f"transformers is not installed ({exc}): pip install -e '.[transformers]'"
from tests.conftest import REPO
from tests.helpers import spawn

MODEL_ID = "kvtier-tests/tiny-llama-seed0"
NEW_TOKENS = 16
PAGE = 8


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


def tight_cache() -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=16, use_cuda_graph=False, use_async_batching=False)


def random_prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


PROMPTS = random_prompts(1, [20, 31, 9, 17, 25, 12, 40, 8])  # ~ 2.5x the cache once decoding
DOCUMENT = random_prompts(2, [48])[0]  # a long shared prefix: 6 full blocks
FIRST_ENGINE = [DOCUMENT + q for q in random_prompts(3, [5, 7, 3])] + [DOCUMENT + random_prompts(4, [8])[0]]
# The second engine asks other questions about the same document, and once
# exactly the first engine's last prompt (a whole number of blocks: the last
# one must still be computed to produce a first token).
SECOND_ENGINE = [DOCUMENT + q for q in random_prompts(5, [6, 4, 9])] + [FIRST_ENGINE[-1]]


@pytest.fixture(scope="module", autouse=True)
def engine_installed():
    """A missing engine fails every test here with the fix (never a skip)."""
    if MISSING:
        pytest.fail(MISSING, pytrace=False)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def reference(model):
    """``model.generate`` on one prompt at a time, memoised across tests."""
    cache: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            out = model.generate(torch.tensor([prompt]), generation_config=greedy())
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]
    return tokens


def run_engine(socket: str, prompts: list[list[int]], revision: str = "") -> dict:
    """One HF engine process: generate ``prompts`` with kvtier, report tokens and counters."""
    with KVTierContinuousBatchingManager(tiny_llama(), greedy(), tight_cache(), model_id=MODEL_ID,
                                         revision=revision, socket=socket) as cb:
        outputs = cb.generate(prompts, timeout=300)
    return {"tokens": [o.generated_tokens for o in outputs], "errors": [o.error for o in outputs],
            "counters": cb.counters.as_dict()}


def in_child(socket: str, prompts: list[list[int]]) -> dict:
    proc, queue = spawn(run_engine, socket, prompts)
    status, result = queue.get(timeout=600)
    proc.join(30)
    assert status == "ok", result
    return result


def cli_status(socket: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--socket", socket, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return json.loads(out.stdout)


def test_requests_preempted_under_cache_pressure_are_swapped_through_kvtier_and_restored_exactly(
        model, reference, daemon):
    """HF's cache holds a fraction of the workload, so it preempts requests
    every few steps; kvtier takes every one of them (no soft reset) and gives
    the bytes back into whatever blocks HF allocates on restore: every
    request's tokens equal ``model.generate``'s."""
    with KVTierContinuousBatchingManager(model, greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=daemon.socket) as cb:
        outputs = cb.generate(PROMPTS, timeout=300)
    assert [o.error for o in outputs] == [None] * len(PROMPTS)
    assert [o.generated_tokens for o in outputs] == [reference(p) for p in PROMPTS]
    c = cb.counters
    assert c.offloaded_requests > 0 and c.restored_requests == c.offloaded_requests, c
    assert c.soft_resets == 0 and c.lost_swaps == 0, c
    status = cli_status(daemon.socket)
    assert status["totals"]["offloads"] > 0 and status["totals"]["restores"] > 0, status["totals"]
    assert status["swap"]["requests"] == 0  # every swap was restored and freed


def test_a_second_process_loads_the_shared_prefix_the_first_computed(reference, daemon):
    """Engine A answers questions about a document; engine B, another process
    started afterwards, asks other questions about it. B loads the
    document's blocks from kvtier instead of prefilling them, computes fewer
    tokens than A, and both produce exactly ``model.generate``'s tokens."""
    first = run_engine(daemon.socket, FIRST_ENGINE)  # engine A: this process
    second = in_child(daemon.socket, SECOND_ENGINE)  # engine B: a fresh interpreter
    assert first["errors"] == [None] * 4 and second["errors"] == [None] * 4
    assert first["tokens"] == [reference(p) for p in FIRST_ENGINE]
    assert second["tokens"] == [reference(p) for p in SECOND_ENGINE]
    a, b = first["counters"], second["counters"]
    assert a["stored_blocks"] >= len(DOCUMENT) // PAGE, a
    assert b["prefix_hits"] > 0 and b["loaded_tokens"] >= len(DOCUMENT), b
    assert b["computed_tokens"] < a["computed_tokens"], (a, b)
    assert daemon.stats()["totals"]["hits"] > 0


def test_an_engine_naming_other_weights_never_loads_these_blocks(reference, daemon):
    """Blocks are shared only within a namespace: the same prompts under
    another revision of the model find nothing, and are all computed."""
    first = run_engine(daemon.socket, FIRST_ENGINE[:2])
    other = run_engine(daemon.socket, FIRST_ENGINE[:2], revision="other-revision")
    assert first["counters"]["stored_blocks"] > 0
    assert other["counters"]["loaded_blocks"] == 0, other["counters"]
    assert other["tokens"] == [reference(p) for p in FIRST_ENGINE[:2]]
    namespaces = {n["fingerprint"] for n in daemon.stats()["namespaces"]}
    assert any(f.startswith(f"{MODEL_ID}@other-revision|float32|") for f in namespaces), namespaces


def test_without_a_daemon_preempted_requests_are_soft_reset_and_outputs_unchanged(model, reference, tmp_path):
    """No daemon on the socket: the engine starts anyway, every preempted
    request is recomputed (HF's soft reset), no prefix comes from kvtier, and
    the tokens are still ``model.generate``'s."""
    with KVTierContinuousBatchingManager(model, greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=str(tmp_path / "no-daemon.sock")) as cb:
        outputs = cb.generate(PROMPTS, timeout=300)
    assert [o.generated_tokens for o in outputs] == [reference(p) for p in PROMPTS]
    c = cb.counters
    assert c.soft_resets > 0 and c.offloaded_requests == 0 and c.loaded_blocks == 0, c


def test_a_swap_lost_with_the_daemon_is_recomputed_before_it_is_scheduled(model, reference, daemon):
    """The daemon stops while requests are swapped out in it. Their restore
    fails while they are still only candidates for the next batch, so they
    are soft reset (recomputed) instead of running on empty blocks: the
    tokens are still ``model.generate``'s."""
    with KVTierContinuousBatchingManager(model, greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=daemon.socket) as cb:
        ids = cb.add_requests(PROMPTS, max_new_tokens=NEW_TOKENS)
        caught = False
        deadline = time.monotonic() + 120
        while not caught and cb.is_running() and time.monotonic() < deadline:
            with cb.pause():  # the loop is between steps: swaps cannot move
                if cb.tier.swapped_requests():
                    daemon.stop()
                    caught = True
            time.sleep(0.005)  # let the loop take a step before probing again
        results = {}
        while len(results) < len(ids):
            out = cb.get_result(timeout=60)
            assert out is not None, "generation stalled"
            results[out.request_id] = out
    assert caught, "no request was ever swapped out"
    assert [results[i].generated_tokens for i in ids] == [reference(p) for p in PROMPTS]
    assert cb.counters.lost_swaps > 0, cb.counters


SLOW_COPIES = {"KVTIER_COPY_DELAY_S": "1.0", "KVTIER_COPY_CHUNK_BYTES": "16KiB"}  # a 4-block chunk per second


def stores_in_flight(cb) -> int:
    with cb.pause():  # between steps: the tier's lists hold still
        return sum(1 for handle, _ in cb.tier.stores if not handle.done())


def test_stores_run_behind_the_engine_and_their_blocks_are_reused_only_once_read(reference, daemon_factory):
    """Stores are off the engine's critical path: with every copy chunk held
    for a second, the requests finish and come back while their stores are
    still being copied. Their blocks stay allocated until the daemon has read
    them, so HF's tight cache never hands them to another request early: a
    second engine that loads the stored prefix produces exactly
    ``model.generate``'s tokens."""
    d = daemon_factory(process=True, env=SLOW_COPIES)
    with KVTierContinuousBatchingManager(tiny_llama(), greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=d.socket) as cb:
        outputs = cb.generate(FIRST_ENGINE, timeout=300)
        assert stores_in_flight(cb) > 0  # the old code waited for each before finishing the request
    assert [o.generated_tokens for o in outputs] == [reference(p) for p in FIRST_ENGINE]
    assert cb.counters.stored_blocks >= len(DOCUMENT) // PAGE, cb.counters  # committed by the stop
    second = in_child(d.socket, SECOND_ENGINE)
    assert second["tokens"] == [reference(p) for p in SECOND_ENGINE]
    assert second["counters"]["loaded_tokens"] >= len(DOCUMENT), second["counters"]


def test_a_daemon_killed_with_stores_in_flight_changes_no_token(reference, daemon_factory):
    """SIGKILL while stores are being copied: the engine neither hangs nor
    fails a request; the stores resolve failed as soon as the daemon's
    process is gone, their blocks go back to HF, and every token is still
    ``model.generate``'s."""
    d = daemon_factory(process=True, env=SLOW_COPIES)
    with KVTierContinuousBatchingManager(tiny_llama(), greedy(), tight_cache(), model_id=MODEL_ID,
                                         socket=d.socket) as cb:
        ids = cb.add_requests(PROMPTS, max_new_tokens=NEW_TOKENS)
        killed = False
        deadline = time.monotonic() + 120
        while not killed and cb.is_running() and time.monotonic() < deadline:
            with cb.pause():  # between steps: the tier's lists hold still
                if any(not handle.done() for handle, _ in cb.tier.stores):
                    d.proc.kill()
                    killed = True
            time.sleep(0.005)
        assert killed, "no store was ever in flight"
        d.proc.wait(10)
        results = {}
        while len(results) < len(ids):
            out = cb.get_result(timeout=60)
            assert out is not None, "generation stalled"
            results[out.request_id] = out
    assert [results[i].generated_tokens for i in ids] == [reference(p) for p in PROMPTS]
    assert not cb.tier or not cb.tier.stores


def kv_mapping(tensor) -> str:
    """The /proc/self/maps name of the mapping under ``tensor``'s storage ("" for anonymous memory)."""
    addr = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *rest = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return rest[4].strip() if len(rest) > 4 else ""
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_an_engine_started_without_a_daemon_runs_on_its_own_memory_until_one_appears(
        model, reference, daemon_factory, tmp_path):
    """With no daemon at its socket the engine does nothing kvtier would do: its
    paged cache stays in HF's own memory (not moved into shared memory), nothing is
    stored. Once a daemon starts there, the client finds it in the background
    and, between two steps, the cache moves into shared memory and is
    registered: the next requests are stored, a second process loads their
    prefix, and every token is ``model.generate``'s throughout."""
    socket = str(tmp_path / "later.sock")
    with KVTierContinuousBatchingManager(model, greedy(), tight_cache(), model_id=MODEL_ID, socket=socket) as cb:
        before = cb.generate(PROMPTS, timeout=300)
        cache = cb.batch_processor.cache.cache_tensor
        assert "kvtier" not in kv_mapping(cache) and not cb.tier.engine.registered
        assert cb.counters.stored_blocks == 0 and cb.counters.prefix_lookups == 0, cb.counters
        d = daemon_factory(socket=socket)
        deadline = time.monotonic() + 60
        while not cb.tier.client.connected and time.monotonic() < deadline:
            time.sleep(0.05)  # the keeper stats the socket file once a heartbeat period
        assert cb.tier.client.connected, "the client never found the daemon"
        after = cb.generate(FIRST_ENGINE, timeout=300)
        assert cb.tier.engine.registered and "kvtier" in kv_mapping(cache)
    assert [o.generated_tokens for o in before] == [reference(p) for p in PROMPTS]
    assert [o.generated_tokens for o in after] == [reference(p) for p in FIRST_ENGINE]
    assert cb.counters.stored_blocks >= len(DOCUMENT) // PAGE, cb.counters
    second = in_child(d.socket, SECOND_ENGINE)
    assert second["tokens"] == [reference(p) for p in SECOND_ENGINE]
    assert second["counters"]["loaded_tokens"] >= len(DOCUMENT), second["counters"]
