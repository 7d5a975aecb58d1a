"""tenant_share: one local user storing without end cannot evict another's cache.

Real daemon, real other Unix users (the workers drop to numeric uids). The
pool holds 64 blocks (1 MiB of 16 KiB blocks); the owner stores 24, then the
flooder stores 300 new ones, 30 per store. With ``tenant_share = 0.5`` the
flooder is held to 32 blocks and evicts only its own oldest; with the share
off, the old global LRU hands it the owner's blocks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO, DaemonProc
from tests.daemon.share_worker import FLOOD_BLOCKS, FLOOD_ROUNDS, OWNER_BLOCKS
from tests.daemon.test_reaping import wait_for
from tests.daemon.test_tenants import lines

WORKER = os.path.join(REPO, "tests", "daemon", "share_worker.py")
OWNER, FLOODER = 41021, 41022
BLOCK = 16 * 1024  # tests.helpers: one hash stores 16 KiB
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenants are other Unix users: needs root")


@pytest.fixture
def daemon_with_share(tmp_path, request):
    run = tempfile.mkdtemp(prefix="kvt-share-")
    os.chmod(run, 0o755)
    env = {"KVTIER_SOCKET_MODE": "666", "KVTIER_TENANT_SHARE": str(request.param)}
    d = DaemonProc(tmp_path, pool_size="1MiB", slab_size="256KiB", env=env, socket=os.path.join(run, "kvtier.sock"))
    yield d
    d.stop()
    shutil.rmtree(run, ignore_errors=True)


def run_as(role: str, socket: str, uid: int) -> dict:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    p = subprocess.Popen([sys.executable, WORKER, role, socket, str(uid)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    return next(iter(lines(p).values()))


@pytest.mark.parametrize("daemon_with_share", [0.5], indirect=True)
def test_a_flooding_tenant_evicts_only_its_own_blocks(daemon_with_share):
    """The flooder's every store succeeds (it evicts its own oldest); the owner's
    24 blocks all still hit afterwards and load byte for byte; status shows the
    flooder at its share and the daemon logged it once."""
    d = daemon_with_share
    stored = run_as("owner", d.socket, OWNER)
    assert stored["done"] == OWNER_BLOCKS
    flooded = run_as("flood", d.socket, FLOODER)
    assert flooded["kept"] == [FLOOD_BLOCKS] * FLOOD_ROUNDS
    assert flooded["last_hits"] == FLOOD_BLOCKS  # its newest blocks are the ones it kept
    assert flooded["sees_tenants"] == [f"uid{FLOODER}"]  # not who else uses the pool, nor how much
    read = run_as("reader", d.socket, OWNER)
    assert (read["hits"], read["loaded"], read["digest"]) == (OWNER_BLOCKS, OWNER_BLOCKS, stored["digest"])
    t = d.stats()["tenants"]
    assert t["share"] == 0.5 and t["limit_bytes"] == 2**19
    flooder = t["tenants"][f"uid{FLOODER}"]
    assert flooder["bytes"] <= t["limit_bytes"] and flooder["at_share"] > 0
    assert flooder["own_evictions"] == FLOOD_BLOCKS * FLOOD_ROUNDS - flooder["bytes"] // BLOCK
    assert t["tenants"][f"uid{OWNER}"]["bytes"] == 2 * 256 * 1024  # 24 blocks: charged 2 whole slabs
    assert d.read_log().count("is at its pool share") == 1  # rate-limited: 9 stores, one line


@pytest.mark.parametrize("daemon_with_share", [1.0], indirect=True)
def test_with_the_share_off_the_flood_evicts_the_other_tenant_as_before(daemon_with_share):
    d = daemon_with_share
    stored = run_as("owner", d.socket, OWNER)
    assert stored["done"] == OWNER_BLOCKS
    assert run_as("flood", d.socket, FLOODER)["kept"] == [FLOOD_BLOCKS] * FLOOD_ROUNDS
    assert run_as("reader", d.socket, OWNER)["hits"] < OWNER_BLOCKS
    t = d.stats()["tenants"]
    assert t["share"] == 1.0 and t["tenants"][f"uid{FLOODER}"]["at_share"] == 0


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_the_disk_tier_keeps_another_tenants_files_through_a_flood(tmp_path, share):
    """The same flood with a 2 MiB disk tier (102 files of 20 KiB): every block
    stored is written behind. After a restart the RAM pool is empty, so the
    owner's blocks come from disk only: with the share all 24 hit and load byte
    for byte (the flooder dropped only its own files); off, the flood dropped them."""
    run = tempfile.mkdtemp(prefix="kvt-share-disk-")
    os.chmod(run, 0o755)
    env = {"KVTIER_SOCKET_MODE": "666", "KVTIER_TENANT_SHARE": str(share),
           "KVTIER_DISK_PATH": str(tmp_path / "disk"), "KVTIER_DISK_SIZE": "2MiB"}
    sock = os.path.join(run, "kvtier.sock")

    def start():
        return DaemonProc(tmp_path, pool_size="1MiB", slab_size="256KiB", env=env, socket=sock)
    try:
        d = start()
        stored = run_as("owner", sock, OWNER)
        assert stored["done"] == OWNER_BLOCKS
        run_as("flood", sock, FLOODER)
        disk = d.stats()["disk"]
        d.stop()
        d = start()
        assert wait_for(lambda: not d.stats()["disk"]["scanning"], 20)
        read = run_as("reader", sock, OWNER)
        d.stop()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert disk["written"] > 100  # the flood reached the disk: more than it holds
    if share < 1:
        assert disk["tenant_limit_bytes"] == 2**20 and disk["own_dropped"][f"uid{FLOODER}"] > 0
        assert f"uid{OWNER}" not in disk["own_dropped"]
        assert (read["hits"], read["loaded"], read["digest"]) == (OWNER_BLOCKS, OWNER_BLOCKS, stored["digest"])
    else:
        assert read["hits"] < OWNER_BLOCKS
