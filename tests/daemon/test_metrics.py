"""Prometheus metrics: scrape a real daemon over HTTP after real traffic."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvtier.client import block_hashes
from kvtier.daemon.latency import LatencyHistograms
from tests.conftest import REPO
from tests.helpers import NS, make_kv, pool_segments

BLOCK = 16 * 1024  # tests.helpers geometry: 16 KiB per block across all layers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} for every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape_until(port, ok, timeout=5.0) -> dict:
    """The snapshot refreshes every 0.5 s: poll until it shows what we did."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_metrics_reflect_traffic(daemon_factory):
    port = free_port()
    d = daemon_factory(extra=["--metrics", f"127.0.0.1:{port}"])
    ns = {("namespace", NS.fingerprint()), ("tenant", f"uid{os.getuid()}")}
    kv = make_kv(seed=3)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        hashes = block_hashes(list(range(16 * 12)), 16)
        # 12 blocks in, a lookup that hits 12 and misses 1, 4 blocks out,
        # and one bad request (engine block 999 does not exist).
        assert c.store(hashes, list(range(12))).wait().done == 12
        assert c.lookup(block_hashes(list(range(16 * 13)), 16)) == 12
        assert c.load(hashes[:4], list(range(20, 24))).wait().done == 4
        assert not c.load(hashes[:1], [999]).wait().ok

        bad_arg = ("kvtier_errors_total", frozenset({("code", "BAD_ARGUMENT")}))
        m = scrape_until(port, lambda m: m.get(bad_arg))
        g = lambda name, *labels: m[(name, frozenset(labels))]  # noqa: E731
        assert g("kvtier_pool_capacity_bytes") == 64 * 2**20
        assert g("kvtier_pool_used_bytes") == 12 * BLOCK
        assert g("kvtier_pool_free_bytes") == 64 * 2**20 - 12 * BLOCK
        assert g("kvtier_pool_blocks") == 12
        assert g("kvtier_clients") == 1
        assert g("kvtier_namespace_blocks", *ns) == 12
        assert g("kvtier_namespace_bytes", *ns) == 12 * BLOCK
        assert g("kvtier_lookups_total", *ns) == 1
        assert g("kvtier_hits_total", *ns) == 12
        assert g("kvtier_misses_total", *ns) == 1
        assert g("kvtier_blocks_stored_total", *ns) == 12
        assert g("kvtier_blocks_loaded_total", *ns) == 4
        assert g("kvtier_stores_total") == 1 and g("kvtier_loads_total") == 1
        assert g("kvtier_transfer_bytes_total", ("op", "store")) == 12 * BLOCK
        assert g("kvtier_transfer_bytes_total", ("op", "load")) == 4 * BLOCK
        assert g("kvtier_errors_total", ("code", "BAD_ARGUMENT")) == 1
        assert g("kvtier_swap_bytes") == 0
        tenant = ("tenant", f"uid{os.getuid()}")
        assert g("kvtier_tenant_bytes", tenant) == 12 * BLOCK and g("kvtier_tenant_share") == 1.0
        assert g("kvtier_tenant_at_share_total", tenant) == 0

        # One store and one load, each timed from request to copy completion.
        for op in ("store", "load"):
            assert g("kvtier_transfer_seconds_count", ("op", op)) == 1
            assert 0 < g("kvtier_transfer_seconds_sum", ("op", op)) < 5
            assert g("kvtier_transfer_seconds_bucket", ("op", op), ("le", "+Inf")) == 1
        assert ("process_resident_memory_bytes", frozenset()) in m

        # A swapped-out request of 3 engine blocks holds 3 pool blocks.
        assert c.offload("req-1", [0, 1, 2]).wait().ok
        m = scrape_until(port, lambda m: m[("kvtier_swap_bytes", frozenset())] > 0)
        assert m[("kvtier_swap_bytes", frozenset())] == 3 * BLOCK
    kv.close()

    # The engine said BYE: the gauge follows within a snapshot period.
    m = scrape_until(port, lambda m: m[("kvtier_clients", frozenset())] == 0)
    assert m[("kvtier_clients", frozenset())] == 0


def test_metrics_port_in_use_fails_startup_cleanly(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sock = str(tmp_path / "kvt.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.daemon", "--socket", sock, "--pool-size", "64MiB",
             "--slab-size", "4MiB", "--metrics", f"127.0.0.1:{port}"],
            env={**os.environ, "PYTHONPATH": REPO}, stderr=subprocess.PIPE, text=True)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"metrics 127.0.0.1:{port}" in stderr
    # The half-started daemon unmapped its pool and removed its socket.
    assert not pool_segments(proc.pid)
    assert not os.path.exists(sock)


def test_latency_buckets_are_cumulative_and_inclusive():
    h = LatencyHistograms(bounds=(0.001, 0.01))
    for seconds in (0.001, 0.005, 0.02, 0.0001):
        h.observe("load", seconds)
    snap = h.snapshot()["load"]
    assert snap["cumulative"] == [2, 3]          # 0.0001 and 0.001 (le is inclusive), then 0.005
    assert snap["count"] == 4                    # 0.02 only in +Inf
    assert abs(snap["sum_s"] - 0.0261) < 1e-12
