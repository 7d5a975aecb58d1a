"""The one dispatch point: every frame from the ROUTER becomes exactly one
reply or one typed error, whatever it holds.

``Dispatcher.read_requests()`` drains a bounded batch from the ROUTER;
``Dispatcher.handle(identity, frame, frames)`` decodes, checks who asks and
what may be asked now, and runs the request's handler (``requests.py``).
Every exception maps to an error reply through ``replies.py`` (the one
mapping, shared with a load resumed after a lower tier's reads): the daemon
running out of descriptors, mappings or memory is ``EXHAUSTED`` for that
request alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections import Counter
from typing import Callable

import zmq

from ..protocol import messages as m
from ..protocol.codec import decode
from ..protocol.errors import ErrorCode, ProtocolError
from .guard import ConnectionGuard
from .listen import Listener
from .peers import peer_of_fd
from .replies import Replies
from .requests import REFUSED_WHILE_DRAINING, RequestHandlers
from .sessions import Sessions
from .state import DaemonError

log = logging.getLogger("kvtier.daemon")
UNREAD_LIMIT = 32 * 1024  # bytes of replies a peer has not read: no more stats for it
# (the kernel queue of a Unix connection whose peer reads nothing plateaus near 54 KiB here)
READ_BATCH = 256  # frames per loop turn, so completions and reaping stay timely


class Dispatcher:
    def __init__(self, config: Callable, listener: Listener, sessions: Sessions, handlers: RequestHandlers,
                 guard: ConnectionGuard, replies: Replies, stopping: Callable[[], bool], counters: Counter):
        self.config = config  # a getter: SIGHUP replaces the config whole
        self.listener, self.sessions, self.handlers, self.guard = listener, sessions, handlers, guard
        self.replies = replies
        self._stopping = stopping
        self.counters, self.errors = counters, replies.errors

    def read_requests(self) -> None:
        router = self.listener.router
        for _ in range(READ_BATCH):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.errors[ErrorCode.BAD_MESSAGE.name] += 1
                log.warning("dropped message with %d frames (expected identity + 1)", len(frames))
                if len(frames) > 2:
                    self.listener.send(frames[0].bytes, 0, m.Error(ErrorCode.BAD_MESSAGE,
                                                                   "expected exactly one frame", "client"))
                continue
            # The body as a buffer: its size is checked before a byte of it is copied.
            self.handle(frames[0].bytes, frames[1].buffer, frames)

    def handle(self, identity: bytes, frame: bytes, frames=()) -> None:
        """Every request gets a reply or an error.
        ``frames``: the received zmq frames (which connection sent a HELLO)."""
        config = self.config()
        req_id = 0
        client = self.sessions.clients.get(identity)
        try:
            try:
                req_id, msg = decode(frame, config.max_message)
            except ProtocolError as exc:
                req_id = exc.request_id  # answer under the caller's id when it was readable
                raise
            self.counters["requests"] += 1
            kind = type(msg)
            if kind not in m.REQUESTS:
                raise DaemonError(ErrorCode.UNKNOWN_OP, f"{msg.TAG!r} is not a request")
            # Nothing but HELLO before HELLO: PING's NOT_CONNECTED answer tells a forgotten
            # client to reconnect; stats and flush need to know who asks.
            if client is None and kind is not m.Hello:
                raise DaemonError(ErrorCode.NOT_CONNECTED, "say HELLO first")
            if self._stopping() and kind in REFUSED_WHILE_DRAINING:
                raise DaemonError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
            if client is not None:
                client.last_seen = time.monotonic()
            if kind is m.Stats and unread_bytes(srcfd_of(frames)) > UNREAD_LIMIT:
                # A peer that does not read its replies must not make the daemon queue
                # stats documents for it without bound: it gets none until it reads.
                self.counters["stats_withheld"] += 1
                return
            if kind is m.Hello:
                srcfd = srcfd_of(frames)
                # Hang-ups queued before this connection was accepted are applied
                # first: an old connection's close must not end the session
                # that now says HELLO on a reused descriptor number.
                self.guard.on_events()
                reply = self.handlers.hello(client, msg, identity, req_id, self._peer(srcfd, config.socket), srcfd)
                self.guard.hello(srcfd)
            else:
                reply = self.handlers.table[kind](client, msg, identity, req_id)
        except Exception as exc:  # a bug too: answered, logged, the loop serves on
            reply = self.replies.failure(exc, client, identity)
        if reply is not None:
            self.listener.send(identity, req_id, reply)

    @staticmethod
    def _peer(srcfd: int, endpoint: str):
        """Kernel credentials of a local (Unix socket) connection; None for TCP.
        A local connection that cannot be identified (already gone) is refused."""
        url = endpoint.startswith(("tcp://", "ipc://"))
        peer = None if url or srcfd is None or srcfd < 0 else peer_of_fd(srcfd, endpoint)
        if peer is None and not (url or _is_tcp(srcfd)):
            raise DaemonError(ErrorCode.UNAUTHORIZED, "cannot identify this connection's process")
        return peer


def _is_tcp(srcfd: int) -> bool:
    """True for a frame from the TCP endpoint: those sessions are anonymous
    (no kernel credentials exist)."""
    try:
        with socket.socket(fileno=os.dup(srcfd)) as s:
            return s.family in (socket.AF_INET, socket.AF_INET6)
    except OSError:
        return False


def srcfd_of(frames) -> int:
    """The connection a message came in on (-1 if libzmq cannot say)."""
    for frame in frames:
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:  # EINVAL for some frame kinds (e.g. empty ones)
            continue
        if fd >= 0:
            return fd
    return -1


def unread_bytes(fd: int) -> int:
    """Bytes sent on connection ``fd`` that the peer has not read yet (0 if
    unknown). Read-only ioctl on libzmq's descriptor: a reused number at worst
    gives a wrong count, never touches another connection."""
    if fd < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0
