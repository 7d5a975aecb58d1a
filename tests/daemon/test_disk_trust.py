"""The disk tier against a hung disk, a namespace cycler and a tenant that keeps
the disk busy (issue 30, rows 6, 8, 9): a load waiting on another load's hung
read obeys the disk deadline and counts toward its user's transfer cap; a
tenant's namespaces are bounded in every tier and leave no empty directory
behind; and a committed block is never dropped because another tenant filled
the write-behind queue. Real daemons, a real disk directory, a FIFO standing
in for a hung disk file, real other uids."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from tests.daemon.test_disk_attacks import file_of, needs_root, restarted, store_to_disk
from tests.daemon.test_disk_tier import chain, disk_env
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv


def hang(root, key: bytes) -> str:
    """The block's file becomes a FIFO: opening it blocks until a writer comes (a read stuck in the kernel)."""
    fifo = file_of(root, key)
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    return fifo


def answer(fifo: str) -> None:
    """The hung disk answers at last."""
    threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()


# ---- row 6: loads waiting on a hung read ------------------------------------------------------
@needs_root
def test_a_load_joining_a_hung_read_is_answered_at_the_disk_deadline_not_the_clients(daemon_factory, tmp_path):
    """The first load of a hung block is answered at ``disk_timeout_s``; a second
    load of the same block, arriving after that deadline, must not wait on the
    hung read until the client gives up (before: the client's 8 s transfer
    timeout cancelled it): it is answered by the daemon, those blocks failed."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=0.5)
    kv = make_kv(seed=61)
    hs = chain(61, 4)
    d0 = daemon_factory(env=env)
    store_to_disk(d0, kv, hs)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = hang(root, hs[0])
    with d.client(name="engine", transfer_timeout=8.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        first = c.load(hs, list(range(4))).wait()
        assert sorted(first.failed) == [0, 1, 2, 3] and first.error == ""  # the daemon's answer
        began = time.monotonic()
        second = c.load(hs, list(range(4, 8))).wait()
        assert sorted(second.failed) == [0, 1, 2, 3]
        s = d.stats()["disk"]
        print(f"\nsecond load answered after {time.monotonic() - began:.2f}s, fail_fast {s['fail_fast']}")
        # Failed by the daemon as blocks behind a stuck read (before: held until the client cancelled it).
        assert s["fail_fast"] == 4
        assert s["loads_waiting"] == 0 and s["reads_in_flight"] == 1
        answer(fifo)
        assert wait_for(lambda: d.stats()["disk"]["reads_in_flight"] == 0)


@needs_root
def test_loads_waiting_on_a_hung_read_count_toward_the_users_transfer_cap(daemon_factory, tmp_path):
    """``max_transfers_per_user`` 4, and 200 loads of a block whose read hangs
    (its deadline far away): before, all 200 sat in the daemon (loads waiting
    for a disk read were not counted); now 4 wait, the other 196 are refused
    ``OVER_LIMIT`` at once, and once the disk answers the user's cap is free again."""
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=60, max_transfers_per_user=4)
    kv = make_kv(seed=62)
    hs, other = chain(62, 4), chain(63, 4)
    d0 = daemon_factory(env=env)
    store_to_disk(d0, kv, hs + other)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = hang(root, hs[0])
    with d.client(name="engine", transfer_timeout=120.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        handles = [c.load(hs, list(range(4))) for _ in range(200)]
        wait_for(lambda: sum(h.done() for h in handles) >= 196, 10)
        refused = [h for h in handles if h.done()]
        waiting = d.stats()["disk"]["loads_waiting"]
        print(f"\nloads waiting on the hung read: {waiting} of 200 (cap 4); refused at once: {len(refused)}")
        assert waiting == 4 and len(refused) == 196
        assert all("max_transfers_per_user" in h.wait().error for h in refused)  # OVER_LIMIT
        answer(fifo)
        rest = [h.wait() for h in handles if h not in refused]
        assert len(rest) == 4 and all(sorted(r.failed) == [0] for r in rest)  # the FIFO's block fails, the other three load
        assert c.load(other, list(range(4, 8))).wait().ok  # the user's cap is free again


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
