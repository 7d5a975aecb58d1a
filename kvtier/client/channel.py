"""The client's connection: one DEALER socket, pumped by one thread at a time.

ZeroMQ sockets are not thread-safe. The thread that owns the socket sends,
polls and files every reply it reads into the ``Session``; other threads
queue their frames in the outbox (waking the owner) and wait on the
condition for their reply, so a thread blocked on a long transfer never
delays another thread's lookup.

Primitives: ``Channel(path, session)``, ``.open()``, ``.send(msg)``,
``.call(msg, timeout)``, ``.poll_reply(id, timeout)``, ``.abandon(id)``,
``.cancel(id)``, ``.own(deadline)`` (context manager), ``.close()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import zmq

from ..protocol import messages as m
from ..protocol.endpoints import endpoint
from ..waker import Waker
from .errors import DaemonUnavailable, KVTierError
from .handover import check_daemon_socket
from .session import Session, Unsent


class Channel:
    def __init__(self, path: str, session: Session, timeout: float, on_forgotten: Callable[[], None]):
        self.path, self.session, self.timeout = path, session, timeout
        self.on_forgotten = on_forgotten   # the daemon answered NOT_CONNECTED
        self.cv = threading.Condition(threading.Lock())  # guards session, outbox, owner
        self._owner: int | None = None
        self._depth = 0
        self._outbox: list[tuple[int, bytes, float]] = []
        self._waker = Waker()
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._poller = None

    # ---- ownership ------------------------------------------------------------------------
    def _take(self, deadline: float | None) -> bool:
        """Become the socket's owner (reentrant); False if another thread keeps it
        past ``deadline`` (None: do not wait)."""
        me = threading.get_ident()
        with self.cv:
            while self._owner not in (None, me):
                remaining = -1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cv.wait(remaining)
            self._owner = me
            self._depth += 1
            return True

    def _give(self) -> None:
        with self.cv:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self.cv.notify_all()  # a waiter may take over (and flush the outbox)

    @contextlib.contextmanager
    def own(self, deadline: float):
        if not self._take(deadline):
            raise DaemonUnavailable("another thread holds the connection")
        try:
            yield
        finally:
            self._give()

    # ---- socket -----------------------------------------------------------------------------
    def open(self) -> None:
        """A fresh socket (owner only)."""
        self.close_socket()
        check_daemon_socket(self.path)  # before any token or memory goes to it
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
        sock.connect(endpoint(self.path))
        self._sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._waker.fd, zmq.POLLIN)

    def close_socket(self) -> None:
        """Owner only."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = self._poller = None

    def close(self) -> None:
        self._waker.close()

    # ---- requests ---------------------------------------------------------------------------
    def send(self, msg, connect_wait: float | None = None) -> int:
        """Send (or queue for the socket's owner) one request; returns its id.
        Raises DaemonUnavailable when this thread sends and no daemon is there."""
        wait = min(self.timeout, 1.0) if connect_wait is None else connect_wait
        with self.cv:
            req_id, frame = self.session.request(msg)
            if self._owner not in (None, threading.get_ident()):
                self._outbox.append((req_id, frame, wait))
                self._waker.wake()  # the owner is in poll(): wake it to send
                return req_id
            self._owner = threading.get_ident()
            self._depth += 1
        try:
            self._flush()
            self._transmit(frame, wait)
        except DaemonUnavailable:
            with self.cv:
                self.session.abandon(req_id)
            raise
        finally:
            self._give()
        return req_id

    def call(self, msg, timeout: float | None = None, connect_wait: float | None = None):
        """Send and wait for the reply; raises DaemonUnavailable or KVTierError."""
        timeout = self.timeout if timeout is None else timeout
        req_id = self.send(msg, connect_wait)
        reply = self.poll_reply(req_id, timeout)
        if reply is None:
            self.abandon(req_id)
            raise DaemonUnavailable(f"no reply from {self.path} within {timeout}s")
        if isinstance(reply, Unsent):  # queued by us; the owner found no daemon to send it to
            raise DaemonUnavailable(str(reply))
        if isinstance(reply, m.Error):
            raise KVTierError(reply.code, reply.message, reply.side)
        return reply

    def cancel(self, req_id: int) -> None:
        """Ask the daemon to stop transfer ``req_id`` (its own reply confirms it)."""
        try:
            self.abandon(self.send(m.Cancel(req_id)))
        except DaemonUnavailable:
            pass  # the transfer's waiter goes on checking whether the daemon lives

    def abandon(self, req_id: int) -> None:
        with self.cv:
            self.session.abandon(req_id)

    def fail_all(self, reply, transfers_too: bool) -> None:
        with self.cv:
            self.session.fail_waiting(reply, transfers_too)
            self._outbox.clear()
            self.cv.notify_all()

    def pump(self, timeout: float) -> None:
        """File whatever replies arrive within ``timeout`` (for their waiters)."""
        self.poll_reply(0, timeout)  # request ids start at 1: this one never comes

    def poll_reply(self, req_id: int, timeout: float):
        """The reply for ``req_id`` if it arrives within ``timeout``, else None.
        Pumps the socket when no other thread does; otherwise waits to be told."""
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        while True:
            with self.cv:
                reply = self.session.take(req_id)
                if reply is not None:
                    return reply
                remaining = deadline - time.monotonic()
                if self._owner not in (None, me):
                    if remaining <= 0:
                        return None
                    self.cv.wait(remaining)  # the owner files replies and notifies
                    continue
                self._owner = me
                self._depth += 1
            try:
                self._pump(max(0.0, min(remaining, 0.1)))
            finally:
                self._give()
            if remaining <= 0:
                with self.cv:
                    return self.session.take(req_id)

    # ---- owner's work -----------------------------------------------------------------------
    def _transmit(self, frame: bytes, wait: float) -> None:
        """IMMEDIATE: writable only while a daemon is connected. Try at once (the
        common case costs no poll); else wait a bounded time (fresh socket,
        daemon restarting), then report it missing."""
        if self._sock is not None:
            try:
                self._sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        if self._sock is None or not self._sock.poll(int(wait * 1000), zmq.POLLOUT):
            raise DaemonUnavailable(f"no kvtier daemon at {self.path}")
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"no kvtier daemon at {self.path}") from None

    def _flush(self) -> None:
        """Send what other threads queued; a failure fails that request."""
        while True:
            with self.cv:
                if not self._outbox:
                    return
                req_id, frame, wait = self._outbox.pop(0)
            try:
                self._transmit(frame, wait)
            except DaemonUnavailable as exc:
                with self.cv:
                    self.session.fail(req_id, Unsent(str(exc)))
                    self.cv.notify_all()

    def _pump(self, slice_s: float) -> None:
        """Send queued frames, wait up to ``slice_s`` for traffic, file replies."""
        self._flush()
        if self._poller is None:
            time.sleep(min(slice_s, 0.05))
            return
        events = dict(self._poller.poll(int(slice_s * 1000)))
        if self._waker.fd in events:
            self._waker.clear()
            self._flush()
        if self._sock in events:
            self._drain()

    def _drain(self) -> None:
        """Read every reply available and hand each to its waiter."""
        forgotten = False
        sock = self._sock
        while sock.get(zmq.EVENTS) & zmq.POLLIN:  # no exception to end the loop
            frame = sock.recv(zmq.NOBLOCK)
            with self.cv:
                forgotten |= self.session.deliver(frame)
                self.cv.notify_all()
        if forgotten:
            # The daemon forgot us (restart, reaped): it answers nothing new on this
            # session; transfers still get their own final replies.
            self.on_forgotten()
