"""The disk writer process, seen from the daemon: start it, hand it write jobs, hear back.

Runs in the daemon. ``DiskIO`` hands a write job to ``submit`` on the loop
thread and goes on: a sender thread sends it (a full socket never blocks the
loop), a reader thread takes the answers, one per job, and calls ``on_done``
there; the loop hears of it through DiskIO's inbox as before. The daemon's
interpreter takes a job's answer once, not a block's dozen syscalls.

Nothing the writer says is trusted further than a job it was given: an
answer must name a job in flight and account for each of its items exactly
once, with a 32-bit checksum; the daemon names the files itself. Anything
else (a malformed packet, a job not in flight, the process exiting or dying)
ends the writer: it is killed, and ``on_lost(reason, jobs)`` gets every job it
had not answered, which the daemon's own threads then write (its blocks are
still pinned in the pool): a writer's death loses no block. The daemon does
not start a second one; status says why writes went back to its threads.

Primitive: ``WriterProcess(root, pool_name, direct, fsync, on_done, on_lost, on_note, argv=None)``,
``.start()`` (raises ``WriterError``), ``.submit(job) -> bool``, ``.hurry(flag)``, ``.pid``,
``.tmp_prefix``, ``.close()``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections import deque

import msgpack

log = logging.getLogger("kvtier.disk")
READY_TIMEOUT_S = 30.0   # the writer imports numpy and maps the pool; a loaded node may take seconds
CLOSE_TIMEOUT_S = 6.0    # its own threads finish the write in hand (DiskIO.close waits 5 s)
MAX_PACKET = 1 << 20     # what the writer reads in one packet (writer.RECV_BYTES)


class WriterError(RuntimeError):
    pass


class WriterProcess:
    def __init__(self, root: str, pool_name: str, direct: bool, fsync: bool, on_done, on_lost, on_note,
                 argv: list[str] | None = None):
        self.root, self.pool_name, self.direct, self.fsync = root, pool_name, direct, fsync
        self.on_done, self.on_lost, self.on_note = on_done, on_lost, on_note
        self.argv = argv or [sys.executable, "-m", "kvtier.disk.writer"]  # tests run impostors through this
        self.pid = 0
        self.tmp_prefix = ""
        self.lost = ""
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._out: deque = deque()      # packets for the sender (the lock's)
        self._jobs: dict = {}           # job id -> DiskJob in the writer's hands (the lock's)
        self._next = 0
        self._closing = False

    # ---- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        import posix_ipc
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        shm = None
        try:
            shm = posix_ipc.SharedMemory(self.pool_name)
            cmd = [*self.argv, "--root", self.root, "--sock-fd", str(theirs.fileno()),
                   "--pool-fd", str(shm.fd), "--direct", str(int(self.direct)), "--fsync", str(int(self.fsync))]
            # stderr stays the daemon's (a crash's traceback reaches its log); nothing else is inherited
            self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), shm.fd), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, close_fds=True)
        except (OSError, posix_ipc.Error) as exc:
            mine.close()
            raise WriterError(f"cannot start the disk writer process: {exc}") from None
        finally:
            theirs.close()
            if shm is not None:
                shm.close_fd()
        mine.settimeout(READY_TIMEOUT_S)
        try:
            msg = msgpack.unpackb(mine.recv(MAX_PACKET))
            if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == "ready" and msg[1] == self._proc.pid
                    and isinstance(msg[2], str)):
                raise ValueError(f"not a ready message: {msg!r:.200}")
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            mine.close()
            self._kill()
            raise WriterError(f"the disk writer process did not start: {exc or 'it exited'}") from None
        mine.settimeout(None)
        self._sock, self.pid, self.tmp_prefix = mine, self._proc.pid, msg[2]
        threading.Thread(target=self._send_loop, name="kvtier-disk-writer-send", daemon=True).start()
        threading.Thread(target=self._read_loop, name="kvtier-disk-writer-read", daemon=True).start()

    # ---- loop-thread API -------------------------------------------------------------------------
    def submit(self, job) -> bool:
        """Hand ``job`` to the writer; False when it is gone (the caller writes the job itself)."""
        with self._cv:
            if self.lost or self._closing:
                return False
            self._next += 1
            self._jobs[self._next] = job
            self._out.append(msgpack.packb(["write", self._next, job.size, [list(it) for it in job.items],
                                            list(job.evicted)]))
            self._cv.notify()
        return True

    def hurry(self, urgent: bool) -> None:
        with self._cv:
            if not self.lost:
                self._out.append(msgpack.packb(["hurry", urgent]))
                self._cv.notify()

    def close(self) -> None:
        """Stop the writer: it exits at the end of file (a block it was writing stays in tmp/, which
        the next start's scan empties); a job it had not answered stays unanswered, as the queue of
        the daemon's own threads does at close (warm restart re-queues what it kept)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()

    # ---- threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._out and not self._closing and not self.lost:
                    self._cv.wait()
                if self._closing or self.lost:
                    return
                data = self._out.popleft()
            try:
                self._sock.send(data)  # a packet is sent whole or not at all
            except OSError:  # EPIPE: it died (its exit says how)
                self._lose(self._exit_reason())
                return

    def _read_loop(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_PACKET)
            except OSError:  # ECONNRESET: it died with packets of ours unread
                data = b""
            if not data:
                if not self._closing:
                    self._lose(self._exit_reason())
                return
            try:
                self._handle(msgpack.unpackb(data, strict_map_key=False))
            except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as exc:
                self._lose(f"it sent a malformed message ({type(exc).__name__}: {exc})")
                return

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == "done":
            _, jid, ok, failed, counters = msg
            with self._lock:
                job = self._jobs.get(jid)
            if job is None:
                raise ValueError(f"an answer for job {jid!r}, which it was not given")
            n = len(job.items)
            ok = [(i, c) for i, c in ok]
            seen = [i for i, _ in ok] + list(failed)
            if any(type(i) is not int for i in seen) or sorted(seen) != list(range(n)):
                raise ValueError(f"an answer that does not account for job {jid}'s {n} items once each")
            if any(type(c) is not int or not 0 <= c < 1 << 32 for _, c in ok):
                raise ValueError(f"an answer with a checksum that is not a 32-bit value (job {jid})")
            if not isinstance(counters, dict) or any(type(k) is not str or type(v) is not int or v < 0
                                                      for k, v in counters.items()):
                raise ValueError("counters that are not {name: count}")
            with self._lock:
                del self._jobs[jid]
            self.on_done(job, ok, list(failed), counters)
        elif kind == "note":
            _, counter, message, ns_key = msg
            self.on_note(str(counter), str(message), str(ns_key))
        elif kind == "log":
            _, level, name, message = msg
            logging.getLogger(str(name)).log(int(level), "disk writer process: %s", str(message)[:2000])
        else:
            raise ValueError(f"an unknown message {kind!r:.50}")

    def _lose(self, reason: str) -> None:
        with self._cv:
            if self.lost:
                return
            self.lost = reason
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._out.clear()
            self._cv.notify_all()
        self._kill()
        log.error("disk writer process (pid %d) ended: %s; the daemon's threads write from here on "
                  "(%d jobs in its hands are written again)", self.pid, reason, len(jobs))
        self.on_lost(reason, jobs)

    def _exit_reason(self) -> str:
        if self._proc is None:
            return "it closed its end"
        try:
            code = self._proc.wait(2)
        except subprocess.TimeoutExpired:
            return "it closed its end"
        return f"it exited with status {code}" if code >= 0 else f"it was killed by signal {-code}"

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            log.error("disk writer process %d does not die", self._proc.pid)
