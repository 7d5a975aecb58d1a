"""A daemon started over more files than its ``disk_size`` holds (a ``disk_size``
cut) drops the oldest in slices between requests and deletes their files on
its I/O threads: RAM hits are answered while the excess is still being
dropped, and every file found is announced in the block event stream. Real
daemons, real files."""

from __future__ import annotations

import os

import msgpack
import zmq

from kvtier.disk.format import HEADER_BYTES, block_name, decode_header, encode_header, file_bytes, ns_dir
from kvtier.pool import checksum
from tests.daemon.test_disk_tier import BLOCK, block_files, chain, disk_env, scanned, written
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

EXCESS = 40000  # old files beyond the new disk_size: ~40 slices of the loop's drop, 3 round trips per check below
# (20,000 left one check of a full suite's loaded run no slice to land between: 0 of them mid-drop)
SMALL = 64      # their payload (a block of another size: never loaded, only counted and dropped)


def plant_old_files(root, ns_key: str, n: int) -> None:
    """``n`` valid block files of ``ns_key``, older (smaller seq) than any a daemon writes."""
    d = os.path.join(root, ns_dir(ns_key))
    payload = bytes(SMALL)
    crc = checksum.of(payload)
    for seq in range(1, n + 1):
        key = b"old" + seq.to_bytes(13, "little")
        fd = os.open(os.path.join(d, block_name(key, seq)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, encode_header(ns_key, key, seq, SMALL, crc) + payload)
        os.close(fd)


def test_a_start_over_a_disk_size_cut_answers_ram_hits_while_the_excess_is_dropped(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=11)
    d = daemon_factory(process=True, socket=sock, env=disk_env(root))
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(chain(1, 32), list(range(32))).wait().ok
        assert written(d, 32)
    d.stop()
    with open(block_files(root)[0], "rb") as f:
        ns_key = decode_header(f.read(HEADER_BYTES)).ns_key  # the engine's namespace, as the daemon keys it
    plant_old_files(root, ns_key, EXCESS)

    keep_old = 128  # the new bound (at least 1 MiB): the 32 real blocks, 4 stored after the start, 128 old files
    events = "ipc://" + str(tmp_path / "events.sock")
    sub = zmq.Context.instance().socket(zmq.SUB)  # connected before the daemon binds: it sees the scan
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events)
    d = daemon_factory(process=True, socket=sock, extra=["--events", events],
                       env=disk_env(root, str(36 * file_bytes(BLOCK) + keep_old * file_bytes(SMALL))))
    mid_drop = 0  # RAM-hit lookups answered after the scan ended and before the index fitted disk_size
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hot = chain(2, 4)
        assert c.store(hot, list(range(4))).wait().ok
        while True:
            before = c.stats(False)["disk"]
            hits = c.lookup(hot)
            after = c.stats(False)["disk"]
            assert hits == 4
            over = after["used_bytes"] + after["reserved_bytes"] > after["capacity_bytes"]
            if not before["scanning"] and over:
                mid_drop += 1
            if not after["scanning"] and not over:
                break
        # The loop answered requests between slices of the drop, not after one long stall.
        assert mid_drop > 0, mid_drop
        assert written(d, 4)
        assert wait_for(lambda: len(block_files(root)) == 36 + keep_old, 30)  # deleted by the I/O threads
        s = d.stats()["disk"]
        assert s["blocks"] == 36 + keep_old and s["used_bytes"] <= s["capacity_bytes"]
        assert c.lookup(chain(1, 32)) == 32  # the newest stayed: the daemon's own blocks
    # Files found at start are announced (as far as the subscription was live: a PUB socket
    # sends nothing to a subscriber before it has joined), and only dropped ones removed again.
    old = [b"old" + seq.to_bytes(13, "little") for seq in range(1, EXCESS + 1)]
    stored, removed = set(), set()
    while sub.poll(1000):
        _, body = sub.recv_multipart()
        for kind, key in msgpack.unpackb(body)["events"]:
            (stored if kind == "disk_stored" else removed if kind == "disk_removed" else set()).add(bytes(key))
    assert stored & set(old) and removed
    assert removed <= set(old[:EXCESS - keep_old])
    sub.close()
