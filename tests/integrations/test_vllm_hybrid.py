"""Real vLLM engines (CPU build) on hybrid models share prefixes through a real kvtier daemon.

Tiny random models of the kinds with sliding windows, as vLLM 0.32 groups
their KV caches: a Gemma-3-like one (three sliding-window layers and one
full: 4 groups), a GPT-OSS-like one (a sliding window with attention sinks
next to full attention, MoE: 2 groups) and a Mistral-like one (every layer
windowed: 1 group). Windows are 64 tokens, two chunks.

Two processes, engines in-process (``vllm_in_process.py``: ~3 s an engine
instead of ~25): the first runs each model without kvtier (the reference),
then with kvtier (it stores); the second, a new process, runs each with
kvtier again and loads the prefixes, except that its first load of each
model loses one sliding-window group's chunks (``vllm_faults.py``), as if
they were evicted between lookup and load: that prompt is recomputed, the
second one (another prefix) loads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import REPO, DaemonProc
from tests.integrations.vllm_example import example, require_vllm

PREFIX_TOKENS = 256          # 8 chunks of 32 tokens
WINDOW = 64
FAULTY_SPEC = "tests.integrations.vllm_faults:FirstLoadLosesAWindowGroup"


def make_tiny_gemma3(path: str) -> str:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                           sliding_window=WINDOW, torch_dtype="bfloat16",
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def make_tiny_gpt_oss(path: str) -> str:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, torch_dtype="bfloat16",
                       layer_types=["sliding_attention", "full_attention"])
    GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def make_tiny_mistral(path: str) -> str:
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                        sliding_window=WINDOW, torch_dtype="bfloat16")
    MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


# vLLM's group ids of each model's window and full-attention groups.
GROUPS = {"gemma3": ([0, 1, 2], [3]), "gpt-oss": ([0], [1]), "mistral": ([0], [])}


def run_engines(ex, plan: list[list[str]], tmp, name: str, **env) -> tuple[list[dict], str]:
    """The plan's engines one after another in one new process; their results in order, and its log."""
    plan_file = tmp / f"{name}.json"
    plan_file.write_text(json.dumps(plan))
    p = subprocess.run([sys.executable, f"{REPO}/tests/integrations/vllm_in_process.py", str(plan_file)],
                       capture_output=True, text=True, env=ex.engine_env(**env), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines()
               if line.startswith("KVTIER_RESULT ")]
    assert len(results) == len(plan), p.stdout[-2000:]
    return results, p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    ex = example()
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    models = {"gemma3": make_tiny_gemma3(str(tmp / "gemma3")), "gpt-oss": make_tiny_gpt_oss(str(tmp / "gpt-oss")),
              "mistral": make_tiny_mistral(str(tmp / "mistral"))}
    prompts = tmp / "prompts.json"
    # Two prompts with prefixes of their own: B's load of the first fails (injected), of the second not.
    prompts.write_text(json.dumps([ex.shared_prefix_prompts(PREFIX_TOKENS, 1, seed=s)[0] for s in (1, 2)]))
    faults = tmp / "faults"
    faults.touch()
    daemon = DaemonProc(tmp, pool_size="128MiB", slab_size="4MiB")
    try:
        def args(model, **kw):
            return ex.engine_command(models[model], str(prompts), socket=daemon.socket, **kw)[3:]
        first, _ = run_engines(ex, [args(m, **kw) for m in models for kw in ({"kvtier": False}, {})], tmp, "first")
        second, log = run_engines(ex, [args(m, kvtier_spec=FAULTY_SPEC) for m in models], tmp, "second",
                             KVTIER_TEST_FAULTS=str(faults))
        out = {m: {"ref": first[2 * i], "a": first[2 * i + 1], "b": second[i]} for i, m in enumerate(models)}
        out["faults"] = faults.read_text().split("\n")[:-1]
        out["log_b"] = log
        out["status"] = daemon.stats()
        out["daemon_log"] = daemon.read_log()
        yield out
    finally:
        daemon.stop()


def _namespaces(status, model: str) -> dict[int, dict]:
    """The model's namespaces by vLLM group id."""
    found = {}
    for ns in status["namespaces"]:
        if f"/{model}@" in ns["fingerprint"]:
            group = int(ns["fingerprint"].split(",group")[1].split(",")[0])
            found[group] = ns
    return found


@pytest.mark.parametrize("model", list(GROUPS))
def test_a_hybrid_model_with_kvtier_answers_like_vllm_alone_in_both_engines(runs, model):
    """Storing (A) and loading (B, a new process) every group's chunks leaves
    the tokens those of vLLM without kvtier."""
    r = runs[model]
    assert len(set(map(tuple, r["ref"]["tokens"]))) == 2, "the two prompts should not answer alike"
    assert r["a"]["tokens"] == r["ref"]["tokens"]
    assert r["b"]["tokens"] == r["ref"]["tokens"]


@pytest.mark.parametrize("model", list(GROUPS))
def test_a_new_process_loads_a_hybrid_models_prefix_from_kvtier(runs, model):
    """B never computed the prefix; its hits come from A's chunks in the pool."""
    b = runs[model]["b"]["metrics"]
    assert b["vllm:external_prefix_cache_hits"] >= PREFIX_TOKENS - 32
    assert b.get("vllm:kv_offload_load_bytes", 0) > 0, b   # the second prompt's load


@pytest.mark.parametrize("model", list(GROUPS))
def test_each_group_has_its_namespace_and_a_window_group_holds_only_its_window(runs, model):
    """One namespace per model and group. A full-attention group holds every
    chunk of both prefixes; a sliding-window group only the chunks a hit can
    need: vLLM never keeps (so never offloads) the blocks its window left."""
    windows, fulls = GROUPS[model]
    spaces = _namespaces(runs["status"], model)
    assert sorted(spaces) == sorted(windows + fulls), sorted(runs["status"]["namespaces"], key=str)
    assert all(spaces[g]["blocks"] >= 2 * (PREFIX_TOKENS // 32) for g in fulls)
    assert all(0 < spaces[g]["blocks"] <= 2 * (WINDOW // 32 + 1) for g in windows), spaces


def test_each_engine_process_talks_to_the_daemon_over_one_connection_for_all_its_groups(runs):
    """A 4-group model's scheduler and worker each register every group on one
    connection (``Client.share``), not one connection per group: a node's
    engines stay far below ``max_connections_per_user``."""
    log = runs["daemon_log"]
    per_role = Counter(re.findall(r"client \d+ connected: pid=(\d+) .* name='(vllm-(?:scheduler|worker\d+)-[^']*)'", log))
    # One client name per scheduler and per worker (scheduler + worker, 2 kvtier engines per
    # model), not one per group (a name each, "-g<N>"); a keeper's reconnect may repeat one.
    assert len(per_role) == 2 * 2 * len(GROUPS), per_role
    # ... and every group was registered on it: both roles, both engines of each model.
    assert log.count("registered cache") >= 2 * 2 * sum(len(w) + len(f) for w, f in GROUPS.values())


def test_a_load_that_fails_in_one_window_group_is_recomputed_with_identical_tokens(runs):
    """One injected failure per hybrid model (the first load touching several
    groups lost one window group's chunks): the whole receive failed, vLLM
    recomputed the request, and B's tokens still equal the reference."""
    assert len(runs["faults"]) == 2, runs["faults"]
    assert runs["log_b"].count("failed; vLLM recomputes it") >= 2, runs["log_b"][-3000:]
    for model in ("gemma3", "gpt-oss"):
        assert runs[model]["b"]["tokens"] == runs[model]["ref"]["tokens"]
