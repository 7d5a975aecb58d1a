"""A warm restart hands its adopted blocks to the disk tier, in process (no sockets, a real
directory and real I/O threads): the blocks the start-up scan finds on disk are left as they
are, the rest are written after the scan, ``ADOPT_BATCH`` at a time, byte-exact, and one
that left RAM before the scan ended is counted ``evicted``: on disk + written + not written
== adopted. A flush before the scan ends takes its blocks out uncounted, by policy."""

from __future__ import annotations

import mmap
import os
import select

from kvtier.daemon.config import DaemonConfig
from kvtier.disk import bridge as disk_bridge
from kvtier.disk.format import HEADER_BYTES, decode_header
from kvtier.disk.setup import open_disk
from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.keys import ns_key
from tests.daemon.test_disk_tier import block_files
from tests.pool.kit import chain

BLOCK = 16 * 1024
POOL = 4 * 2**20
NS_KEY = ns_key("team", "model|float16|flashinfer|bs16|tp0of1")


def config(root) -> DaemonConfig:
    return DaemonConfig(pool_size=POOL, slab_size=2**20, disk_path=str(root), disk_size=64 * 2**20)


def turns(bridge, until) -> int:
    """Run the daemon's loop for the disk tier (its wakeup fd, then ``poll``) until ``until()``;
    the loop turns it took."""
    n = 0
    while not until():
        select.select([bridge.wakeup_fd], [], [], 5.0)
        bridge.poll()
        n += 1
        assert n < 10_000, bridge.stats()
    return n


def idle(bridge) -> bool:
    s = bridge.stats()
    return not (s["scanning"] or s["warm_waiting"] or s["backlog_blocks"] or s["queued_bytes"])


def first_daemon_writes(root, pool, keys) -> None:
    """The daemon before the restart: stores ``keys`` and writes them to disk, then stops."""
    index = BlockIndex(SlabAllocator(POOL, 2**20))
    bridge = open_disk(config(root), pool, index, None)
    ns = index.namespace(NS_KEY, BLOCK)
    plan = index.prepare_store(ns, keys)
    for e in plan.entries:
        pool[e.offset:e.offset + BLOCK] = os.urandom(BLOCK)
    index.complete_store(plan, ())
    bridge.committed(plan)
    turns(bridge, lambda: idle(bridge))
    assert bridge.stats()["written"] == len(keys)
    bridge.close()


def adopt(index, keys, offsets) -> list:
    """What warm.adopt does with the journal's records: READY entries at their old offsets."""
    ns = index.namespace(NS_KEY, BLOCK)
    entries = index.adopt(ns, list(zip(keys, offsets)), enter=False)
    index.enter_in_order(entries)
    return entries


def test_adopted_blocks_the_disk_lacks_are_written_after_the_scan_in_slices(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_bridge, "ADOPT_BATCH", 8)
    root = tmp_path / "disk"
    pool = mmap.mmap(-1, POOL)
    keys = chain("kept", 40)
    first_daemon_writes(root, pool, keys[:10])  # the other 30: still in its backlog at the SIGKILL
    offsets = [i * BLOCK for i in range(40)]
    for off in offsets[10:]:
        pool[off:off + BLOCK] = os.urandom(BLOCK)
    want = {k: bytes(pool[o:o + BLOCK]) for k, o in zip(keys, offsets)}

    index = BlockIndex(SlabAllocator(POOL, 2**20))
    bridge = open_disk(config(root), pool, index, None)  # its scan starts on a thread
    entries = adopt(index, keys, offsets)
    bridge.adopted(entries)
    index.discard(entries[-1])  # evicted before the scan ended: never written, counted
    turns(bridge, lambda: not bridge.scanning)
    assert bridge.stats()["warm_waiting"] == 32  # 40 blocks, 8 a batch: one pulled as the scan ended
    turns(bridge, lambda: idle(bridge))

    s = bridge.stats()
    assert (s["warm_adopted"], s["warm_on_disk"], s["warm_requeued"]) == (40, 10, 29)
    assert (s["written"], s["not_written"], s["blocks"]) == (29, {"team": {"evicted": 1}}, 39)
    assert s["warm_on_disk"] + s["written"] + 1 == s["warm_adopted"]
    files = block_files(root)
    assert len(files) == 39
    for path in files:
        with open(path, "rb") as f:
            raw = f.read()
        h = decode_header(raw[:HEADER_BYTES])
        assert raw[HEADER_BYTES:HEADER_BYTES + BLOCK] == want[h.key]
    bridge.check_integrity()
    index.check_integrity()
    bridge.close()


def test_a_flush_before_the_scan_ends_takes_the_adopted_blocks_out_uncounted(tmp_path):
    root = tmp_path / "disk"
    pool = mmap.mmap(-1, POOL)
    index = BlockIndex(SlabAllocator(POOL, 2**20))
    bridge = open_disk(config(root), pool, index, None)
    bridge.adopted(adopt(index, chain("flushed", 12), [i * BLOCK for i in range(12)]))
    index.flush(None)  # the daemon's flush of everything: the tier below forgets its blocks too
    turns(bridge, lambda: idle(bridge))
    s = bridge.stats()
    assert (s["warm_adopted"], s["warm_requeued"], s["written"], s["not_written"]) == (12, 0, 0, {})
    bridge.close()
