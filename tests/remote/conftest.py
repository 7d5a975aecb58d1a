"""A real Redis Cluster per test module; a missing server or client fails, never skips."""

from __future__ import annotations

import pytest

from tests.remote.cluster import LocalCluster, why_missing


@pytest.fixture(scope="module")
def cluster():
    why = why_missing()
    if why:
        pytest.fail(f"the remote-tier tests need a Redis Cluster: {why}", pytrace=False)
    c = LocalCluster()
    yield c
    c.close()
