"""A real Redis Cluster per test module; a missing server or client fails, never skips."""

from __future__ import annotations

import os

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


SECRET = bytes(range(32))  # every node of one cluster holds the same secret


def write_secret(path, key: bytes = SECRET, mode: int = 0o600, extra: str = "") -> str:
    """A secret file as an operator makes one: TOML, the daemon's user alone may read it."""
    path = str(path)
    with open(path, "w") as f:
        f.write(f'key = "{key.hex()}"\n{extra}')
    os.chmod(path, mode)
    return path


@pytest.fixture
def secret_file(tmp_path):
    return write_secret(tmp_path / "remote.secret")
