"""A file evicted to make room for a write is not unlinked: the write moves it out of its
namespace's directory into ``tmp/`` and overwrites it, which saves the write a create and
the eviction an unlink (BENCHMARKS.md 13.10). In process, a real directory and the real
I/O threads: the new block is the old inode with the new bytes under the new name, the
old name is gone, files evicted beyond the writes are unlinked, writes beyond the files
evicted create their own, and a file of another size is cut to the new block's."""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import pytest

from kvtier.disk.format import HEADER_BYTES, TMP_DIR, decode_header, ns_dir
from kvtier.disk.files import direct_io_works
from kvtier.disk.io import DiskIO
from kvtier.pool import checksum
from tests.daemon.test_reaping import wait_for

NS = "team\x00model|float16"
SIZE = 16 * 1024


def until(cond, timeout=20.0) -> bool:
    return wait_for(cond, timeout, interval=0.002)


def write(io, keys: list[bytes], size=SIZE, evicted=()) -> list[str]:
    """Blocks ``keys`` written from the pool's start, one slot each; their files."""
    items = [(NS, k, seq, j * size) for j, (k, seq) in enumerate(zip(keys, io.next_seqs(len(keys))))]
    job = io.write(items, size, "t", list(evicted), [NS])
    assert until(lambda: job.finished == len(items)), io.errors
    assert not job.failed, io.errors
    return [p for _, _, p in sorted(job.ok)]


def make(tmp_path, direct=False):
    root = tmp_path / "disk"
    (root / TMP_DIR).mkdir(parents=True)
    pool = mmap.mmap(-1, 2**20)
    pool[:] = os.urandom(len(pool))
    if direct and not direct_io_works(str(root / TMP_DIR)):
        pytest.skip("this filesystem refuses O_DIRECT")
    return root, pool, DiskIO(str(root), pool, threads=1, direct=direct)


def read(path) -> tuple:
    with open(path, "rb") as f:
        data = f.read()
    return decode_header(data[:HEADER_BYTES]), data[HEADER_BYTES:]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_a_write_overwrites_the_file_evicted_for_it_under_its_own_name(tmp_path, direct):
    root, pool, io = make(tmp_path, direct)
    try:
        old = write(io, [b"\x01" * 16, b"\x02" * 16])
        inodes = {os.stat(p).st_ino for p in old}
        new = write(io, [b"\x03" * 16, b"\x04" * 16], evicted=old)
        assert not any(map(os.path.exists, old))
        assert {os.stat(p).st_ino for p in new} == inodes  # the same two files, rewritten
        for j, (p, k) in enumerate(zip(new, (b"\x03" * 16, b"\x04" * 16))):
            h, payload = read(p)
            assert (h.ns_key, h.key, h.size) == (NS, k, SIZE) and os.stat(p).st_size == HEADER_BYTES + SIZE
            assert payload == pool[j * SIZE:(j + 1) * SIZE] and checksum.matches(payload, h.crc)
        assert io.counters["recycled"] == 2 and io.counters["unlinked"] == 0
        assert io.counters["written_direct"] == (4 if direct else 0)
        assert os.listdir(root / TMP_DIR) == []
        assert sorted(os.listdir(root / ns_dir(NS))) == sorted(map(os.path.basename, new))
    finally:
        io.close()


def test_files_evicted_beyond_the_writes_are_unlinked_and_writes_beyond_them_create_files(tmp_path):
    root, pool, io = make(tmp_path)
    try:
        old = write(io, [bytes([k]) * 16 for k in range(5)])
        one = write(io, [b"\xaa" * 16], evicted=old)  # five evicted for one write
        assert until(lambda: io.counters["unlinked"] == 4)
        assert io.counters["recycled"] == 1
        assert sorted(os.listdir(root / ns_dir(NS))) == [os.path.basename(one[0])]
        three = write(io, [b"\xb1" * 16, b"\xb2" * 16, b"\xb3" * 16], evicted=one)  # one for three
        assert io.counters["recycled"] == 2 and len({os.stat(p).st_ino for p in three}) == 3
        assert [read(p)[1] for p in three] == [pool[j * SIZE:(j + 1) * SIZE] for j in range(3)]
        assert os.listdir(root / TMP_DIR) == []
    finally:
        io.close()


