"""An upgrade keeps what the earlier daemon left: block files of disk format 1
and warm-restart journal records that carry zlib's CRC-32 (before CRC-32C,
kvtier/pool/checksum.py) are read, verified with the algorithm they were
written with, and loaded byte-exact; a damaged one is refused at its first
load and never reaches the engine. Real daemons, real files, the real kept
segments in /dev/shm."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import zlib

import torch

from kvtier.disk import format as fmt
from kvtier.pool import checksum
from kvtier.pool import journal as jn
from kvtier.pool.journal import Journal
from tests.daemon.test_disk_attacks import file_of, restarted, store_to_disk
from tests.daemon.test_disk_tier import block_files, chain, disk_env, written
from tests.daemon.test_warm_restart import blocks, hashes_of, warm  # noqa: F401  (warm: the fixture)
from tests.helpers import NS, make_kv


def rewrite_as_format_1(path: str, damage: bool = False) -> None:
    """The file as a daemon of disk format 1 wrote it: version 1, the payload's CRC-32
    (``damage``: the CRC-32 of other bytes, as a torn or rotted payload would show)."""
    with open(path, "r+b") as f:
        raw = f.read()
        h = fmt.decode_header(raw[:fmt.HEADER_BYTES])
        assert not isinstance(h, str) and not checksum.is_legacy(h.crc)  # this daemon wrote format 2
        crc = zlib.crc32(raw[fmt.HEADER_BYTES:]) ^ (1 if damage else 0)
        fp, key = h.ns_key.encode(), h.key
        body = fmt._FIXED.pack(fmt.MAGIC, 1, len(key), len(fp), 0, h.seq, h.size, crc) + key + fp
        body += struct.pack("<I", zlib.crc32(body))
        f.seek(0)
        f.write(body + bytes(fmt.HEADER_BYTES - len(body)))


def version_of(path: str) -> int:
    with open(path, "rb") as f:
        return struct.unpack_from("<H", f.read(10), 8)[0]


def test_block_files_of_format_1_load_byte_exact_and_a_damaged_one_never_reaches_the_engine(daemon_factory,
                                                                                         tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB")
    kv = make_kv(seed=31)
    hs = chain(31, 8)
    want = store_to_disk(daemon_factory(env=env), kv, hs)
    files = [file_of(root, k) for k in hs]
    for i, f in enumerate(files):
        rewrite_as_format_1(f, damage=(i == 5))
    assert {version_of(f) for f in files} == {1}
    d = restarted(daemon_factory, tmp_path, env)
    assert d.stats()["disk"]["blocks"] == 8  # the scan took every format 1 header
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for t in kv.tensors:
            t.zero_()
        r = c.load(hs, list(range(8))).wait()
        assert list(r.failed) == [5]
        got = blocks(kv, range(8))
        for i in range(8):
            same = all(torch.equal(got[i * 4 + j], want[i * 4 + j]) for j in range(4))
            assert same == (i != 5), i
        assert all(not got[5 * 4 + j].any() for j in range(4))  # nothing of the damaged block arrived
        more = chain(32, 4)  # what this daemon writes is format 2
        assert c.store(more, list(range(4))).wait().ok
        assert written(d, 4)
    assert d.stats()["disk"]["rejected"] == 1
    assert {version_of(file_of(root, k)) for k in more} == {2}
    assert not os.path.exists(files[5]) and all(os.path.exists(f) for i, f in enumerate(files) if i != 5)


def rewrite_journal_as_crc32(names, pool_size: int, slab_size: int, damage_offset: int | None) -> int:
    """Every record of the kept journal as an earlier daemon wrote it: its algorithm byte
    zero (it was padding) and the block's CRC-32 (of other bytes at ``damage_offset``)."""
    pool_name, journal_name = names
    with open("/dev/shm" + pool_name, "rb") as f:
        pool = f.read(pool_size)
    with open("/dev/shm" + journal_name, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        try:
            buf = memoryview(m)
            j, why = Journal.open(buf, pool_size, slab_size)
            assert j is not None, why
            kept, rejected = j.scan()
            assert rejected == 0 and kept
            base = jn.HEADER_BYTES + jn.NS_SLOTS * jn.NS_SLOT_BYTES
            for k in kept:
                pos = base + k.rec * jn.RECORD_BYTES
                fields = list(jn._REC.unpack(buf[pos:pos + jn.RECORD_BYTES]))
                assert fields[8] == 1 and fields[5] == checksum.of(pool[k.offset:k.offset + k.block_bytes])
                fields[5] = zlib.crc32(pool[k.offset:k.offset + k.block_bytes]) ^ (k.offset == damage_offset)
                fields[8] = 0
                body = jn._REC.pack(0, *fields[1:])[4:]
                buf[pos + 4:pos + jn.RECORD_BYTES] = body
                struct.pack_into("<I", buf, pos, jn._crc(body))
            del buf, j
            return len(kept)
        finally:
            m.close()


def test_a_warm_restart_from_a_journal_of_crc32_records_verifies_each_and_refuses_a_damaged_one(warm):
    first = warm(pool_size="4MiB", slab_size="1MiB")
    kv = make_kv(seed=33)
    hs = hashes_of(33, 8)
    with first.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(8))).wait().ok
        want = blocks(kv, range(8))
    first.stop(signal.SIGKILL)
    with open("/dev/shm" + warm.names[1], "rb") as f:  # the block whose record gets a wrong CRC-32
        j, _ = Journal.open(memoryview(bytearray(f.read())), 4 << 20, 1 << 20)
    damaged = max(j.scan()[0], key=lambda k: k.offset)
    assert rewrite_journal_as_crc32(warm.names, 4 << 20, 1 << 20, damaged.offset) == 8
    second = warm(pool_size="4MiB", slab_size="1MiB")
    with second.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(hs) == 8  # adopted: every record was taken
        for t in kv.tensors:
            t.zero_()
        r = c.load(hs, list(range(8))).wait()
        bad = hs.index(damaged.key)
        assert list(r.failed) == [bad]
        got = blocks(kv, range(8))
        for i in set(range(8)) - {bad}:  # the engine recomputes the one reported failed
            assert all(torch.equal(got[i * 4 + j], want[i * 4 + j]) for j in range(4)), i
    s = second.stats()["warm_restart"]
    assert s["adopted_blocks"] == 8 and s["verify_failed"] == 1


