"""vLLM 0.33's sync loads with kvtier: a hit loaded within the step, and one that fails.

With ``sync_load_budget_bytes`` set, vLLM 0.33 loads a hit during the step
that runs the request (no step spent waiting for the receive). A kvtier load
can fail (its chunks evicted since the lookup, the daemon gone); the request
is already in that step's forward, so the failure must reach vLLM as invalid
blocks, and vLLM then drops the step's output and recomputes.

vLLM can map invalid blocks back to requests only for a model with one KV
cache group, so a hybrid model's loads stay asynchronous (a failure is then a
failed receive, as on 0.32).

Real engines, in-process (``vllm_in_process.py``), a real daemon: the first
process runs a tiny Llama without kvtier (the reference) and with it, and a
tiny Gemma-3-like hybrid model (4 KV cache groups) with it: each stores two
prompts' prefixes; a new process loads them with sync loads on, each engine's
first load losing its chunks (``vllm_faults.SyncLoadsFirstLost``). vLLM 0.32
has no sync loads: there the module skips (``scripts/test.sh`` runs it on
vLLM 0.33's sources).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import DaemonProc
from tests.integrations.test_vllm_hybrid import make_tiny_gemma3, run_engines
from tests.integrations.vllm_example import example, require_vllm

PREFIX_TOKENS = 256          # 8 chunks of 32 tokens
FAULTY_SPEC = "tests.integrations.vllm_faults:SyncLoadsFirstLost"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import TransferJob
    if "sync" not in TransferJob.__dataclass_fields__:
        pytest.skip("this vLLM has no sync loads (they came with 0.33)")
    ex = example()
    tmp = tmp_path_factory.mktemp("vllm-sync")
    llama = ex.make_tiny_llama(str(tmp / "tiny-llama"))
    gemma3 = make_tiny_gemma3(str(tmp / "gemma3"))
    prompts = tmp / "prompts.json"
    # Two prompts with prefixes of their own: B's load of the first fails (injected), of the second not.
    prompts.write_text(json.dumps([ex.shared_prefix_prompts(PREFIX_TOKENS, 1, seed=s)[0] for s in (1, 2)]))
    faults = tmp / "faults"
    faults.touch()
    daemon = DaemonProc(tmp, pool_size="128MiB", slab_size="4MiB")
    try:
        def args(model, **kw):
            return ex.engine_command(model, str(prompts), socket=daemon.socket, **kw)[3:]
        (ref, a, hybrid_a), _ = run_engines(ex, [args(llama, kvtier=False), args(llama), args(gemma3)], tmp, "first")
        # vLLM's log (where its scheduler says it recovered) on stderr, next to kvtier's.
        (b, hybrid_b), log = run_engines(ex, [args(llama, kvtier_spec=FAULTY_SPEC), args(gemma3, kvtier_spec=FAULTY_SPEC)],
                                         tmp, "second", KVTIER_TEST_FAULTS=str(faults),
                                         VLLM_LOGGING_STREAM="ext://sys.stderr")
        yield {"ref": ref, "a": a, "b": b, "hybrid_a": hybrid_a, "hybrid_b": hybrid_b, "log_b": log,
               "faults": faults.read_text().split("\n")[:-1]}
    finally:
        daemon.stop()


def test_a_failed_sync_load_is_recomputed_and_the_next_one_loads(runs):
    """The first load was submitted as a sync (expedited) load and lost its
    chunks: vLLM was told its blocks are invalid and recomputed the request;
    the second prompt's sync load succeeded. B answers exactly as vLLM alone."""
    fault, _ = runs["faults"]
    assert fault.endswith(" expedited"), runs["faults"]
    assert "Recovered from KV load failure" in runs["log_b"], runs["log_b"][-3000:]
    assert runs["b"]["tokens"] == runs["ref"]["tokens"] == runs["a"]["tokens"]
    assert runs["b"]["metrics"]["vllm:kv_offload_load_bytes"] > 0, runs["b"]["metrics"]


def test_a_hybrid_models_loads_stay_asynchronous_and_a_failed_one_is_recomputed(runs):
    """The Gemma-3-like model has 4 KV cache groups: kvtier turned its sync
    loads off (and said so), its first load was submitted as an ordinary one,
    lost its chunks, came back as a failed receive, and vLLM recomputed: tokens
    equal the first engine's."""
    _, fault = runs["faults"]
    assert fault.endswith(" async"), runs["faults"]
    assert "sync_load_budget_bytes=1073741824 ignored: a model with 4 KV cache groups" in runs["log_b"]
    assert "failed; vLLM recomputes it" in runs["log_b"]
    assert runs["hybrid_b"]["tokens"] == runs["hybrid_a"]["tokens"]
    assert runs["hybrid_b"]["metrics"]["vllm:kv_offload_load_bytes"] > 0, runs["hybrid_b"]["metrics"]
