"""How a benchmark's smoke test runs its script: as a user would, a subprocess of this
interpreter from the repository root, its exit status checked, its output returned."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts")


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def script(name: str, *args: str) -> str:
    return run([os.path.join(SCRIPTS, name), *args]).stdout
