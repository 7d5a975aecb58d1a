"""The disk tier's writes run in a process of their own (kvtier/disk/writer.py): the same files
as the daemon's threads write, and nothing lost when that process dies, lies or never starts.

Real parts throughout: a named POSIX shared-memory pool, the real writer process started by
``DiskIO`` over a ``SOCK_SEQPACKET`` pair, a real directory; impostor writers are real
processes too (``writer_argv``), speaking the protocol wrongly on purpose."""

from __future__ import annotations

import mmap
import os
import signal
import stat
import sys
import textwrap
import time

import posix_ipc
import pytest

from kvtier.disk.format import HEADER_BYTES, TMP_DIR, decode_header, ns_dir
from kvtier.disk.io import DiskIO
from kvtier.pool import checksum
from tests.daemon.test_reaping import wait_for

NS = "team\x00model|float16"
SIZE = 16 * 1024
POOL = 2**20


@pytest.fixture
def pool():
    """A named shared-memory pool of random bytes (the writer process maps it by descriptor)."""
    name = f"/kvtier-test-writer.{os.getpid()}.{time.monotonic_ns()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=POOL)
    mm = mmap.mmap(shm.fd, POOL)
    shm.close_fd()
    mm[:] = os.urandom(POOL)
    yield name, mm
    mm.close()
    posix_ipc.unlink_shared_memory(name)


def make(tmp_path, pool, argv=None) -> tuple:
    root = tmp_path / "disk"
    (root / TMP_DIR).mkdir(parents=True, exist_ok=True)
    name, mm = pool
    io = DiskIO(str(root), mm, threads=1, pool_name=name, writer_argv=argv)
    # it starts beside the daemon's own start: until it is ready the daemon's threads write
    assert wait_for(lambda: "starting" not in io.writer_state().get("why", ""), 30)
    return root, io


def write(io, keys, size=SIZE, evicted=(), first=0):
    """Blocks ``keys`` from slots ``first``.. of the pool; the job once answered."""
    items = [(NS, k, seq, (first + j) * size) for j, (k, seq) in enumerate(zip(keys, io.next_seqs(len(keys))))]
    job = io.write(items, size, "t", list(evicted), [NS])
    assert wait_for(lambda: job.finished == len(items), 30, interval=0.002), io.snapshot()
    return job


def read(path) -> tuple:
    with open(path, "rb") as f:
        data = f.read()
    return decode_header(data[:HEADER_BYTES]), data[HEADER_BYTES:]


def exact(job, mm, size=SIZE, first=0) -> bool:
    """Every block of ``job`` is on disk under its name, header and bytes as in the pool."""
    for i, crc, path in job.ok:
        h, payload = read(path)
        slot = mm[(first + i) * size:(first + i + 1) * size]
        if (h.ns_key, h.key, h.size, h.crc) != (NS, job.items[i][1], size, crc) or payload != slot:
            return False
        if not checksum.matches(payload, crc):
            return False
    return len(job.ok) == len(job.items) and not job.failed


def test_blocks_written_by_the_writer_process_read_back_exact_and_it_is_another_process(tmp_path, pool):
    root, io = make(tmp_path, pool)
    try:
        pid = io.writer_state()["process"]
        assert pid and pid != os.getpid()
        job = write(io, [bytes([k]) * 16 for k in range(8)])
        assert exact(job, pool[1])
        counters, errors = io.snapshot()
        assert counters["written"] == 8 and counters["written_bytes"] == 8 * SIZE and not errors
        # a full disk's write overwrites the files evicted for it (BENCHMARKS.md 13.10), there too
        old = [p for _, _, p in sorted(job.ok)]
        inodes = {os.stat(p).st_ino for p in old[:4]}
        again = write(io, [bytes([k]) * 16 for k in range(20, 24)], evicted=old[:4], first=8)
        assert exact(again, pool[1], first=8)
        assert {os.stat(p).st_ino for _, _, p in again.ok} == inodes
        assert not any(map(os.path.exists, old[:4])) and all(map(os.path.exists, old[4:]))
        assert io.snapshot()[0]["recycled"] == 4
        assert os.listdir(root / TMP_DIR) == []
    finally:
        io.close()
    assert not os.path.exists(f"/proc/{pid}")  # closed with the tier


