#!/usr/bin/env python3
"""Fold one finished step of scripts/gpu_acceptance.sh into RESULTS/summary.json.

    python scripts/gpu_summary.py RESULTS STEP EXIT SECONDS [JUNIT_XML]

Called the moment each step ends, so a run cut short (the node's time ran
out) still leaves a summary of every step that finished. The file is
replaced whole (write, then rename). With a JUnit XML (the GPU test step),
each test's outcome is recorded, and the acceptance's named checks
(``CHECKS``) are read off the tests that prove them. A bench step's JSON
(RESULTS/STEP.json) is folded in as it is. Standard library only: it runs
before anything is known to import.
"""

from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET

# What the acceptance proves, by the tests that prove it (docs/GPU.md, "Running the acceptance").
CHECKS = {
    "two_engines_byte_exact": ["test_cuda.py::test_two_worker_processes_share_blocks_byte_exactly"],
    "every_layout_and_copy_method": ["test_cuda.py::test_every_layout_round_trips_byte_exactly"],
    "fences": ["test_cuda.py::test_store_waits_for_the_kernels_that_wrote_the_blocks",
               "test_cuda.py::test_load_waits_until_the_engine_is_done_with_the_destination",
               "test_cuda_fences.py::"],
    "gpu_memory_released": ["test_cuda.py::test_a_killed_workers_gpu_memory_comes_back",
                            "test_cuda.py::test_an_engine_gets_its_kv_memory_back_once_the_daemon_let_go"],
    "hf_continuous_batching_cuda": ["test_transformers_cuda.py::"],
    "engine_adapter_cuda": ["test_engine_kv.py::"],
    # Runs only where the node has SGLang (0.5.23) installed; elsewhere it is "skipped", with why.
    "sglang_engine_end_to_end": ["test_sglang_engine.py::"],
}


def tests_of(junit: str) -> tuple[dict[str, str], dict[str, str]]:
    """({"file.py::test[param]": "passed" | "failed" | "error" | "skipped"},
    {skipped test: pytest's reason, cut to 200 characters})."""
    out, reasons = {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                if child.tag == "skipped":
                    reasons[name] = (child.get("message") or "")[:200]
        out[name] = outcome
    return out, reasons


def why_skipped(checks: dict[str, str], reasons: dict[str, str]) -> dict[str, str]:
    """For each check that was skipped, the reason pytest gave for its first test."""
    return {check: next((r for n, r in reasons.items() if any(n.startswith(p) for p in CHECKS[check])), "")
            for check, outcome in checks.items() if outcome == "skipped"}


def checks_of(tests: dict[str, str]) -> dict[str, str]:
    """A check passed when every test it names ran and passed; "skipped" when none ran."""
    result = {}
    for check, prefixes in CHECKS.items():
        seen = [o for name, o in tests.items() if any(name.startswith(p) for p in prefixes)]
        ran = [o for o in seen if o != "skipped"]
        result[check] = ("not run" if not seen else "skipped" if not ran
                         else "passed" if all(o == "passed" for o in ran) else "failed")
    return result


def main(argv: list[str]) -> int:
    results, step, code, seconds = argv[1], argv[2], int(argv[3]), int(argv[4])
    path = os.path.join(results, "summary.json")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        doc = {"steps": {}}
    entry = {"passed": code == 0, "exit": code, "seconds": seconds,
             "timed_out": code in (124, 137), "log": f"{step}.log"}
    if len(argv) > 5 and os.path.exists(argv[5]):
        try:
            tests, reasons = tests_of(argv[5])
        except ET.ParseError as exc:
            entry["junit_error"] = str(exc)
        else:
            counts: dict[str, int] = {}
            for outcome in tests.values():
                counts[outcome] = counts.get(outcome, 0) + 1
            checks = checks_of(tests)
            entry.update(counts=counts, checks=checks, checks_skipped_because=why_skipped(checks, reasons),
                         not_passed={n: o for n, o in tests.items() if o not in ("passed", "skipped")},
                         skipped=sorted(n for n, o in tests.items() if o == "skipped"))
    bench = os.path.join(results, f"{step}.json")
    if os.path.exists(bench):
        try:
            with open(bench) as f:
                entry["result"] = json.load(f)
        except ValueError as exc:
            entry["result_error"] = str(exc)
    doc["steps"][step] = entry
    doc["updated_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc["passed"] = all(s["passed"] for s in doc["steps"].values())
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
