"""vLLM's own offloading-connector tests are kvtier's contract with vLLM: 0.32, as installed.

The test files vLLM 0.32 ships for its ``OffloadingConnector`` are fetched
from vLLM's source distribution (``vllm_sdist.py``; nothing of vLLM is copied
here) and run against the installed CPU build with ``KVTierConnector`` in place
of vLLM's connector (``vllm_contract_run.py`` says how, and what is not run
and why). vLLM 0.33's: ``test_vllm_contract_033.py``.
"""

from __future__ import annotations

import os

import pytest

from tests.integrations import vllm_sdist
from tests.integrations.vllm_contract_run import FILES, check_file, installed_vllm, run_vllm_tests

# vLLM test id (file::name, parameters dropped) -> why kvtier differs on purpose.
DIFFERENCES: dict[str, str] = {}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[tuple[str, str, str]]]:
    installed = installed_vllm()
    if installed != vllm_sdist.VERSION:
        pytest.skip(f"vLLM {installed} is installed; these contract tests are pinned to {vllm_sdist.VERSION}")
    return run_vllm_tests(vllm_sdist.VERSION, tmp_path_factory.mktemp("vllm-contract"), overlay=False)


@pytest.mark.parametrize("vllm_file", FILES)
def test_vllm_offloading_connector_tests_pass_with_kvtier_connector(outcomes, vllm_file):
    """Every test in this vLLM 0.32 file passes with KVTierConnector in place of
    OffloadingConnector, apart from the documented deliberate differences,
    which must still differ."""
    check_file(outcomes[vllm_file], vllm_file, DIFFERENCES)


@pytest.mark.parametrize("version", sorted(vllm_sdist.SDISTS))
def test_a_tampered_sdist_is_never_unpacked(tmp_path, monkeypatch, version):
    """vLLM's files run as code in CI: an sdist whose sha256 is not the
    pinned one (a substituted download or a local file) is refused, nothing
    is unpacked, and the caller skips with the reason."""
    fake = tmp_path / f"vllm-{version}.tar.gz"
    fake.write_bytes(b"not vLLM")
    monkeypatch.setenv("KVTIER_VLLM_TESTS_CACHE", str(tmp_path / "cache"))
    env = "KVTIER_VLLM_SDIST" if version == vllm_sdist.VERSION else "KVTIER_VLLM_SDIST_" + version.replace(".", "_")
    monkeypatch.setenv(env, str(fake))
    with pytest.raises(vllm_sdist.Unavailable, match="sha256"):
        vllm_sdist.tests_root(version)
    with pytest.raises(vllm_sdist.Unavailable, match="sha256"):
        vllm_sdist.overlay_root(version)
    assert os.listdir(vllm_sdist.cache_root()) == []
