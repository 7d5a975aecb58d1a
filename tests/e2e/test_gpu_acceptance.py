"""The GPU acceptance's plumbing, on a machine without a GPU.

A GPU node's time is short, so what the acceptance does around the GPU must
already work before it gets there: each step's outcome is written the moment
the step ends (a run cut short keeps what finished), the tests that prove
each named check are read off pytest's own JUnit report, and the daemons the
tests start import what the caller's PYTHONPATH names (the node's extra
packages are installed with ``pip --target`` and found only through it).
The dry run (``scripts/gpu_acceptance.sh --dry-run``) runs in scripts/test.sh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO, DaemonProc

SUMMARY = os.path.join(REPO, "scripts", "gpu_summary.py")

# Stand-ins named like the real GPU tests, so the named checks map onto them.
FAKE_TESTS = textwrap.dedent("""
    import pytest

    def test_two_worker_processes_share_blocks_byte_exactly():
        pass

    @pytest.mark.parametrize("copy", ["dma", "kernel"])
    def test_every_layout_round_trips_byte_exactly(copy):
        assert copy == "dma", "kernel path wrote the wrong bytes"

    def test_a_killed_workers_gpu_memory_comes_back():
        pytest.skip("needs two GPUs")
""")
# Where the node has no SGLang, the engine end-to-end check is skipped and says why.
FAKE_SGLANG = textwrap.dedent("""
    import pytest

    def test_a_second_sglang_engine_prefetches_the_prompt_from_kvtier_and_answers_the_same():
        pytest.skip("SGLang engine end to end: sglang is not installed")
""")


def fold(results, step: str, code: int, seconds: int, junit: str = "") -> dict:
    subprocess.run([sys.executable, SUMMARY, str(results), step, str(code), str(seconds), junit], check=True)
    with open(os.path.join(results, "summary.json")) as f:
        return json.load(f)


def test_each_finished_step_is_in_the_summary_with_its_tests_and_named_checks(tmp_path):
    (tmp_path / "test_cuda.py").write_text(FAKE_TESTS)
    (tmp_path / "test_sglang_engine.py").write_text(FAKE_SGLANG)
    junit = tmp_path / "gpu_tests.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_cuda.py"),
                          str(tmp_path / "test_sglang_engine.py"), f"--junitxml={junit}"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 1  # one test failed for real
    results = tmp_path / "results"
    results.mkdir()
    doc = fold(results, "setup", 0, 9)
    assert doc["passed"] and doc["steps"]["setup"]["seconds"] == 9

    doc = fold(results, "gpu_tests", 1, 170, str(junit))
    tests = doc["steps"]["gpu_tests"]
    assert not doc["passed"] and "setup" in doc["steps"]  # the earlier step is kept
    assert tests["counts"] == {"passed": 2, "failed": 1, "skipped": 2}
    assert tests["not_passed"] == {"test_cuda.py::test_every_layout_round_trips_byte_exactly[kernel]": "failed"}
    checks = tests["checks"]
    assert checks["two_engines_byte_exact"] == "passed"
    assert checks["every_layout_and_copy_method"] == "failed"
    assert checks["gpu_memory_released"] == "skipped"
    assert checks["hf_continuous_batching_cuda"] == "not run"
    assert checks["sglang_engine_end_to_end"] == "skipped"
    assert tests["checks_skipped_because"] == {"gpu_memory_released": "needs two GPUs",
                                               "sglang_engine_end_to_end": "SGLang engine end to end: "
                                                                           "sglang is not installed"}

    (results / "bench_gpu.json").write_text(json.dumps({"rows": [{"case": "2mib", "store_gbps": 20.0}]}))
    doc = fold(results, "bench_gpu", 124, 90)  # cut at its limit, with the rows it had written
    bench = doc["steps"]["bench_gpu"]
    assert bench["timed_out"] and bench["result"]["rows"][0]["store_gbps"] == 20.0
    assert set(doc["steps"]) == {"setup", "gpu_tests", "bench_gpu"}
    assert sorted(os.listdir(results)) == ["bench_gpu.json", "summary.json"]  # no temporary left


def test_a_run_that_stops_at_its_first_step_still_leaves_its_summary(tmp_path):
    """On this machine the setup step itself fails (no CUDA): the script stops
    there, with the step's log and summary written and a non-zero exit."""
    results = tmp_path / "results"
    run = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_acceptance.sh"), str(results)],
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    doc = json.loads((results / "summary.json").read_text())
    assert list(doc["steps"]) == ["setup"] and not doc["steps"]["setup"]["passed"]
    assert "needs CUDA torch" in (results / "setup.log").read_text()


def test_daemons_the_tests_start_import_what_the_callers_pythonpath_names(tmp_path, monkeypatch):
    """A GPU node's missing packages live in a ``pip --target`` folder named only
    by PYTHONPATH; a daemon started with PYTHONPATH replaced would not find them."""
    extra = tmp_path / "site"
    extra.mkdir()
    marker = tmp_path / "seen"
    # Imported at interpreter start from any folder on the path: proves the daemon saw it.
    (extra / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('daemon saw the folder')\n")
    monkeypatch.setenv("PYTHONPATH", str(extra))
    d = DaemonProc(tmp_path)
    try:
        assert marker.read_text() == "daemon saw the folder"
    finally:
        d.stop()
