"""The client's session state, without sockets or threads (sans-IO).

It hands out request ids, remembers which requests wait for a reply and
which of them are transfers (their copy touches engine blocks until the
daemon's reply), files replies as frames come in, and decides what a lost
connection means for each waiter:

- a lookup, ping or stats waiter fails at once (the engine degrades);
- a transfer keeps waiting while the daemon process lives: only its reply,
  or the daemon's death, proves the daemon no longer touches its blocks.

The caller (``Channel``) feeds frames in and guards the object with its lock.

Primitives: ``Session.request(msg) -> (id, frame)``, ``.deliver(frame)``,
``.take(id)``, ``.abandon(id)``, ``.fail(id, reply)``, ``.welcome(msg)``,
``.lose(why)``, ``.transfers_waiting()``, ``DaemonProcess``.
"""

from __future__ import annotations

import itertools
import logging
import os

import psutil

from ..protocol import messages as m
from ..protocol.codec import decode, encode
from ..protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("kvtier.client")
SESSION_LOST = ErrorCode.NOT_CONNECTED


class Unsent(str):
    """Reply for a frame that never left this process (text: why); the daemon never saw it."""


class DaemonProcess:
    """The daemon as told at HELLO: its pid and start time (0: unknown, e.g. over
    TCP), and the socket file it serves. It is gone once the process died, or
    once that socket file was removed or replaced: a daemon removes it as the
    last step of its shutdown, after every copy it ran had stopped (this also
    covers a daemon embedded in a longer-lived process)."""

    def __init__(self, pid: int = 0, socket_path: str = ""):
        self.pid, self.start = pid, None
        if pid > 0:
            try:
                self.start = psutil.Process(pid).create_time()
            except (psutil.Error, ValueError, OverflowError):
                self.pid = 0  # not visible from here (other pid namespace): unknown
        self.socket_path, self.socket_id = socket_path, file_id(socket_path)

    @property
    def known(self) -> bool:
        return self.pid > 0

    def gone(self) -> bool:
        """True once the daemon is confirmed gone (never for an unknown pid)."""
        if not self.known:
            return False
        if self.socket_id is not None and file_id(self.socket_path) != self.socket_id:
            return True
        try:
            p = psutil.Process(self.pid)
            return p.create_time() != self.start or p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


def file_id(path: str) -> tuple[int, int] | None:
    if not path or path.startswith(("tcp://", "ipc://")):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Session:
    def __init__(self):
        self._ids = itertools.count(1)
        self.waiting: set[int] = set()
        self.transfers: set[int] = set()   # waiting ids whose reply ends a copy
        self.replies: dict[int, object] = {}
        self.healthy = False
        self.client_id = 0
        self.heartbeat_s = 1.0
        self.max_message = m.MAX_MESSAGE_BYTES
        self.daemon = DaemonProcess()

    def request(self, msg) -> tuple[int, bytes]:
        req_id = next(self._ids)
        frame = encode(msg, req_id)
        self.waiting.add(req_id)
        if type(msg) in m.TRANSFERS:
            self.transfers.add(req_id)
        return req_id, frame

    def deliver(self, frame: bytes) -> bool:
        """File one reply frame. True when the daemon says it forgot this client."""
        try:
            rid, reply = decode(frame, 1 << 30)
        except ProtocolError as exc:  # never the engine's problem: its caller times out
            log.warning("kvtier: dropped an undecodable reply from the daemon: %s", exc)
            return False
        if rid in self.waiting:
            self.replies[rid] = reply
        return isinstance(reply, m.Error) and reply.code == SESSION_LOST

    def take(self, req_id: int):
        """The reply for ``req_id`` if it arrived (and forget the request), else None."""
        if req_id not in self.replies:
            return None
        self.waiting.discard(req_id)
        self.transfers.discard(req_id)
        return self.replies.pop(req_id)

    def abandon(self, req_id: int) -> None:
        self.waiting.discard(req_id)
        self.transfers.discard(req_id)
        self.replies.pop(req_id, None)

    def fail(self, req_id: int, reply) -> None:
        if req_id in self.waiting:
            self.replies.setdefault(req_id, reply)

    def welcome(self, msg: m.Welcome, socket_path: str = "") -> None:
        self.client_id, self.heartbeat_s, self.max_message = msg.client_id, msg.heartbeat_s, msg.max_message
        self.daemon = DaemonProcess(msg.daemon_pid, socket_path)

    def transfers_waiting(self) -> set[int]:
        return self.transfers - set(self.replies)

    def lose(self, why: str, daemon_gone: bool = False) -> bool:
        """The connection is gone or the daemon forgot us. Fails every waiter
        that may fail now; transfers wait for their reply unless the daemon
        is confirmed dead (or cannot be checked). True if it was healthy."""
        was = self.healthy
        self.healthy = False
        lost = m.Error(int(SESSION_LOST), f"daemon connection lost: {why}", "daemon")
        self.fail_waiting(lost, transfers_too=daemon_gone or not self.daemon.known)
        return was

    def fail_waiting(self, reply, transfers_too: bool) -> None:
        """Resolve every waiter with ``reply``; transfers only if ``transfers_too``
        (nothing can touch their blocks any more)."""
        for rid in self.waiting:
            if transfers_too or rid not in self.transfers:
                self.fail(rid, reply)
