"""How a benchmark's smoke test runs its script: as a user would, a subprocess of this
interpreter from the repository root, its exit status checked, its output returned."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts")


# A smoke run checks that every row comes out, not how fast: vLLM engines run their engine
# core in their own process (one vLLM import fewer: ~45 s of CPU an engine here, on a
# 2-core CI machine that starts ~15 benchmark engines). The benchmarks themselves, run by
# a user, deploy engines as vLLM does.
SMOKE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, **SMOKE_ENV}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def script(name: str, *args: str) -> str:
    return run([os.path.join(SCRIPTS, name), *args]).stdout
