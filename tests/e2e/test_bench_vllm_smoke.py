"""Smoke test: scripts/bench_vllm.py, vLLM alone, with kvtier and with no daemon, at tiny sizes.

Split from test_benchmarks_smoke.py so that the test runner can give each engine-heavy
smoke run a worker of its own (tests run file by file; one file of them took 40 minutes
of a loaded run by itself).
"""

from __future__ import annotations

import json
import os

from tests.e2e.benchrun import SCRIPTS, run


def test_bench_vllm_fair_benchmark_produces_every_row(tmp_path):
    """Engines alone, with kvtier and with no daemon, alive side by side with the same
    settings: every row (miss, no daemon, hit, throughput, daemon killed) comes out,
    the hit row really loaded from kvtier, and the settings diff names only kvtier's KV mapping."""
    report = tmp_path / "vllm.json"
    out = run([os.path.join(SCRIPTS, "bench_vllm.py"), "--quick", "--json", str(report)], timeout=900).stdout
    data = json.loads(report.read_text())
    [block] = data["blocks"].values()
    assert [r["row"] for r in block["rows"]] == ["miss (daemon up)", "no daemon", "hit (loaded from kvtier)",
                                                 "throughput, miss", "throughput, no daemon"]
    assert [r["row"] for r in data["killed"]["rows"]] == ["daemon killed mid-run", "throughput, daemon killed"]
    for r in block["rows"][:3] + data["killed"]["rows"][:1]:
        assert r["median ms"] > 0 and r["median ratio"] > 0
    # Every hit-row prompt was loaded from kvtier (all but its last token, which vLLM always computes).
    assert all(share > 0.8 for share in block["hit_token_share"])
    # Same engine settings on every side: the OpenMP binding included; only where the KV lives differs.
    s = data["settings"]
    assert s["alone"]["torch_threads"] == s["tier"]["torch_threads"] == s["nodaemon"]["torch_threads"]
    assert data["settings_diff"] and all(k.startswith("kv_cache.mapping.") for k, _ in data["settings_diff"])
    assert "resolved settings that differ" in out and "miss (daemon up) |" in out
