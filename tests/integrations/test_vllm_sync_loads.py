"""vLLM 0.33's sync loads with kvtier: a hit loaded within the step, and one that fails.

With ``sync_load_budget_bytes`` set, vLLM 0.33 loads a hit during the step
that runs the request (no step spent waiting for the receive). A kvtier load
can fail (its chunks evicted since the lookup, the daemon gone); the request
is already in that step's forward, so the failure must reach vLLM as invalid
blocks, and vLLM then drops the step's output and recomputes.

Real engines, in-process (``vllm_in_process.py``), a real daemon: the first
process runs a tiny Llama without kvtier (the reference) and with it (stores
two prompts' prefixes); a new process loads them with sync loads on, its
first load losing its chunks (``vllm_faults.SyncLoadsFirstLost``). vLLM 0.32
has no sync loads: there the module skips (``scripts/test.sh`` runs it on
vLLM 0.33's sources).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import DaemonProc
from tests.integrations.test_vllm_hybrid import run_engines
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
    model = ex.make_tiny_llama(str(tmp / "tiny-llama"))
    prompts = tmp / "prompts.json"
    # Two prompts with prefixes of their own: B's load of the first fails (injected), of the second not.
    prompts.write_text(json.dumps([ex.shared_prefix_prompts(PREFIX_TOKENS, 1, seed=s)[0] for s in (1, 2)]))
    faults = tmp / "faults"
    faults.touch()
    daemon = DaemonProc(tmp, pool_size="128MiB", slab_size="4MiB")
    try:
        def args(**kw):
            return ex.engine_command(model, str(prompts), socket=daemon.socket, **kw)[3:]
        (ref, a), _ = run_engines(ex, [args(kvtier=False), args()], tmp, "first")
        # vLLM's log (where its scheduler says it recovered) on stderr, next to kvtier's.
        (b,), log = run_engines(ex, [args(kvtier_spec=FAULTY_SPEC)], tmp, "second", KVTIER_TEST_FAULTS=str(faults),
                                VLLM_LOGGING_STREAM="ext://sys.stderr")
        yield {"ref": ref, "a": a, "b": b, "log_b": log, "faults": faults.read_text().split("\n")[:-1]}
    finally:
        daemon.stop()


def test_a_failed_sync_load_is_recomputed_and_the_next_one_loads(runs):
    """The first load was submitted as a sync (expedited) load and lost its
    chunks: vLLM was told its blocks are invalid and recomputed the request;
    the second prompt's sync load succeeded. B answers exactly as vLLM alone."""
    (fault,) = runs["faults"]
    assert fault.endswith(" expedited"), fault
    assert "Recovered from KV load failure" in runs["log_b"], runs["log_b"][-3000:]
    assert runs["b"]["tokens"] == runs["ref"]["tokens"] == runs["a"]["tokens"]
    assert runs["b"]["metrics"]["vllm:kv_offload_load_bytes"] > 0, runs["b"]["metrics"]
