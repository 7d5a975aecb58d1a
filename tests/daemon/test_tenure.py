"""What each full garbage collection keeps is frozen, and nothing the daemon drops is kept.

``Tenure`` moves the survivors of every full collection to CPython's permanent
generation, so the next full pass walks only what came since (at millions of
blocks a pass walked every entry: 540-650 ms at 2.25M). The risk it takes: a
frozen object that later becomes part of a garbage cycle is never collected.
First the mechanism against CPython's own collector in this process, then a
real daemon that stores, evicts, flushes, writes to disk and loads 200k
blocks from clients that come and go, audited on SIGUSR1: the collector ran
many full passes, each survivor was frozen, no garbage cycle was kept, and
every block loaded has the bytes stored.
"""

from __future__ import annotations

import gc
import re
import signal
import time
import weakref

import pytest

from kvtier.client import KVTierError, Namespace
from kvtier.protocol.errors import ErrorCode
from kvtier.daemon.tenure import FULL_EVERY, Tenure
from kvtier.pool.entry import NATIVE
from tests.helpers import make_kv


class Thing:  # a tracked object with a weakref slot
    pass


@pytest.fixture
def tenure():
    t = Tenure()
    t.install()
    yield t
    t.uninstall()
    gc.unfreeze()  # this test process's objects go back to the collector


def test_a_full_collection_freezes_what_survived_it(tenure):
    before, passes = gc.get_freeze_count(), tenure.full_passes
    alive = [Thing() for _ in range(50_000)]  # (the collector may run a full pass by itself meanwhile)
    gc.collect()
    assert tenure.full_passes > passes
    assert gc.get_freeze_count() >= before + len(alive)
    # The next full pass does not walk them: they are in no generation any more.
    gen2 = {id(o) for o in gc.get_objects(2)}
    assert not any(id(o) in gen2 for o in alive[:1000])
    newer, passes = Thing(), tenure.full_passes
    gc.collect(1)  # young passes are untouched: survivors are promoted, not frozen
    assert tenure.full_passes == passes and any(o is newer for o in gc.get_objects(2))


def test_a_frozen_object_is_still_freed_when_nothing_refers_to_it(tenure):
    x = Thing()
    gone = weakref.ref(x)
    gc.collect()
    del x
    assert gone() is None


def test_the_audit_finds_a_cycle_that_became_garbage_after_it_was_frozen(tenure):
    a, b = Thing(), Thing()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    holder = [a]
    del a, b
    gc.collect()  # the pair is alive (held) and frozen
    holder.clear()  # now a garbage cycle that no full pass will see
    gc.collect()
    assert gone() is not None
    report = tenure.audit()
    assert report["frozen_cycles"] >= 2 and gone() is None
    passes = tenure.full_passes
    tenure.audit()
    assert tenure.installed and tenure.full_passes == passes  # the audit's own passes are not counted


def test_installed_a_full_pass_comes_every_few_young_passes_and_uninstalled_as_before():
    shipped = gc.get_threshold()
    t = Tenure()
    t.install()
    assert gc.get_threshold() == (*shipped[:2], FULL_EVERY)  # a few ms of unfrozen objects per full pass
    t.uninstall()
    assert gc.get_threshold() == shipped


def test_uninstalled_the_collector_is_left_as_cpython_ships_it():
    t = Tenure()
    before = gc.get_freeze_count()
    gc.collect()
    assert t.full_passes == 0 and gc.get_freeze_count() == before
    assert t.stats()["tenure"] is False


NS = [Namespace(f"tenure-{k}", "float16", "flashinfer", 16) for k in range(3)]
SHAPE = (64, 2, 16, 1, 8)  # 64 engine blocks of 512 B
CHAIN = 1000


def chain(tag: str) -> list[bytes]:
    return [f"{tag}/{i}".encode().ljust(16, b".")[:16] for i in range(CHAIN)]


def ids() -> list[int]:
    return [i % SHAPE[0] for i in range(CHAIN)]


def audit(d) -> dict:
    """SIGUSR1, then the audit's log line."""
    seen = d.read_log().count("gc audit:")
    d.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while d.read_log().count("gc audit:") == seen:
        assert time.monotonic() < deadline, d.read_log()[-2000:]
        time.sleep(0.1)
    line = d.read_log().split("gc audit:")[-1].splitlines()[0]
    leaked, frozen = map(int, re.match(r" (\d+) objects in garbage cycles among (\d+) frozen", line).groups())
    return {"leaked": leaked, "frozen": frozen, "line": line.strip()}  # the line names the kinds


