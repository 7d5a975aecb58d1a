"""tenant_share holds against the ways round three found around it (issue 30, rows 1-3).

Real daemon as root, socket 0666, 64 MiB pool of 4 MiB slabs, ``tenant_share
= 0.5``; the victim and the attacker are other Unix users
(``share_attack_worker.py`` drops to their uids). The victim holds 256 blocks
of 64 KiB (4 slabs): well inside the half of the pool the attacker's share
leaves it, so nothing the attacker does may take one of them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import warm_names
from kvtier.pool.segment import unlink_segment
from tests.conftest import REPO, DaemonProc
from tests.daemon.share_attack_worker import SMALL_BLOCKS, TINY_BLOCKS, VICTIM_BLOCKS
from tests.daemon.test_tenants import lines

WORKER = os.path.join(REPO, "tests", "daemon", "share_attack_worker.py")
VICTIM, ATTACKER = 41031, 41032
SLAB = 4 * 2**20
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenants are other Unix users: needs root")


@pytest.fixture
def shared_socket():
    run = tempfile.mkdtemp(prefix="kvt-share-attack-")
    os.chmod(run, 0o755)  # other users reach the socket; its mode is 0666
    yield os.path.join(run, "kvtier.sock")
    shutil.rmtree(run, ignore_errors=True)


def start(tmp_path, socket: str, **env) -> DaemonProc:
    env = {"KVTIER_SOCKET_MODE": "666", "KVTIER_TENANT_SHARE": "0.5", **env}
    return DaemonProc(tmp_path, pool_size="64MiB", slab_size="4MiB", env=env, socket=socket)


def run_as(role: str, socket: str, uid: int) -> dict:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    p = subprocess.Popen([sys.executable, WORKER, role, socket, str(uid)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    return next(iter(lines(p).values()))


@pytest.fixture
def victim_daemon(tmp_path, shared_socket):
    """A daemon whose pool holds the victim's 256 blocks (all hit), and their digest."""
    d = start(tmp_path, shared_socket)
    stored = run_as("victim", shared_socket, VICTIM)
    assert (stored["done"], stored["hits"]) == (VICTIM_BLOCKS, VICTIM_BLOCKS)
    yield d, stored
    d.stop()


def assert_victim_untouched(d: DaemonProc, stored: dict) -> None:
    read = run_as("victim-read", d.socket, VICTIM)
    print(f"victim after the attack: {read['hits']}/{VICTIM_BLOCKS} hits")
    assert (read["hits"], read["loaded"], read["digest"]) == (VICTIM_BLOCKS, VICTIM_BLOCKS, stored["digest"])
    d.stats()  # the integrity check passes


def test_sixteen_size_classes_are_charged_the_sixteen_slabs_they_take(victim_daemon):
    """Row 1: one block in each of 16 block sizes used to cost 34,816 B of a
    32 MiB share while taking every slab (victim 256 -> 0 hits). A tenant's
    sizes now live in its own slabs and it is charged for them whole: it gets
    at most 8 slabs (the later sizes evict its own earlier ones) and the
    victim keeps every block."""
    d, stored = victim_daemon
    attack = run_as("classes", d.socket, ATTACKER)
    print(f"16 classes: stored {attack['done']}, charged {attack['charged']} B")
    assert attack["done"] == [1] * 16 and attack["charged"] <= 8 * SLAB
    assert_victim_untouched(d, stored)
    t = d.stats()["tenants"]["tenants"][f"uid{ATTACKER}"]
    assert t["bytes"] == 8 * SLAB and t["own_evictions"] == 8


def test_blocks_a_little_over_half_a_slab_are_charged_a_slab_each(victim_daemon):
    """Row 1, second form: 15 blocks of 2 MiB + 256 B fit a 32 MiB share by slot
    bytes yet take 15 of 16 slabs (victim 256 -> 64). Charged a slab each, the
    attacker keeps 8 of them."""
    d, stored = victim_daemon
    attack = run_as("big", d.socket, ATTACKER)
    print(f"big blocks: stored {attack['done']}, charged {attack['charged']} B")
    assert_victim_untouched(d, stored)
    assert attack["charged"] == 8 * SLAB


def test_swap_counts_against_the_tenants_share(victim_daemon):
    """Row 2: at its share, the attacker offloads as many bytes again as swap.
    Swap used to allocate by global eviction (victim 256 -> 0); now it is the
    tenant's like any block: its own prefix blocks make room, the victim's never."""
    d, stored = victim_daemon
    attack = run_as("swap", d.socket, ATTACKER)
    print(f"swap: stored {attack['stored']}, offloaded {attack['offloaded']}, charged {attack['charged']} B")
    assert attack["stored"] == 512 and attack["charged"] <= 8 * SLAB
    assert_victim_untouched(d, stored)


def test_the_warm_restart_journal_keeps_the_victims_blocks(tmp_path, shared_socket):
    """Row 3: blocks of 256 B as many as the journal has records (4,096 when it had
    one per 16 KiB of pool, 16,384 now: 4 MiB, one slab) used to take every record,
    so the victim's 16 blocks were not kept: after SIGTERM the attacker hit all of its
    blocks, the victim 0/16. A tenant now holds at most its share of the records
    (half): the victim's blocks come back."""
    names = warm_names(DaemonConfig(socket=shared_socket))
    warm = {"KVTIER_WARM_RESTART": "1"}
    try:
        d = start(tmp_path, shared_socket, **warm)
        assert run_as("tiny", shared_socket, ATTACKER)["done"] == TINY_BLOCKS
        assert run_as("small", shared_socket, VICTIM)["done"] == SMALL_BLOCKS
        kept = d.stats()["warm_restart"]
        d.stop(signal.SIGTERM)
        d = start(tmp_path, shared_socket, **warm)
        try:
            victim_hits = run_as("small-read", shared_socket, VICTIM)["hits"]
            attacker_hits = run_as("tiny-read", shared_socket, ATTACKER)["hits"]
            w = d.stats()["warm_restart"]
        finally:
            d.stop()
    finally:
        for name in names:
            unlink_segment(name)
    print(f"journal: kept {kept['kept_blocks']}, not kept {kept['not_kept']}; after restart "
          f"victim {victim_hits}/{SMALL_BLOCKS}, attacker {attacker_hits}/{TINY_BLOCKS}")
    assert w["start"] == "warm" and kept["not_kept"] == TINY_BLOCKS // 2
    assert victim_hits == SMALL_BLOCKS
    assert attacker_hits == TINY_BLOCKS // 2  # its share of the 16,384 records