def test_an_evicted_file_of_another_size_is_cut_to_the_new_blocks_and_a_gone_one_is_no_loss(tmp_path):
    root, pool, io = make(tmp_path)
    try:
        big = write(io, [b"\x01" * 16])
        small = write(io, [b"\x02" * 16], size=SIZE // 2, evicted=big)
        assert io.counters["recycled"] == 1
        h, payload = read(small[0])
        assert h.size == SIZE // 2 and payload == pool[:SIZE // 2]  # not a byte of the old file left
        os.unlink(small[0])  # gone before the write that would overwrite it (a load deleted it)
        again = write(io, [b"\x03" * 16], evicted=small)
        assert io.counters["recycled"] == 1 and read(again[0])[1] == pool[:SIZE]
        assert until(lambda: sorted(os.listdir(root / ns_dir(NS))) == [os.path.basename(again[0])])
    finally:
        io.close()


def test_the_last_write_that_empties_a_namespace_directory_removes_it(tmp_path):
    root, pool, io = make(tmp_path)
    other = "team\x00other|float16"
    try:
        old = write(io, [b"\x01" * 16])
        items = [(other, b"\x02" * 16, io.next_seqs(1)[0], 0)]
        job = io.write(items, SIZE, "t", old, [NS])  # NS's last file, overwritten by another namespace
        assert until(lambda: job.ok)
        assert until(lambda: not (root / ns_dir(NS)).exists())
        assert os.listdir(root / ns_dir(other)) == [os.path.basename(job.ok[0][2])]
    finally:
        io.close()


def test_a_reader_that_opened_the_file_before_a_write_took_it_over_gets_no_block(tmp_path):
    # A load opens a file by its name, then reads it; a write may take the file over in between
    # (it was evicted). The reader's descriptor then holds the new block's bytes: the read of
    # the old entry must fail, never deliver them as the old block.
    from kvtier.disk.index import DiskEntry
    root, pool, io = make(tmp_path)
    try:
        job = io.write([(NS, b"\x01" * 16, io.next_seqs(1)[0], 0)], SIZE, "t")
        assert until(lambda: job.ok)
        _, crc, old = job.ok[0]
        entry = DiskEntry(NS, b"\x01" * 16, job.items[0][2], SIZE, crc, old)
        fd = os.open(old, os.O_RDONLY)  # the reader, just before the write
        try:
            write(io, [b"\x02" * 16], evicted=[old])
            assert io.counters["recycled"] == 1
            why = io._read_verified(fd, entry, 4 * SIZE, SIZE)  # the reader's read, into another slot
        finally:
            os.close(fd)
        assert why == "header names another block"
    finally:
        io.close()


def plant_fifo(path):
    os.unlink(path)
    os.mkfifo(path, 0o600)


def plant_hard_link(path):
    os.link(path, path + ".backup")  # a second name, e.g. a backup made with cp -al


def plant_world_writable(path):
    os.chmod(path, 0o666)


def plant_other_owner(path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown")
    os.chown(path, 41008, 41008)


@pytest.mark.parametrize("plant", [plant_fifo, plant_hard_link, plant_world_writable, plant_other_owner])
def test_a_write_overwrites_only_a_file_that_is_still_as_the_tier_wrote_it(tmp_path, plant):
    # Someone with the daemon's rights (or a backup tool) changed the evicted file: a FIFO would
    # block the writer's open for good, a hard link would see another tenant's block, a file
    # others may write or another user owns is no longer the tier's. The write makes its own.
    root, pool, io = make(tmp_path)
    try:
        old = write(io, [b"\x01" * 16])[0]
        before = open(old, "rb").read() if plant is plant_hard_link else None
        plant(old)
        new = write(io, [b"\x02" * 16], evicted=[old])[0]  # returns: the open did not block
        assert io.counters["recycled"] == 0
        st = os.stat(new)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_nlink == 1
        assert read(new)[1] == pool[:SIZE]
        assert os.listdir(root / TMP_DIR) == []  # what was planted is gone from tmp/
        if before is not None:
            assert open(old + ".backup", "rb").read() == before  # the other name kept its bytes
    finally:
        io.close()


def test_a_taken_over_file_is_written_through_a_blocking_descriptor(tmp_path):
    # The take-over opens non-blocking (a planted FIFO must not hang the writer), then makes the
    # descriptor blocking again before it writes: a write may wait for the disk, never fail
    # with EAGAIN.
    root, pool, io = make(tmp_path)
    try:
        old = write(io, [b"\x01" * 16])[0]
        tmp = str(root / TMP_DIR / "taken.tmp")
        os.rename(old, tmp)
        fd, recycled = io._open_tmp(tmp, True, 0)
        try:
            assert recycled and not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
        finally:
            os.close(fd)
    finally:
        io.close()