def test_the_writer_holds_only_its_pair_and_no_descriptor_of_the_daemon(tmp_path, pool):
    """The daemon holds engines' memfds, client sockets and other shared memory: the writer gets
    its socket and the pool (Python's mmap keeps a duplicate of the descriptor); an engine's
    descriptor leaking into it would keep the engine's memory alive, and a listening socket
    would be a door no one guards."""
    leak = os.memfd_create("kvtier-test-engine-kv")  # an engine's KV handed to the daemon
    os.set_inheritable(leak, True)
    root, io = make(tmp_path, pool)
    try:
        pid = io.writer_state()["process"]
        targets = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                targets[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                pass
        assert not any("memfd:" in t for t in targets.values()), targets
        assert {t for t in targets.values() if t.startswith("/dev/shm")} == {"/dev/shm" + pool[0]}, targets
        assert sum(t.startswith("socket:") for t in targets.values()) == 1, targets
        with open(f"/proc/{pid}/net/unix") as f:
            inode = next(t for t in targets.values() if t.startswith("socket:"))[8:-1]
            row = next(line for line in f if line.split()[6] == inode)
        assert len(row.split()) == 7  # no path: nobody can connect to it
    finally:
        io.close()
        os.close(leak)


def test_a_killed_writer_loses_no_block_the_daemons_threads_write_its_jobs(tmp_path, pool):
    root, io = make(tmp_path, pool)
    try:
        pid = io.writer_state()["process"]
        os.kill(pid, signal.SIGSTOP)  # jobs pile up in its hands, then it dies with them
        items = [(NS, bytes([k]) * 16, seq, k * SIZE) for k, seq in zip(range(32), io.next_seqs(32))]
        jobs = [io.write(items[i:i + 8], SIZE, "t") for i in range(0, 32, 8)]
        time.sleep(0.2)
        assert all(j.finished == 0 for j in jobs)
        half_written = root / TMP_DIR / f"{io._writer.tmp_prefix}1f.tmp"  # what a write cut short leaves
        half_written.write_bytes(b"torn")
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: all(j.finished == len(j.items) for j in jobs), 30, interval=0.005)
        for i, j in enumerate(jobs):
            assert exact(j, pool[1], first=8 * i)
        state = io.writer_state()
        assert state["process"] is None and "signal 9" in state["why"]
        assert io.snapshot()[0]["written"] == 32
        # later writes go to the threads at once
        after = write(io, [b"\xee" * 16], first=40)
        assert exact(after, pool[1], first=40)
        assert os.listdir(root / TMP_DIR) == []
    finally:
        io.close()


IMPOSTOR = textwrap.dedent("""
    import os, socket, sys, msgpack
    a = sys.argv
    sock = socket.socket(fileno=int(a[a.index("--sock-fd") + 1]))
    lie = os.environ["LIE"]
    if lie == "exit":
        sys.exit(3)
    sock.send(msgpack.packb(["ready", os.getpid(), "impostor-"]))
    while True:
        m = msgpack.unpackb(sock.recv(1 << 20))
        if m[0] != "write":
            continue
        job, n = m[1], len(m[3])
        answer = {
            "unknown_job": ["done", job + 1000, [[i, 1] for i in range(n)], [], {}],
            "twice": ["done", job, [[0, 1]] * n, [], {}],
            "short": ["done", job, [[i, 1] for i in range(n - 1)], [], {}],
            "big_crc": ["done", job, [[i, 1 << 40] for i in range(n)], [], {}],
            "bad_counters": ["done", job, [[i, 1] for i in range(n)], [], {"written": "many"}],
            "float_index": ["done", job, [[float(i), 1] for i in range(n)], [], {}],
            "negative_count": ["done", job, [[i, 1] for i in range(n)], [], {"written": -5}],
            "unknown_kind": ["format", "/"],
        }.get(lie)
        sock.send(b"\\xc1garbage" if answer is None else msgpack.packb(answer))
""")


@pytest.mark.parametrize("lie", ["unknown_job", "twice", "short", "big_crc", "bad_counters", "float_index",
                                 "negative_count", "unknown_kind", "garbage"])
def test_a_writer_that_lies_is_ended_and_its_job_written_by_the_daemon_exact(tmp_path, pool, monkeypatch, lie):
    script = tmp_path / "impostor.py"
    script.write_text(IMPOSTOR)
    monkeypatch.setenv("LIE", lie)
    root, io = make(tmp_path, pool, argv=[sys.executable, str(script)])
    try:
        assert io.writer_state()["process"]
        job = write(io, [bytes([k]) * 16 for k in range(4)])
        assert exact(job, pool[1])  # no forged checksum or index reached the job
        state = io.writer_state()
        assert state["process"] is None and "malformed" in state["why"], state
    finally:
        io.close()


def test_a_writer_that_does_not_start_leaves_the_writes_to_the_threads(tmp_path, pool, monkeypatch):
    script = tmp_path / "impostor.py"
    script.write_text(IMPOSTOR)
    monkeypatch.setenv("LIE", "exit")
    root, io = make(tmp_path, pool, argv=[sys.executable, str(script)])
    try:
        state = io.writer_state()
        assert state["process"] is None and "did not start" in state["why"]
        assert exact(write(io, [b"\x05" * 16]), pool[1])
    finally:
        io.close()


def test_without_a_pool_name_the_threads_write_and_no_process_starts(tmp_path, pool):
    root = tmp_path / "disk"
    (root / TMP_DIR).mkdir(parents=True)
    io = DiskIO(str(root), pool[1], threads=1)
    try:
        assert io.writer_state() == {"process": None, "why": 'disk_writer = "threads"'}
        assert exact(write(io, [b"\x06" * 16]), pool[1])
        assert stat.S_IMODE(os.stat(root / ns_dir(NS)).st_mode) == 0o700
    finally:
        io.close()
