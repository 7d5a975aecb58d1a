"""Issue 21's smaller bounds, each against a real daemon: a request that
repeats itself is refused, a client cannot lift the operator's swap cap by
asking for 0, and lookup mirrors go with their namespace and fit a budget.

The cross-user floods (descriptors, transfers, hand-overs, 1M-hash lookups)
are in ``test_floods.py``."""

from __future__ import annotations

import glob
import os

import pytest

from kvtier.client import KVTierError
from kvtier.client.handover import hand_over
from kvtier.protocol import ErrorCode, pack_hashes, pack_ids
from kvtier.protocol import messages as m
from tests.daemon.test_attacks import serves_a_good_client
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

MiB = 2**20


def test_a_load_that_repeats_a_hash_or_writes_a_block_twice_is_refused(daemon):
    """One load used to name one hash and one block 65,536 times (each a pin
    and a copy): a repeated hash in a store or load, or a block a load would
    write twice, is refused before anything is pinned."""
    kv = make_kv(seed=4)
    h = [os.urandom(16) for _ in range(4)]
    with daemon.client(name="repeater") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        reg = c.registration.reg
        assert c.store(h, [0, 1, 2, 3]).wait().ok
        cases = {"load, one hash 4096 times": m.Load(reg, pack_hashes(h[:1] * 4096), pack_ids([0] * 4096)),
                 "load, one block twice": m.Load(reg, pack_hashes(h[:2]), pack_ids([5, 5])),
                 "store, one hash twice": m.Store(reg, pack_hashes([h[0], h[0]]), pack_ids([0, 1]))}
        for what, msg in cases.items():
            with pytest.raises(KVTierError) as exc:
                c.channel.call(msg)
            assert exc.value.code == ErrorCode.BAD_ARGUMENT, what
            assert "twice" in exc.value.message, what
        assert daemon.stats()["namespaces"][0]["blocks"] == 4  # nothing pinned or dropped
    kv.close()
    assert serves_a_good_client(daemon)


def test_a_swap_quota_of_zero_means_no_swap_not_no_cap(daemon_factory):
    """A client asking for quota 0 used to get no cap at all, past the
    operator's ``swap_quota``. Now 0 is 0 bytes: its offload is refused, and
    with the operator's cap it never gets more than that cap."""
    d = daemon_factory(env={"KVTIER_SWAP_QUOTA": "64KiB"})
    kv = make_kv(seed=6)
    with d.client(name="zero") as c:
        c.register_kv_cache(kv, [0] * 4, NS, swap_quota=0)
        assert [r["swap_quota"] for r in d.stats()["clients"] if r["name"] == "zero"] == [0]
        res = c.offload({"r1": [0, 1]}).wait()
        assert res.failed_requests == ("r1",) and res.no_space
    with d.client(name="default") as c:  # no quota asked: the operator's cap
        c.register_kv_cache(kv, [0] * 4, NS)
        big = c.offload({"r2": list(range(8))}).wait()  # 8 x 16 KiB = 128 KiB > 64 KiB
        assert big.failed_requests == ("r2",)
        assert c.offload({"r3": [0, 1, 2, 3]}).wait().ok  # 64 KiB fits exactly
        assert d.stats()["swap"]["bytes"] == 64 * 1024
    kv.close()


def mirror_files(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvtier-ix.{pid}.*")


def test_lookup_mirrors_go_with_their_namespace_and_stay_within_their_budget(daemon_factory):
    """Register/close cycles in new namespaces of 64-byte blocks used to leave
    a 68 MiB table in /dev/shm each. Now a forgotten namespace takes its
    table with it, and all tables together stay within lookup_index_share
    of the pool."""
    d = daemon_factory(process=True, pool_size="64MiB", slab_size="4MiB",
                       env={"KVTIER_LOOKUP_INDEX": "true", "KVTIER_MAX_NAMESPACES_PER_USER": "64"})
    budget = 64 * MiB // 16
    kv = make_kv(shape=(64, 32), layers=1, seed=1)  # 64-byte blocks
    sizes = []
    with d.client(name="cycler") as c:
        for i in range(12):
            c.register_kv_cache(kv, [0], f"tiny-{i}")
            sizes.append(sum(os.path.getsize(f) for f in mirror_files(d.proc.pid)))
            c.channel.call(m.Unregister(c.registration.reg))
        assert wait_for(lambda: not mirror_files(d.proc.pid), 10)
        print(f"\n12 register/close cycles, 64-byte blocks: /dev/shm mirror bytes peaked at "
              f"{max(sizes) / MiB:.2f} MiB (budget {budget / MiB:.0f} MiB), 0 after")
        assert max(sizes) <= budget
        s = d.stats()["lookup_index"]
        assert s["enabled"] and s["tables"] == 0 and s["bytes"] == 0
    kv.close()
    assert serves_a_good_client(d)


def test_a_mapping_cap_the_kernel_cannot_hold_is_refused_at_start(tmp_path):
    """Past vm.max_map_count every mmap fails, torch's and Python's too: the
    daemon refuses to start when max_mappings plus its own would not fit."""
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.guard import map_headroom
    limit = tmp_path / "max_map_count"
    limit.write_text("65530\n")  # the kernel's default
    assert map_headroom(DaemonConfig(socket=str(tmp_path / "s")), str(limit)) == 65530
    with pytest.raises(ValueError, match="vm.max_map_count"):
        map_headroom(DaemonConfig(socket=str(tmp_path / "s"), max_mappings=60000), str(limit))


def test_the_shipped_unit_and_the_kernel_default_hold_every_cap_at_once():
    """With every per-user and total cap reached (the shipped config, mirrors
    on), the daemon's descriptors fit the unit's LimitNOFILE and its mappings
    the kernel's default vm.max_map_count."""
    import re
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.guard import fd_need, map_need
    from tests.conftest import REPO
    with open(os.path.join(REPO, "daemon", "kvtier-daemon.service")) as f:
        nofile = int(re.search(r"^LimitNOFILE=(\d+)", f.read(), re.M).group(1))
    config = DaemonConfig(socket="/run/kvtier/kvtier.sock", lookup_index=True)
    print(f"\nall caps reached: {fd_need(config)} descriptors (LimitNOFILE {nofile}), "
          f"{map_need(config)} mappings (vm.max_map_count 65530)")
    assert fd_need(config) < nofile and map_need(config) < 65530
