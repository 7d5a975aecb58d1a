"""A new pool serves once its first GiB is in, the rest faulting in behind it
(``prefault = "background"``, the default): a 2 TB pool takes minutes to fault in, and
no engine should wait for that. What must hold: status adds up at every moment (the
slabs not in yet are ``faulting_bytes``, never free), every slab is the pool's once
its pages are in, and ``prefault = "start"`` (or a pool kept for warm restart) is
whole before the first answer, as before."""

from __future__ import annotations

import time

from tests.daemon.test_capacity import BLOCK, fill
from tests.daemon.test_warm_restart import warm  # noqa: F401 (the fixture: kept segments removed after)

GIB = 1 << 30


def pool_of(d) -> dict:
    p = d.stats(check=True)["pool"]
    assert p["used_bytes"] + p["free_bytes"] + p["waste_bytes"] + p["faulting_bytes"] == p["capacity_bytes"]
    return p


def test_a_two_gib_pool_answers_from_its_first_gib_and_takes_the_rest_as_it_comes_in(daemon_factory):
    d = daemon_factory(pool_size="2GiB", slab_size="64MiB")
    fill(d, 1)  # a registered size: status counts its room
    faulting = [pool_of(d)["faulting_bytes"]]
    assert 0 <= faulting[0] <= GIB and faulting[0] % (64 << 20) == 0  # at most what is past the first GiB
    deadline = time.monotonic() + 120
    while faulting[-1] and time.monotonic() < deadline:
        time.sleep(0.05)
        faulting.append(pool_of(d)["faulting_bytes"])
    assert faulting[-1] == 0 and faulting == sorted(faulting, reverse=True)  # only ever more of it in
    p = pool_of(d)
    assert p["sizes"][0]["free_blocks"] == 2 * GIB // BLOCK - 1  # every slab usable: all but the block held
    assert "pool faulted in: 2.00 GiB, the last 1.00 GiB in" in d.read_log()


def test_prefault_start_has_the_whole_pool_in_before_the_first_answer(daemon_factory):
    d = daemon_factory(pool_size="2GiB", slab_size="64MiB", env={"KVTIER_PREFAULT": "start"})
    assert pool_of(d)["faulting_bytes"] == 0
    fill(d, 1)
    assert pool_of(d)["sizes"][0]["free_blocks"] == 2 * GIB // BLOCK - 1
    assert "pool faulted in" not in d.read_log()


def test_a_pool_kept_for_warm_restart_is_whole_before_the_first_answer(warm):
    """The next daemon adopts it as it is and copies into any slab of it at once."""
    d = warm(pool_size="2GiB", slab_size="64MiB")
    assert pool_of(d)["faulting_bytes"] == 0
