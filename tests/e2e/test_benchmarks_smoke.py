"""Smoke tests: every benchmark script and the demo run end to end at tiny sizes.

Each runs as a subprocess exactly as a user would (real daemon, real client
processes) and its report is checked for the keys and values BENCHMARKS.md
relies on, so a refactor that breaks a script fails here. The engine-heavy ones
(vLLM, Hugging Face, a TP=2 engine next to `kvtier status`) have files of their own
(test_bench_vllm_smoke.py, test_bench_hf_smoke.py, test_bench_status_smoke.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.benchrun import SCRIPTS, run, script


def test_bench_transfer_measures_every_point_of_both_layouts(tmp_path):
    report = tmp_path / "transfer.json"
    table = script("bench_transfer.py", "--block-sizes", "32KiB,256KiB", "--batches", "1,8,64",
                   "--max-point-bytes", "2MiB", "--pool-size", "32MiB", "--slab-size", "4MiB", "--layers", "4",
                   "--min-time", "0", "--min-reps", "2", "--max-reps", "2", "--json", str(report))
    rows = json.loads(report.read_text())["rows"]
    points = {(r["layout"], r["block_bytes"], r["batch"]) for r in rows}
    # 256 KiB x 64 exceeds the 2 MiB cap, so that batch shrinks to 8 and merges with the 8 point.
    assert points == {(lay, b, n) for lay in ("mla", "flashinfer") for b, n in
                      [(32768, 1), (32768, 8), (32768, 64), (262144, 1), (262144, 8)]}
    for r in rows:
        assert r["bytes"] == r["block_bytes"] * r["batch"]
        assert min(r["store_gbps"], r["load_gbps"], r["routine_gbps"], r["copy_gbps"]) > 0
        assert r["load_vs_copy"] == pytest.approx(r["load_gbps"] / r["copy_gbps"])
    assert {r["tensors"] for r in rows} == {1, 4}
    # The same run printed the Markdown table: header, rule, one line per point.
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert "store/copy_" in lines[0] and "load/copy_" in lines[0]
    assert len(lines) == 2 + len(rows) and sum("flashinfer x4" in ln for ln in lines) == 5


def test_bench_control_reports_latency_throughput_and_index_scaling():
    out = json.loads(script("bench_control.py", "--sizes", "1,16", "--clients", "1,2", "--duration", "0.2",
                            "--slices", "1", "--index-sizes", "100,2000", "--min-time", "0", "--min-reps", "20",
                            "--max-reps", "20", "--json"))
    assert [r["hashes"] for r in out["latency"]] == [1, 16]
    for r in out["latency"]:
        assert 0 < r["hit_p50_us"] <= r["hit_p99_us"] and 0 < r["bare_p50_us"] <= r["bare_p99_us"]
        assert r["frame_bytes"] > 16 * r["hashes"]
    assert [r["clients"] for r in out["throughput"]] == [1, 2]
    assert all(r["kvtier_rps"] > 0 and r["bare_rps"] > 0 for r in out["throughput"])
    assert [r["blocks"] for r in out["index"]] == [100, 2000]
    assert all(r["lookup32_p50_us"] > 0 and r["stats_p50_ms"] > 0 for r in out["index"])


def redis_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server not installed (apt-get install -y redis-server)"
    if importlib.util.find_spec("redis") is None:
        return "python module redis not installed (pip install 'kvtier[bench]')"
    return None


@pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))
def test_bench_redis_compares_both_ops():
    out = json.loads(script("bench_redis.py", "--block-sizes", "32KiB", "--batch", "4", "--clients", "1",
                            "--duration", "0.1", "--slices", "1", "--pool-size", "32MiB", "--json"))
    assert [(r["op"], r["batch"], r["clients"]) for r in out["rows"]] == [("store", 4, 1), ("load", 4, 1)]
    for r in out["rows"]:
        assert r["kvtier_gbps"] > 0 and r["redis_gbps"] > 0
        assert r["kvtier_vs_redis"] == pytest.approx(r["kvtier_gbps"] / r["redis_gbps"])
    assert out["redis_server"].startswith("Redis server")


def test_bench_redis_skips_cleanly_without_a_server():
    out = script("bench_redis.py", "--redis-server", "/nonexistent/redis-server")
    assert out.startswith("bench_redis: skipped: redis-server not found")


TINY_DEMO = ["--doc-tokens", "200", "--question-tokens", "8", "--dim", "64", "--new-tokens", "4",
             "--questions-a", "1", "--questions-b", "2"]


def test_demo_engine_b_hits_and_reproduces_the_reference_exactly(daemon):
    # Against a running daemon (--socket): the blocks it keeps afterwards are A's and B's stores.
    out = json.loads(run(["-m", "kvtier.cli", "demo", "--socket", daemon.socket, *TINY_DEMO, "--json"]).stdout)
    assert out["identical_tokens"] and out["identical_logits"] and out["identical_kv"]
    doc_blocks = 200 // 16
    assert [r["hit_blocks"] for r in out["engine_b"]] == [doc_blocks, doc_blocks]
    assert all(r["max_logit_diff"] == 0.0 and r["prefilled_tokens"] == 208 - 16 * doc_blocks
               for r in out["engine_b"])
    assert out["engine_a"][0]["hit_blocks"] == 0 and out["engine_a"][0]["stored_blocks"] == 13
    ns = daemon.stats()["namespaces"][0]
    # A stored 13 blocks; each B question adds its one block past the document.
    assert ns["blocks"] == 13 + 2 and ns["loaded"] == 2 * doc_blocks
    assert out["bytes_loaded"] == 2 * doc_blocks * out["block_bytes"]


def test_demo_script_starts_its_own_daemon_and_prints_the_summary():
    out = script("demo.py", *TINY_DEMO)
    assert "identical tokens True, identical logits True, identical document KV True" in out
    assert "hit rate" in out and "TTFT median" in out


def test_bench_remote_reports_load_lookup_and_store_against_baselines():
    from tests.remote.cluster import why_missing
    if why_missing():
        pytest.fail(f"bench_remote needs a Redis Cluster: {why_missing()}", pytrace=False)
    out = json.loads(script("bench_remote.py", "--quick", "--json"))
    [load] = out["load"]
    assert min(load["remote_gbps"], load["local_gbps"], load["redis_get_gbps"]) > 0
    assert load["remote_vs_local"] == pytest.approx(load["remote_gbps"] / load["local_gbps"])
    assert load["remote_vs_redis_get"] == pytest.approx(load["remote_gbps"] / load["redis_get_gbps"])
    lk = out["lookup"]
    assert lk["added_by_remote_miss_p50_us"] == pytest.approx(lk["miss_remote_p50_us"] - lk["miss_no_remote_p50_us"])
    [store] = out["store"]
    assert store["write_behind_gbps"] > 0 and store["no_remote_gbps"] > 0 and store["visible_on_b_ms"] > 0


def test_bench_remote_backlog_measures_both_trees_and_every_store_arrives(tmp_path):
    from tests.remote.cluster import why_missing
    if why_missing():
        pytest.fail(f"bench_remote needs a Redis Cluster: {why_missing()}", pytrace=False)
    # From a directory without kvtier/, as its docstring says; this tree as its own baseline.
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_remote.py"), "--backlog", "--reps", "1",
                           "--queue", "1MiB", "--baseline-tree", REPO, "--json"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {(r["multiple"], r["tree"]) for r in out["rows"]} == {(m, t) for m in (1, 2, 4, 8)
                                                                for t in ("this", "baseline")}
    assert all(r["share_min"] == 1 for r in out["rows"])  # every block of every store reached the cluster


@pytest.mark.parametrize("args, why", [
    (["--backlog", "--baseline-tree", REPO], "without kvtier/"),  # run from REPO: every node would run it
    (["--backlog", "--reps", "0"], "--reps"),
    (["--backlog", "--baseline-tree", "/nonexistent"], "has no kvtier/")])
def test_bench_remote_refuses_what_would_measure_the_wrong_code(args, why):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_remote.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr
    assert why in proc.stderr, proc.stderr


def test_bench_disk_reports_loads_against_dd_the_io_methods_and_lookups():
    out = json.loads(script("bench_disk.py", "--bytes", "16MiB", "--reps", "1", "--threads", "2",
                            "--lookups", "20", "--cache", "fadvise", "--json"))
    assert out["loads"]["cache"] == "fadvise" and out["blocks"] == 64
    assert min(out["loads"]["kvtier"]["2"] + out["loads"]["dd"] + out["loads"]["fio4"] + out["loads"]["files"]) > 0
    assert set(out["method"]) == {"2-buffered", "2-bounce", "2-direct"}
    assert min(out["writes"]["fsync"] + out["writes"]["no_fsync"]) > 0
    assert set(out["lookups"]["round_trip_us"]) == {"ram", "disk"}
    assert len(out["lookups"]["in_process_ns"]) == 4 and len(out["loadavg"]) == 2


def test_bench_disk_small_loads_loads_every_chain_from_disk_then_from_ram(tmp_path):
    out = json.loads(script("bench_disk_small_loads.py", "--lengths", "1,8", "--chains", "2", "--dir", str(tmp_path),
                            "--json"))
    assert [r["blocks"] for r in out["rows"]] == [1, 8]
    assert all(min(r["disk_p50_ms"], r["ram_p50_ms"]) > 0 for r in out["rows"])
    assert out["read_counters"]["read"] == 2 * (1 + 8)  # every block of every chain came from disk, once
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args", [["--lengths", "0"], ["--lengths", "300"], ["--lengths", "a"], ["--chains", "0"]])
def test_bench_disk_small_loads_refuses_what_cannot_run(args):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_disk_small_loads.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_disk_stores_times_every_daemon_and_says_what_each_wrote():
    out = json.loads(script("bench_disk_stores.py", "--stores", "3", "--reps", "1", "--baseline", REPO, "--json"))
    assert set(out["stores"]) == {"baseline, disk on", "this, disk on", "this, disk off"}
    assert all(len(runs) == 1 and min(runs[0]) > 0 for runs in out["stores"].values())
    assert out["written"]["this, disk on"][0]["written"] == 3 * 16  # every block of the 3 stores reached the disk
    cpu = out["cpu_ms_per_store"]  # per daemon and rep: (loop thread, other threads) ms per store
    assert set(cpu) == set(out["stores"]) and all(len(r) == 1 and min(r[0]) >= 0 for r in cpu.values())


def test_bench_disk_stores_compares_the_writer_process_with_the_daemons_threads():
    out = json.loads(script("bench_disk_stores.py", "--stores", "3", "--reps", "1", "--baseline", REPO,
                            "--threads-row", "--json"))
    assert set(out["stores"]) == {"baseline, disk on", "this, disk on", "this, disk off",
                                  "this, disk on, writes on threads"}
    assert out["written"]["this, disk on, writes on threads"][0]["written"] == 3 * 16


def test_bench_disk_stores_on_a_full_disk_overwrites_evicted_files():
    out = json.loads(script("bench_disk_stores.py", "--stores", "12", "--reps", "1", "--baseline", REPO,
                            "--disk-size", "24MiB", "--json"))
    w = out["written"]["this, disk on"][0]  # 192 blocks of 260 KiB files into 94 files' room
    assert w["recycled"] >= w["written"] - 94 > 0 and w["unlinked"] == 0


@pytest.mark.parametrize("args", [["--stores", "0"], ["--reps", "0"], ["--baseline", "/nonexistent"],
                                  ["--disk-size", "lots"]])
def test_bench_disk_stores_refuses_what_cannot_run(args):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_disk_stores.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_disk_writes_times_every_step_of_every_writer_path(tmp_path):
    report = tmp_path / "writes.json"
    script("bench_disk_writes.py", "--blocks", "70", "--rounds", "1", "--block-bytes", "4KiB", "--dir", str(tmp_path),
           "--json", str(report))  # 70 blocks: past the 64 kept, so writes evict
    rows = json.loads(report.read_text())["rows"]
    assert len(rows) in (2, 5) and all(r["cpu"] > 0 and r["wall"] > 0 and r["read_cpu"] > 0
                                       for r in rows.values())  # 2 rows: this filesystem refuses O_DIRECT
    tier = rows["file per block, buffered"]
    assert tier["rename"] > 0 and tier["open"] > 0 and tier["unlink"] > 0  # steps the one-file rows do not take
    if len(rows) == 5:
        assert rows["file per block, O_DIRECT, evicted file overwritten (the tier)"]["unlink"] > 0  # its rename
    assert os.listdir(tmp_path) == ["writes.json"]  # every variant's files removed


@pytest.mark.parametrize("args", [["--blocks", "0"], ["--rounds", "0"], ["--dir", "/nonexistent"],
                                  ["--block-bytes", "1000"], ["--block-bytes", "lots"]])
def test_bench_disk_writes_refuses_what_cannot_run(args):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_disk_writes.py"), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_remote_values_times_framing_and_verifying_each_size():
    out = json.loads(script("bench_remote_values.py", "--runs", "1", "--json"))
    assert [r["bytes"] for r in out["rows"]] == [262144, 4096]
    assert all(min(r["frame_us"], r["verify_us"], r["frame_gbps"], r["verify_gbps"]) > 0 for r in out["rows"])


def test_bench_engine_reports_every_row_of_issue_16_as_a_ratio():
    """Copy rows (per-layer, scattered), lookups next to the bare echo (over the
    socket and from the daemon's shm lookup mirror) and the multi-client throughput rows."""
    out = json.loads(script("bench_engine.py", "--pieces", "1KiB", "--lookup-sizes", "64", "--clients", "2",
                            "--duration", "0.2", "--slices", "1", "--min-time", "0", "--min-reps", "3",
                            "--max-reps", "3", "--json"))
    paths = [r["path"] for r in out["copy"]]
    assert paths == [f"{d} {what}" for what in ("1 block, 32 x 64 KiB", "16 blocks, 32 x 64 KiB",
                                                "256 scattered, 32 x 1KiB") for d in ("store", "load")]
    for r in out["copy"]:
        assert r["ratio"] == pytest.approx(r["base_us"] / r["kvtier_us"]) and r["routine_us"] > 0
    assert [r["path"] for r in out["lookup"]] == ["lookup 64 hashes, p50", "lookup 64 hashes (lookup_index on), p50"]
    assert all(r["ratio"] == pytest.approx(r["kvtier_us"] / r["base_us"]) for r in out["lookup"])
    assert [tp["path"] for tp in out["throughput"]] == ["32-hash lookups/s, 2 clients",
                                                        "32-hash lookups/s, 2 clients (lookup_index on)"]
    assert all(tp["kvtier_rps"] > 0 and tp["base_rps"] > 0 for tp in out["throughput"])


def test_bench_shares_times_every_case_and_the_at_share_case_evicts_only_its_own():
    out = json.loads(script("bench_shares.py", "--pool-mib", "8", "--stores", "5", "--min-time", "0.01", "--json"))
    cases = out["cases"]
    assert len(cases) == 6 and min(c["us_median"] for c in cases.values()) > 0
    flood = cases["flood, on (0.5, at share)"]
    assert flood["evictions"] == flood["own_evictions"] > 0  # the idle tenant lost nothing
    assert cases["two tenants, on (0.75)"]["own_evictions"] == 0  # below its share: global LRU


def test_bench_disk_index_times_the_flush_and_the_rebuild_after_it_for_both_trees():
    """Against this very tree as the baseline: the before rows must parse too."""
    out = script("bench_disk_index.py", "--files", "3000", "--rounds", "1", "--baseline-tree", REPO)
    lines = [ln for ln in out.splitlines() if ln.startswith("round 1")]
    assert len(lines) == 4  # kept 1 and kept 1,500, each for both trees
    for ln in lines:
        fields = dict(f.rsplit(" ", 1) for f in ln.split(": ", 1)[1].split(", "))
        assert float(fields["write_ms"]) >= 0 and float(fields["tidy_batch_ms"]) >= 0
        assert int(fields["heap_after"]) == (1 if "kept       1" in ln else 1500) + 1


def test_bench_lru_times_touch_insert_and_eviction_for_both_trees():
    out = script("bench_lru.py", "--entries", "5000", "--rounds", "3", "--baseline-tree", REPO)
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["before", "this"]
    assert all("touch" in ln and "insert" in ln and "evict" in ln and "B/entry" in ln for ln in lines)


def test_bench_mirror_stores_times_the_three_daemons_and_counts_rehashes():
    out = json.loads(script("bench_mirror_stores.py", "--stores", "400", "--blocks", "8", "--json"))
    assert [r[0] for r in out["rows"]] == ["off", "on", "on-quiet"]
    assert all(r[1] > 0 and r[4] > 0 for r in out["rows"])  # every daemon's stores evicted
    assert out["rehashes_in_process"] >= 0 and out["pool_blocks"] == 2048


def test_bench_store_threads_times_both_daemons_quiet_and_busy():
    out = json.loads(script("bench_store_threads.py", "--before", REPO, "--stores", "10", "--blocks", "2",
                            "--hogs", "1", "--json"))
    assert [r[:2] for r in out["rows"]] == [["quiet", "before"], ["quiet", "after"],
                                            ["1 busy processes", "before"], ["1 busy processes", "after"]]
    assert all(r[2] > 0 and r[4] >= 0 for r in out["rows"])


@pytest.mark.parametrize("name, args", [("bench_mirror_stores.py", ["--stores", "10"]),
                                        ("bench_mirror_stores.py", ["--tree", "/nonexistent"]),
                                        ("bench_store_threads.py", ["--before", "/nonexistent"]),
                                        ("bench_store_threads.py", ["--before", REPO, "--blocks", "99"])])
def test_the_mirror_and_thread_benchmarks_refuse_what_cannot_run(name, args):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_ready_map_times_stores_lookups_and_loads_of_a_namespace_in_shards():
    out = json.loads(script("bench_ready_map.py", "--blocks", "70000", "--churn", "3200", "--split-at", "4096",
                            "--json"))
    assert out["ready_map"] == "ShardedMap" and out["blocks"] > 65000 and out["evictions"] == 3200
    assert [r[0].split()[0] for r in out["rows"]] == ["store", "lookup", "load"]
    assert all(r[1] > 0 and r[3] > 0 for r in out["rows"])


def test_bench_start_times_the_first_answer_and_the_whole_pool_in_for_both_trees():
    out = json.loads(script("bench_start.py", "--pools", "64MiB", "--reps", "1", "--baseline-tree", REPO, "--json"))
    assert set(out["starts"]) == set(out["whole_pool_in"]) == {"64MiB this tree", "64MiB baseline"}
    for name, [first] in out["starts"].items():
        [whole] = out["whole_pool_in"][name]
        assert 0 < first <= whole  # the whole pool is in no sooner than the first answer


def test_bench_index_measures_both_builds_of_the_index(tmp_path):
    from kvtier.pool.entry import NATIVE
    if not NATIVE:
        pytest.skip("the compiled index (kvtier/pool/_native.c) is not built")
    out = tmp_path / "index.json"
    script("bench_index.py", "--blocks", "20000", "--chain", "100", "--reps", "1", "--map-entries", "5000",
           "--json", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert [r["native"] for r in runs["native"]] == [True] and [r["native"] for r in runs["python"]] == [False]
    for r in runs["native"] + runs["python"]:
        assert r["heap_per_block"] > 0 and min(r["ops_us"].values()) > 0 and r["map_churn_longest_ms"] > 0


def test_bench_index_refuses_what_cannot_run():
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_index.py"), "--chain", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "error:" in proc.stderr and "Traceback" not in proc.stderr
