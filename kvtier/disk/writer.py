"""The disk tier's block writes, in a process of their own (``python -m kvtier.disk.writer``).

Runs in the writer process, started by the daemon (``writer_link.py``) with
two inherited descriptors: one end of a ``SOCK_SEQPACKET`` pair and the pool's
shared memory, which it maps. Nothing else reaches it: it has no address, and
it ends when the daemon does (the pair's end-of-file), even a SIGKILLed one.

Why a process: a block's write is a checksum and about a dozen syscalls, and
in the daemon's threads each of them gives the interpreter lock back and takes
it again. A writer thread, niced so that stores come first, is preempted while
it holds the lock, and the loop and the copy threads wait for it. In a store
flood on two cores, stores cost 1.68-2.30x of the tier off with the writes in
the daemon's threads and 1.25-1.88x with them here, the daemon's other threads
a third of the CPU per store (BENCHMARKS.md 13.12). The writes themselves are the daemon's own
code (``DiskIO``, run here with writer threads only), so files, headers, the
overwrite of evicted files and the checks are the same either way.

Messages (msgpack, one per packet):
  daemon -> writer   ["write", job, size, [[ns_key, key, seq, offset], ...], [evicted path, ...]]
                     ["hurry", bool]            the urgent writer on or off (schedule.py)
  writer -> daemon   ["ready", pid, tmp_prefix]  the pool is mapped; its tmp/ files start so
                     ["done", job, [[i, crc], ...], [i, ...], {counter: n}]
                     ["note", counter, message, ns_key]   an error for the daemon's status
                     ["log", levelno, logger, message]    a line for the daemon's log
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import select
import socket
import sys
import threading

import msgpack

from .io import DiskIO

RECV_BYTES = 1 << 20  # a packet larger than this would be cut: jobs are at most a backlog turn (32 blocks)


class _Link:
    """The writer's end of the pair: packets out from any thread, one at a time."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, *msg) -> None:
        data = msgpack.packb(list(msg))
        with self.lock:
            try:
                self.sock.send(data)
            except OSError:  # the daemon is gone: the main thread sees the end of file and exits
                pass


class _ToDaemon(logging.Handler):
    """This process's log lines, written by the daemon's own log (its format, its stderr)."""

    def __init__(self, link: _Link):
        super().__init__()
        self.link = link

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = self.format(record)
        except Exception:
            msg = str(record.msg)
        self.link.send("log", record.levelno, record.name, msg)


def _send_results(io: DiskIO, link: _Link) -> None:
    while True:
        select.select([io.wakeup_fd], [], [])
        for what, job in io.completed():
            if what == "done" and job.kind == "write":
                with io.lock:
                    counters = dict(io.counters)
                link.send("done", job.token, [[i, crc] for i, crc, _ in job.ok], list(job.failed), counters)


def serve(sock: socket.socket, pool_fd: int, root: str, direct: bool, fsync: bool) -> None:
    size = os.fstat(pool_fd).st_size
    pool = mmap.mmap(pool_fd, size)  # read and written by DMA only; mapped shared, as the daemon has it
    os.close(pool_fd)
    link = _Link(sock)
    logging.getLogger().addHandler(_ToDaemon(link))
    logging.getLogger().setLevel(logging.INFO)
    io = DiskIO(root, pool, 0, fsync=fsync, direct=direct,
                on_note=lambda counter, message, ns_key: link.send("note", counter, message, ns_key))
    threading.Thread(target=_send_results, args=(io, link), name="kvtier-writer-results", daemon=True).start()
    link.send("ready", os.getpid(), io.tmp_prefix)
    while True:
        try:
            data = sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        if not data:  # the daemon closed its end or died: what is queued is not written (it knows)
            os._exit(0)
        msg = msgpack.unpackb(data)
        if msg[0] == "write":
            _, job, size, items, evicted = msg
            io.write([tuple(it) for it in items], size, job, evicted)
        elif msg[0] == "hurry":
            io.hurry(bool(msg[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="kvtier's disk writer process (started by kvtier-daemon)")
    p.add_argument("--root", required=True)
    p.add_argument("--sock-fd", type=int, required=True)
    p.add_argument("--pool-fd", type=int, required=True)
    p.add_argument("--direct", type=int, choices=(0, 1), required=True)
    p.add_argument("--fsync", type=int, choices=(0, 1), default=0)
    a = p.parse_args(argv)
    sock = socket.socket(fileno=a.sock_fd)
    serve(sock, a.pool_fd, a.root, bool(a.direct), bool(a.fsync))
    return 0


if __name__ == "__main__":
    sys.exit(main())
