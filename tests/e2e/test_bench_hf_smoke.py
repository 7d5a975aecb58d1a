"""Smoke test: scripts/bench_hf.py and scripts/bench_hf_nodaemon.py, Hugging Face continuous batching with and without kvtier, at tiny sizes.

Split from test_benchmarks_smoke.py so that the test runner can give each engine-heavy
smoke run a worker of its own (tests run file by file; one file of them took 40 minutes
of a loaded run by itself).
"""

from __future__ import annotations

import json
import os

from tests.e2e.benchrun import SCRIPTS, run


def test_bench_hf_side_by_side_produces_every_row():
    """Plain HF, HF with kvtier and HF with no daemon, alive side by side with the same
    settings: the no-reuse and cache-pressure tables (tokens checked identical in every run)
    and the second-process TTFT line all come out."""
    out = run([os.path.join(SCRIPTS, "bench_hf.py"), "--quick"], timeout=600).stdout
    assert "differing: none" in out
    for title, engines in (("### no reuse, no cache pressure", ("plain", "tier", "nodaemon")),
                           ("### cache pressure", ("plain", "tier"))):
        section = out[out.index(title):].split("\n\n")[1]
        rows = [ln for ln in section.splitlines() if ln.startswith("|")][2:]
        assert [ln.split("|")[1].strip() for ln in rows] == list(engines)
        assert "tokens identical to plain HF in every run" in out[out.index(title):].splitlines()[0]
    assert "RESULT second-process TTFT median" in out


def test_bench_hf_nodaemon_counts_every_hook_and_compares_every_way(tmp_path):
    """Plain HF, plain HF on memfd pages, kvtier with no daemon and with one, in one
    process at toy sizes: the same tokens every way (the script exits otherwise), every
    way timed, and with no daemon kvtier neither stores, hashes nor looks anything up."""
    report = tmp_path / "hf.json"
    run([os.path.join(SCRIPTS, "bench_hf_nodaemon.py"), "--runs", "1", "--start-reps", "1", "--requests", "4",
         "--prompt-min", "16", "--prompt-max", "40", "--new-tokens", "4", "--hidden", "128", "--layers", "2",
         "--json", str(report)], timeout=600)
    data = json.loads(report.read_text())
    assert set(data["runs"]) == {"plain", "memfd", "nodaemon", "tier"}
    assert all(len(r["wall"]) == 1 and r["fwd_cpu"][0] > 0 for r in data["runs"].values())
    hooks = data["hooks"]
    assert hooks["nodaemon: scheduler.schedule_batch (step)"]["calls"] > 0
    assert not any(k.startswith("nodaemon: tier.") for k in hooks), hooks  # nothing sent, hashed or looked up
    assert hooks["tier: tier.lookup"]["calls"] == 4 and hooks["tier: tier.store"]["calls"] == 4