def test_a_daemon_without_the_crc_instruction_says_so_and_reads_what_a_hardware_one_wrote(daemon_factory,
                                                                                        tmp_path):
    # The same CRC-32C from the package's software loop (CRC32C_SW_MODE=force stands in for a
    # CPU without the instruction): the operator is told at start and in status, and the block
    # files a hardware daemon wrote load byte-exact in it, and its files in a hardware one.
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB")
    kv = make_kv(seed=35)
    hw = daemon_factory(process=True, env=env)
    assert hw.stats()["pool"]["checksum"] == "crc32c-hardware"
    want = store_to_disk(hw, kv, chain(35, 4))
    assert "checksums run in software" not in hw.read_log()
    hw.stop()
    sw = restarted(daemon_factory, tmp_path, {**env, "CRC32C_SW_MODE": "force"}, process=True)
    assert sw.stats()["pool"]["checksum"] == "crc32c-software"
    assert "blocks' checksums run in software" in sw.read_log()
    with sw.client(name="engine") as c:
        loads_byte_exact(c, kv, chain(35, 4), want)
        assert c.store(chain(36, 4), list(range(4))).wait().ok
        assert written(sw, 4)
    sw.stop()
    again = restarted(daemon_factory, tmp_path, env, process=True)
    with again.client(name="engine") as c:
        loads_byte_exact(c, kv, chain(36, 4), want)
    assert again.stats()["disk"]["rejected"] == 0


def loads_byte_exact(c, kv, hs, want) -> None:
    """``c`` registers ``kv``, zeroes it and loads ``hs`` into its first blocks: every one, as ``want``."""
    c.register_kv_cache(kv, [0] * 4, NS)
    for t in kv.tensors:
        t.zero_()
    r = c.load(hs, list(range(len(hs)))).wait()
    assert r.ok and r.done == len(hs), r
    assert all(torch.equal(a, b) for a, b in zip(blocks(kv, range(len(hs))), want))
