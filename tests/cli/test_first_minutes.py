"""A newcomer's first five minutes: what the quick start and the README's
engine example promise is what happens."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO

ENV = {**os.environ, "PYTHONPATH": REPO}


def run(cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, env=ENV, timeout=60, **kw)


def test_status_without_a_daemon_says_so_at_once_with_exit_3(tmp_path):
    sock = tmp_path / "none.sock"
    r = run(f"{sys.executable} -m kvtier.cli status --socket {sock}")
    assert r.returncode == 3
    assert "no kvtier daemon is running" in r.stderr and str(sock) in r.stderr
    assert "Traceback" not in r.stderr
    # "at once": the missing socket is seen before any connect, so the answer is this one and
    # not a connect timeout's (no timing assertion: a loaded CI machine took 7 s to import)
    assert "timed out" not in r.stderr


def test_a_pool_larger_than_ram_allows_exits_2_so_systemd_does_not_restart_it(tmp_path):
    r = run(f"{sys.executable} -m kvtier.daemon --socket {tmp_path / 'd.sock'} --pool-size 64TiB")
    assert r.returncode == 2
    assert "exceeds" in r.stderr and "ram_fraction" in r.stderr


def test_output_cut_short_by_head_is_not_an_error(daemon):
    for cmd in (f"{sys.executable} -m kvtier.daemon --print-config",
                f"{sys.executable} -m kvtier.cli status --socket {daemon.socket}",
                f"{sys.executable} -m kvtier.cli namespaces --socket {daemon.socket}"):
        r = run(f"set -o pipefail; {cmd} | head -c 1 >/dev/null", executable="/bin/bash")
        assert "BrokenPipeError" not in r.stderr and "Traceback" not in r.stderr, (cmd, r.stderr)


def test_the_cli_does_not_list_itself_among_the_clients(daemon):
    r = run(f"{sys.executable} -m kvtier.cli clients --json --socket {daemon.socket}")
    assert r.returncode == 0 and r.stdout.strip() == "[]"
    assert "CLIENT" in run(f"{sys.executable} -m kvtier.cli status --socket {daemon.socket}").stdout


def test_the_readme_engine_example_runs_as_written(daemon):
    """The example is executed verbatim against a real daemon: a second run
    finds all six blocks the first one stored."""
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index("## Using it from an engine worker"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {**ENV, "KVTIER_SOCKET": daemon.socket}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "done=6" in first.stdout
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert second.returncode == 0, second.stderr
    assert "done=0" in second.stdout  # every block was a hit, nothing new to store
    assert daemon.stats()["totals"]["hits"] == 6


def test_failed_requests_is_empty_not_an_error_on_store_and_load_results():
    from kvtier.client import TransferResult
    assert TransferResult(0, 0, (0, 1)).failed_requests == ()
    assert TransferResult(1, 0, (1,), names=("a", "b")).failed_requests == ("b",)
