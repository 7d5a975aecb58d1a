"""The disk tier under the remote tier: one node's engine finds the first part
of a prefix on its own disk and the rest in the cluster, with one lookup and
one load, byte for byte. Real Redis Cluster, real daemons, real files."""

from __future__ import annotations

from kvtier.client import block_hashes
from tests.daemon.test_disk_tier import disk_env, scanned, written
from tests.remote.test_two_nodes import (TOKENS, _secret_file, lookup_and_load, node, remote_stats,  # noqa: F401
                                         store_prefix, wait_remote)


def test_a_prefix_half_on_this_nodes_disk_half_in_the_cluster_loads_in_one_go(daemon_factory, cluster,
                                                                                tmp_path):
    tokens = [t + 300_000 for t in TOKENS]
    a = node(daemon_factory, cluster.url)
    expected = store_prefix(a, tokens, seed=5)  # all 12 blocks, written behind to the cluster
    wait_remote(a, "written", 12)
    disk = disk_env(tmp_path / "disk", "16MiB")
    b = node(daemon_factory, cluster.url, env=disk)
    assert store_prefix(b, tokens[:16 * 6], seed=5, ids=range(3, 9)) == expected[:6 * 4]  # the same 6 blocks
    assert written(b, 6)
    b.stop()
    b = node(daemon_factory, cluster.url, env=disk)  # RAM empty: 6 blocks on disk, 6 more only in the cluster
    assert scanned(b)

    hits, result, got = lookup_and_load(b, tokens)
    assert hits == 12 and result.ok and result.done == 12
    assert got == expected
    s = b.stats()
    assert s["disk"]["read"] == 6 and remote_stats(b)["fetched"] == 6
    assert s["namespaces"][0]["disk_hits"] == 6
    assert len(block_hashes(tokens, 16)) == 12
