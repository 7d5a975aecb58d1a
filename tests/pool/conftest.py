"""Fixtures for the pool tests: uniquely named shm segments, always removed."""

from __future__ import annotations

import os
import secrets

import pytest

from kvtier.pool import unlink_segment

PREFIX = "kvtier-test."


@pytest.fixture
def shm_names():
    """Make names ``kvtier-test.<pid>.<rand>``; every name made is unlinked afterwards."""
    made = []

    def make(pid: int | str | None = None) -> str:
        name = f"{PREFIX}{os.getpid() if pid is None else pid}.{secrets.token_hex(4)}"
        made.append(name)
        return name

    yield make
    for name in made:
        unlink_segment(name)
    leaked = [n for n in made if os.path.exists(f"/dev/shm/{n}")]
    assert not leaked, f"segments left behind: {leaked}"


@pytest.fixture
def shm_name(shm_names):
    return shm_names()
