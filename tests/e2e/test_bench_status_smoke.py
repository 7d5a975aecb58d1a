"""Smoke test: scripts/bench_status_under_load.py, `kvtier status` next to a real TP=2 vLLM engine.

Split from test_benchmarks_smoke.py so that the test runner can give each engine-heavy
smoke run a worker of its own (tests run file by file; one file of them took 40 minutes
of a loaded run by itself).
"""

from __future__ import annotations

import json
import os

from tests.e2e.benchrun import SCRIPTS, run


def test_bench_status_under_load_runs_a_tp2_engine_and_no_phase_drops_its_clients(tmp_path):
    """A real TP=2 vLLM engine on kvtier's connector: ``kvtier status`` answers in every
    phase (engine starting, idle, generating, SIGSTOPped, gone) and the daemon reaps none of
    the engine's clients while the engine lives - a stopped process is not a dead one."""
    report = tmp_path / "status.json"
    run([os.path.join(SCRIPTS, "bench_status_under_load.py"), "--rounds", "1", "--phase-s", "2",
         "--json", str(report)], timeout=900)
    data = json.loads(report.read_text())
    phases = {p["phase"] for p in data["phases"]}
    assert {"engine starting", "engine idle", "engine generating", "engine stopped"} <= phases
    assert all(p["status_s"] and not p["status_failures"] for p in data["phases"])
    live = [d for d in data["dropped"] if d["phase"].startswith("engine ")]
    assert not live, live
