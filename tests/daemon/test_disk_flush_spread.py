"""A flush of many blocks that live on disk only is spread over loop turns too,
and nobody sees it half done.

After a restart a namespace's blocks are files the start-up scan found, with
nothing of them in RAM. A flush of that namespace used to empty its disk
index in one loop turn (O(blocks), one event each). Now the files are hidden
from every reader at once (socket lookups, loads and the lookup mirror) and
dropped a slice per turn. A real daemon with a real disk directory and the
mirror on: while the flush runs, a reader's lookups of the flushed chains
(answered from the mirror) and over the socket see all of a chain or none of
it, another namespace's disk chains stay whole, the reply counts every file,
and when it comes the disk index is empty; the files and the namespace's
directory follow on the I/O threads.
"""

from __future__ import annotations

import os

from kvtier.client import Namespace
from tests.daemon.test_disk_tier import block_files, disk_env, scanned
from tests.daemon.test_flush_spread import CHAIN, SHAPE, SLICE_MAX, chain, flush_in_background, ids
from tests.daemon.test_reaping import wait_for
from tests.helpers import make_kv

X = Namespace("disk-flush-x", "float16", "flashinfer", 16)
Y = Namespace("disk-flush-y", "float16", "flashinfer", 16)
CHAINS = 12  # 12,288 files of X to flush, more than SLICE_MAX a turn


def test_a_flush_of_12288_disk_only_blocks_is_never_seen_half_done(daemon_factory, tmp_path):
    sock, root = str(tmp_path / "d.sock"), tmp_path / "disk"
    env = disk_env(root, "256MiB", lookup_index=1)
    src, dst = make_kv(SHAPE, layers=1, seed=11), make_kv(SHAPE, layers=1, seed=12)
    xs, ys = [chain(f"x{k}") for k in range(CHAINS)], [chain(f"y{k}") for k in range(2)]
    d = daemon_factory(process=True, socket=sock, pool_size="32MiB", slab_size="4MiB", env=env)
    with d.client(name="writer", timeout=60) as c, d.client(name="writer-y", timeout=60) as cy:
        c.register_kv_cache(src, [0], X)
        cy.register_kv_cache(src, [0], Y)
        for hs in xs:
            assert c.store(hs, ids()).wait().ok
        for hs in ys:
            assert cy.store(hs, ids()).wait().ok
        total = CHAIN * (CHAINS + len(ys))
        assert wait_for(lambda: d.stats()["disk"]["written"] >= total
                        and d.stats()["disk"]["queued_bytes"] == 0, 120)
    d.stop()

    # A new daemon: X and Y are on disk only (nothing in its RAM).
    d = daemon_factory(process=True, socket=sock, pool_size="32MiB", slab_size="4MiB", env=env)
    assert scanned(d)
    s = d.stats()
    assert s["disk"]["blocks"] == total and s["pool"]["used_bytes"] == 0
    reader = d.client(name="reader", timeout=60)
    reader.register_kv_cache(dst, [0], X)
    other = d.client(name="reader-y", timeout=60)
    other.register_kv_cache(dst, [0], Y)
    assert reader._mirror is not None and all(reader.lookup(hs) == CHAIN for hs in xs)
    by_socket = d.client(name="socket-reader", timeout=60)  # the mirror only for the reader
    by_socket.register_kv_cache(dst, [0], X)
    by_socket._mirror = None

    t, result = flush_in_background(d, X)
    seen, rounds = set(), 0
    while t.is_alive() or rounds < 3:
        rounds += 1
        for k in range(CHAINS):
            hits = reader.lookup(xs[k])  # the mirror's answer
            seen.add(hits)
            assert hits in (0, CHAIN), f"a flushed chain was seen half removed in the mirror: {hits}"
        assert by_socket.lookup(xs[rounds % CHAINS]) in (0, CHAIN)  # the daemon's own answer
        assert all(other.lookup(hs) == CHAIN for hs in ys)
    t.join()
    assert result["removed"] == CHAIN * CHAINS
    assert all(reader.lookup(hs) == 0 for hs in xs) and all(other.lookup(hs) == CHAIN for hs in ys)
    s = d.stats()  # with the daemon's integrity check of every index (tests/conftest.py)
    assert s["disk"]["blocks"] == CHAIN * len(ys)
    assert s["flushes"]["turns"] >= CHAIN * CHAINS // SLICE_MAX
    assert (s["flushes"]["pending"], s["flushes"]["disk_hidden"]) == (0, 0)
    # The disk's age heap held an item per flushed file: it is rebuilt without them, a slice
    # per turn as the flush's files are, with no request needed to start it.
    assert wait_for(lambda: not d.stats()["disk"]["heap_rebuilding"], 30)
    s = d.stats()
    assert s["disk"]["heap_items"] == CHAIN * len(ys)
    # The files go on the I/O threads, then X's directory.
    assert wait_for(lambda: len(block_files(root)) == CHAIN * len(ys), 60)
    assert wait_for(lambda: len(os.listdir(root)) == 2, 10), os.listdir(root)  # Y's directory and tmp/
    for c in (reader, other, by_socket):
        c.close()
    print(f"\ndisk-only flush of {CHAIN * CHAINS} files and its age heap's rebuild: {s['flushes']['turns']} loop turns, longest "
          f"{s['flushes']['longest_turn_cpu_ms']} ms CPU, {rounds} rounds of lookups meanwhile saw {sorted(seen)}")
    src.close()
    dst.close()