@pytest.mark.parametrize("index", ["python", "compiled"])
def test_a_daemon_under_churn_freezes_its_survivors_and_keeps_no_garbage(daemon_factory, tmp_path, index):
    # 48 MiB of RAM for 512-byte blocks (~94k) under 200k stored: RAM evicts, the disk tier
    # writes behind and evicts too; clients come and go; a namespace is flushed.
    if index == "compiled" and not NATIVE:
        pytest.skip("the compiled index (kvtier/pool/_native.c) is not built")
    d = daemon_factory(process=True, pool_size="48MiB", slab_size="4MiB",
                       env={"KVTIER_DISK_PATH": str(tmp_path / "disk"), "KVTIER_DISK_SIZE": "64MiB",
                            "KVTIER_PURE_PYTHON": "1" if index == "python" else "0"})
    assert d.stats()["pool"]["index"] == index
    frozen_at_start = audit(d)["frozen"]  # torch's and the daemon's own objects, before any block
    dst = make_kv(SHAPE, layers=1, seed=4)
    for rnd in range(10):
        # Each engine's memory is another size (a mapping of another size), and asks one
        # thing the daemon refuses: the paths a long-lived daemon takes every day.
        src = make_kv((SHAPE[0] + 8 * rnd, *SHAPE[1:]), layers=1, seed=rnd)
        with d.client(name=f"engine-{rnd}", timeout=60) as c:
            c.register_kv_cache(src, [0], NS[rnd % 3])
            with pytest.raises(KVTierError) as unknown:
                c.flush("no-such-namespace")
            assert unknown.value.code == ErrorCode.UNKNOWN_NAMESPACE
            for k in range(20):
                r = c.store(chain(f"r{rnd}/c{k}"), ids()).wait()
                assert r.ok, r
            assert c.lookup(chain(f"r{rnd}/c19")) == CHAIN
        if rnd == 5:
            with d.client(name="operator", timeout=120) as op:
                assert op.flush(NS[0]) > 0
    s = d.stats()["gc"]
    report = audit(d)
    assert report["leaked"] == 0, report
    blocks = d.stats()["pool"]["blocks"]
    grew = report["frozen"] - frozen_at_start
    if index == "python":
        assert s["tenure"] is True and s["full_passes"] >= 3, s
        assert grew >= blocks // 2, (report, frozen_at_start, blocks)  # the blocks' entries, less the newest (not frozen yet)
    else:  # a compiled entry is not the collector's at all: what it froze is not per block
        assert s["tenure"] is True and blocks > 50_000, (s, blocks)
        assert grew < blocks // 4, (report, frozen_at_start, blocks)
    # And the data: the last chains load byte for byte.
    with d.client(name="reader", timeout=60) as r:
        r.register_kv_cache(dst, [0], NS[9 % 3])
        got = r.load(chain("r9/c19")[:64], list(range(64))).wait()
        assert got.ok and got.done == 64, got
        assert dst.tensors[0].equal(src.tensors[0][:SHAPE[0]])


def test_gc_freeze_off_leaves_the_collector_alone(daemon_factory):
    d = daemon_factory(process=True, env={"KVTIER_GC_FREEZE": "false"})
    s = d.stats()["gc"]
    assert s["tenure"] is False and s["full_passes"] == 0
    assert audit(d)["frozen"] > 0  # start-up's freeze stays


def test_only_the_daemons_own_user_can_ask_for_an_audit_and_a_burst_runs_few(daemon_factory):
    # An audit holds the loop for a full pass: the kernel lets only the daemon's user
    # (and root) signal it, and a burst of signals is one pending request, not one each.
    from tests.daemon.test_operator_surfaces import as_user
    d = daemon_factory(process=True)
    pid = d.proc.pid
    got = as_user(41031, 41031, f"try:\n    os.kill({pid}, {int(signal.SIGUSR1)}); print('sent')\n"
                                f"except PermissionError as e:\n    print('refused', e.errno)")
    assert got == "refused 1"  # EPERM
    time.sleep(0.5)
    assert "gc audit:" not in d.read_log()
    for _ in range(50):
        d.proc.send_signal(signal.SIGUSR1)
    audit(d)
    time.sleep(1.0)
    assert 1 <= d.read_log().count("gc audit:") <= 5
    assert d.stats()["gc"]["tenure"] is True  # and it serves on
