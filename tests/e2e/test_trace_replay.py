"""A public serving trace replayed through real daemons, and the in-process references.

``scripts/bench_trace.py`` sends each request of the trace, in order, to one
of several engine processes with their own paged caches and clients: lookup,
load of the hit prefix (sampled blocks checked byte for byte), store of the
rest. ``scripts/tracesim.py`` computes on the same sequence what an infinite
cache, kvtier's LRU order and the offline bound would have hit (and, with the
disk tier, its RAM-over-disk order). The daemon must hit exactly what its
documented order predicts, in every scenario.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)
import tracesim  # noqa: E402

TRACE = tracesim.DEFAULT_TRACE


@pytest.mark.skipif(not os.path.exists(TRACE), reason=f"no trace at {TRACE}")
def test_the_daemon_hits_exactly_what_its_lru_order_predicts_in_every_scenario(tmp_path):
    report = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_trace.py"), "--requests", "200",
                           "--capacities", "0.1", "--engines", "2", "--block-bytes", "4KiB",
                           "--verify-every", "1", "--json", str(report)],
                          capture_output=True, text=True, timeout=600, cwd=SCRIPTS,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["scenario"]: r for r in json.loads(report.read_text())["rows"]}
    assert set(rows) == {"shared-spread", "private-spread", "shared-sticky", "private-sticky", "disk"}
    for name, r in rows.items():
        assert r["bad_blocks"] == 0 and (r["verified_blocks"] > 0 or r["hit_ratio"] == 0), name
        assert r["daemon_hits"] == round(r["hit_ratio"] * r["references"]), name  # its counters agree
        assert r["hit_ratio"] <= r["sim_belady"] + 1e-9 <= r["infinite"] + 2e-9, name
        if name != "disk":  # RAM only: block for block what kvtier's documented order predicts
            assert r["hit_ratio"] == pytest.approx(r["sim_lru"], abs=1e-12), name
    # RAM over the disk tier, each request after the last one's writes: what the documented
    # order of both tiers predicts (tracesim's ram+disk), every stored block written.
    disk = rows["disk"]
    assert disk["drained"] and disk["disk"]["written"] > 0 and not disk["disk"]["not_written"]
    assert disk["hit_ratio"] == pytest.approx(disk["sim_ram_disk"], abs=1e-12)
    assert rows["shared-spread"]["hit_ratio"] <= disk["hit_ratio"] <= disk["sim_lru_combined"] + 1e-12
    assert rows["shared-spread"]["hit_ratio"] > rows["private-spread"]["hit_ratio"]


@pytest.mark.skipif(not os.path.exists(TRACE), reason=f"no trace at {TRACE}")
def test_split_blocks_and_copies_of_the_trace_keep_what_the_unsplit_trace_predicts(tmp_path):
    """At scale: each trace block as 4 kvtier blocks, two copies of the trace at once (a model
    each: own namespace, own engine). The daemon's blocks are byte-exact, each copy's keys are
    its own, and the hits equal the LRU order simulated on the unsplit trace blocks."""
    import bench_trace

    chains = [[1, 2], [1, 3]]
    assert bench_trace.expand(chains, 2, 2) == [[2, 3, 4, 5], [10, 11, 14, 15], [2, 3, 6, 7], [10, 11, 12, 13]]
    report = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_trace.py"), "--requests", "120",
                           "--capacities", "0.2", "--scenarios", "shared-spread", "--split", "4", "--copies", "2",
                           "--block-bytes", "4KiB", "--verify-every", "1", "--json", str(report)],
                          capture_output=True, text=True, timeout=600, cwd=SCRIPTS,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(report.read_text())
    (r,) = out["rows"]
    assert (out["split"], out["copies"], out["engines"], out["requests"]) == (4, 2, 2, 240)
    assert r["bad_blocks"] == 0 and r["verified_blocks"] > 0 and r["hit_ratio"] > 0
    assert r["daemon_hits"] == round(r["hit_ratio"] * r["references"])
    assert r["hit_ratio"] == pytest.approx(r["sim_lru"], abs=0.01)  # a trace block's 4 go together
    assert r["rss_after_mib"] > 0 and r["rss_per_block_held"] is not None


def test_every_policy_lies_between_nothing_and_the_offline_bound():
    chains = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7], [5, 6, 8], [9], [1, 2, 4], [5, 6]]
    refs = tracesim.references(chains)
    assert refs == 21 and tracesim.working_set(chains) == 9
    # Infinite: every block seen before, up to the request's first new one.
    assert tracesim.hit_ratio("infinite", 0, chains) == pytest.approx((0 + 2 + 0 + 3 + 2 + 0 + 3 + 2) / refs)
    for cap in (1, 2, 3, 4, 6):
        bound = tracesim.hit_ratio("belady", cap, chains)
        for policy in ("lru", "lru2", "lrfu", "arc", "lfu", "oracle-ever", "oracle-count", "children", "leaf-first",
                       "wtinylfu", "wtinylfu-tail", "s3fifo", "slru", "ram+disk", "lru-combined"):
            assert 0 <= tracesim.hit_ratio(policy, cap, chains) <= bound + 1e-12, (policy, cap)
    # Two blocks of LRU hold [1, 2] through the next request (the chain's tail goes first).
    assert tracesim.hit_ratio("lru", 2, [[1, 2, 3], [1, 2, 4]]) == pytest.approx(2 / 6)


def test_the_disk_tier_model_hits_what_ram_lost_but_pays_for_holding_ram_twice():
    """kvtier's disk is inclusive (every stored block is written): with a disk as large as the
    pool it adds nothing, where one LRU of both sizes would keep the older document."""
    chains = [[1, 2], [3, 4], [1, 2]]
    # A disk of two pools holds the first document after RAM dropped it: read back, a hit.
    assert tracesim.hit_ratio("lru", 2, chains) == 0
    assert tracesim.hit_ratio("ram+disk", 2, chains, disk_x=2) == pytest.approx(2 / 6)
    assert tracesim.hit_ratio("lru-combined", 2, chains, disk_x=2) == pytest.approx(2 / 6)
    # A disk of one pool holds what RAM holds: the pair reaches what one LRU of twice the size does not.
    assert tracesim.hit_ratio("ram+disk", 2, chains, disk_x=1) == 0
    assert tracesim.hit_ratio("lru-combined", 2, chains, disk_x=1) == pytest.approx(2 / 6)


@pytest.mark.parametrize("script", ["tracesim.py", "bench_trace.py"])
@pytest.mark.parametrize("disk_x", ["-1", "0", "nan", "inf", "ten"])
def test_a_disk_size_that_is_no_positive_number_of_pools_is_refused_before_any_replay(script, disk_x):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--trace", os.devnull,
                           "--disk-x", disk_x], capture_output=True, text=True, timeout=120, cwd=SCRIPTS,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "--disk-x" in proc.stderr


def test_leaf_first_keeps_a_document_head_that_lru_lets_go_for_unshared_tails():
    """Two questions on document 1, then three one-block requests: LRU drops the head
    by age; leaf-first drops the unshared blocks first and the third question hits."""
    chains = [[1, 2], [1, 3], [4], [5], [6], [1, 7]]
    assert tracesim.hit_ratio("lru", 3, chains) == pytest.approx(1 / 9)
    assert tracesim.hit_ratio("leaf-first", 3, chains) == pytest.approx(2 / 9)


def test_tinylfu_turns_away_a_first_seen_block_when_the_victim_was_seen_more():
    """Frequency-gated admission: the window is one block, the main part two; a block
    seen once does not displace a block seen three times."""
    import tracepolicies

    cache = tracepolicies.WTinyLFU(3)
    for ids in ([1], [1], [1], [2], [3], [4]):
        cache.request(ids)
    assert 1 in cache and 4 in cache  # 4 in the window; 2 or 3 turned away, 1 kept


def test_s3fifo_keeps_a_block_read_twice_through_a_scan_of_blocks_read_once():
    """Ten pools of one block each: the first block is read again while in the small
    queue, so it moves to the main part; the scan that follows passes through the small
    queue and the ghost, and the block is still there when it is asked for a third time.
    LRU of the same size let it go by age."""
    chains = [[1], [1]] + [[b] for b in range(2, 13)] + [[1]]
    assert tracesim.hit_ratio("lru", 10, chains) == pytest.approx(1 / 14)
    assert tracesim.hit_ratio("s3fifo", 10, chains) == pytest.approx(2 / 14)


def test_s3fifo_admits_a_block_its_ghost_remembers_straight_to_the_main_part():
    import tracepolicies

    cache = tracepolicies.S3FIFO(10)  # small queue of one block
    for ids in ([1], [2], [1]):  # 1 leaves unread for the ghost, then comes back
        cache.request(ids)
    assert 1 in cache.main and 2 in cache.small and 1 not in cache.ghost


def test_slru_protects_a_block_read_twice_from_a_scan_of_new_blocks():
    """A block referenced while on probation is protected; five new blocks then
    pass through probation without evicting it, where LRU of five drops it."""
    chains = [[1], [1], [2], [3], [4], [5], [6], [1]]
    assert tracesim.hit_ratio("lru", 5, chains) == pytest.approx(1 / 8)
    assert tracesim.hit_ratio("slru", 5, chains) == pytest.approx(2 / 8)


@pytest.mark.parametrize("content, error", [
    ('{"hash_ids": [1, 2]}\nnot json\n', "request 1 is not a JSON object"),
    ('[1, 2]\n', "request 0 has no list of integer hash_ids"),
    ('{"hash_ids": [1, "2"]}\n', "request 0 has no list of integer hash_ids"),
    (None, "cannot read trace"),
])
def test_a_trace_that_is_missing_or_not_in_the_format_is_refused_with_its_line(tmp_path, content, error):
    trace = tmp_path / "trace.jsonl"
    if content is not None:
        trace.write_text(content)
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "tracesim.py"), "--trace", str(trace),
                           "--policies", "lru,s3fifo,slru"], capture_output=True, text=True, timeout=120,
                          cwd=SCRIPTS, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert error in proc.stderr


def test_full_blocks_replays_what_an_engine_stores_and_refuses_a_request_without_a_length(tmp_path):
    """An engine stores only the blocks its prompt fills: 1,100 tokens are two of three ids."""
    reqs = [{"input_length": 1100, "hash_ids": [1, 2, 3]}, {"input_length": 1024, "hash_ids": [1, 2]}]
    assert tracesim.chains_of(reqs) == [[1, 2, 3], [1, 2]]
    assert tracesim.chains_of(reqs, full_blocks=True) == [[1, 2], [1, 2]]
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_length": 1100, "hash_ids": [1, 2, 3]}\n{"input_length": "a lot", "hash_ids": [1]}\n')
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "tracesim.py"), "--trace", str(trace),
                           "--full-blocks"], capture_output=True, text=True, timeout=120, cwd=SCRIPTS,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "request 1 has no integer input_length" in proc.stderr


def test_an_unknown_policy_name_is_refused_without_a_traceback():
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "tracesim.py"), "--trace", os.devnull,
                           "--policies", "lru,s4fifo"], capture_output=True, text=True, timeout=120,
                          cwd=SCRIPTS, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "unknown policy 's4fifo'" in proc.stderr
