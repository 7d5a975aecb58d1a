"""Smoke test of ``scripts/bench_peers.py``: one round, tiny prompts, real engines.

vLLM alone and kvtier (a real daemon, two engine processes) always run;
vLLM's own CPU offloading is asked too and must be left out with the reason
vLLM gave; LMCache's multi-process mode runs only where its venv exists
(``bash scripts/peers_venv.sh``), and is skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.benchrun import SCRIPTS, SMOKE_ENV

sys.path.insert(0, SCRIPTS)
from tracesim import DEFAULT_TRACE  # noqa: E402

# The pressure row replays ../shared/traces/ (beside the checkout, as on the dev and CI
# machines); a checkout without it runs every other row.
HAS_TRACE = os.path.exists(DEFAULT_TRACE)
ROWS = [*(["--trace", "256"] if HAS_TRACE else []), "--disk", "256MiB", "--disk-rounds", "1"]

SCRIPT = os.path.join(REPO, "scripts", "bench_peers.py")
LMCACHE_PY = os.path.join(REPO, ".venv-lmcache", "bin", "python")
HAS_LMCACHE = os.path.exists(os.path.join(REPO, ".venv-lmcache", "bin", "lmcache"))


def bench(*args: str, python: str = sys.executable, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([python, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, **SMOKE_ENV})


def check_rows(data: dict, shared: list[str]) -> None:
    times, prompt = data["times"], data["args"]["prefix_tokens"] + data["args"]["suffix_tokens"]
    for row in ("miss", "hit", "tok_s"):
        assert set(times[row]) == set(data["systems"]), row
        assert all(x > 0 for xs in times[row].values() for x in xs)
    # A second engine process found the whole prompt in the store (all but the block
    # vLLM always computes itself), for every system that shares one.
    for s in shared:
        assert min(times["hit_tokens"][s]) >= prompt - 32, (s, times["hit_tokens"][s])
        assert data["service_cpu_s"][s] > 0
        assert data["footprint"][s]["service"]["rss_mib"] > 0
    assert data["footprint"]["kvtier"]["installed"]["packages"] >= 1
    # The pressure row (--trace): every system asked for every trace request; the
    # systems with a shared store serve part of the prompts from it (a session's turns
    # alternate between A and B), and no prompt is served more than once over.
    if HAS_TRACE:
        n = len(times["trace_ttft"]["alone"])
        assert n >= 8 and all(len(times["trace_ttft"][s]) == n for s in data["systems"])
        for s in data["systems"]:
            served = sum(times["trace_ext"][s]) + sum(times["trace_local"][s])
            assert served <= sum(times["trace_tokens"][s]), s
        for s in shared:
            assert sum(times["trace_ext"][s]) > 0, s
    # The disk row (--disk): once the RAM tier was flooded, B still gets the whole prompt,
    # and kvtier's come from its disk tier.
    for s in shared:
        assert min(times["disk_hit_tokens"][s]) >= prompt - 32, (s, times["disk_hit_tokens"][s])
    assert min(times["disk_loaded_blocks"]["kvtier"]) > 0
    # What a restart keeps: kvtier's daemon, started again over the same disk directory, has
    # the whole prompt again (LMCache's figure is recorded, not asserted).
    assert min(times["restart_hit_tokens"]["kvtier"]) >= prompt - 32, times["restart_hit_tokens"]


@pytest.mark.skipif(HAS_LMCACHE, reason="covered by the run with LMCache below")
def test_kvtier_and_vllm_alone_side_by_side_and_vllm_offloading_says_why_not(tmp_path):
    """kvtier's hits load the whole prompt in a second process; vLLM's own CPU offloading
    is left out with the exception vLLM raises on its CPU build, not silently dropped."""
    out = tmp_path / "peers.json"
    p = bench("--quick", "--systems", "alone,kvtier,vllm-offload", *ROWS, "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["systems"] == ["alone", "kvtier"]
    check_rows(data, ["kvtier"])
    assert "CUDA" in data["skipped"]["vllm-offload"]
    assert "(a) TTFT of a new prompt" in p.stdout and "left out" in p.stdout


@pytest.mark.skipif(not HAS_LMCACHE, reason="no .venv-lmcache with LMCache (bash scripts/peers_venv.sh makes it)")
def test_lmcache_kvtier_and_vllm_alone_side_by_side(tmp_path):
    """The same with LMCache's server and connector (its venv runs every engine, so all
    systems share one vLLM and torch)."""
    out = tmp_path / "peers.json"
    p = bench("--quick", "--systems", "alone,kvtier,lmcache-lmcache_driven,vllm-offload", *ROWS, "--out", str(out),
              python=LMCACHE_PY)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["systems"] == ["alone", "kvtier", "lmcache-lmcache_driven"]
    check_rows(data, ["kvtier", "lmcache-lmcache_driven"])
    assert data["versions"]["lmcache"] == "0.5.6"
    assert "CUDA" in data["skipped"]["vllm-offload"]


@pytest.mark.parametrize("argv, said", [
    (["--systems", "alone,lmcache"], "unknown ['lmcache']"),
    (["--systems", "kvtier", "--rounds", "many"], "--rounds: invalid int value"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, said):
    p = bench(*argv, timeout=120)
    assert p.returncode == 2 and said in p.stderr, p.stderr
