"""A real Redis Cluster per test module; a missing server or client fails, never skips."""

from __future__ import annotations

import pytest

from tests.remote.cluster import LocalCluster, why_missing


def running_cluster():
    """A fresh three-master cluster for the duration of the fixture."""
    why = why_missing()
    if why:
        pytest.fail(f"the remote-tier tests need a Redis Cluster: {why}", pytrace=False)
    c = LocalCluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster()
