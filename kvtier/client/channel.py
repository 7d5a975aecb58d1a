"""The client's connection: one DEALER socket, pumped by one thread at a time.

ZeroMQ sockets are not thread-safe. The thread that owns the socket sends,
polls and files every reply it reads into the ``Session``; other threads
queue their frames in the outbox (waking the owner) and wait on the
condition for their reply, so a thread blocked on a long transfer never
delays another thread's lookup.

The socket's connection state comes from libzmq's monitor (connected,
hung up), read by the owner with the replies: a hang-up is acted on only
after every reply that arrived before it has been filed.

Primitives: ``Channel(path, session)``, ``.open()``, ``.send(msg)``,
``.call(msg, timeout)``, ``.poll_reply(id, timeout)``, ``.pump(timeout)``,
``.settle(limit)``, ``.abandon(id)``, ``.cancel(id)``, ``.own(deadline)``
(context manager), ``.close()``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..protocol import messages as m
from ..protocol.endpoints import endpoint
from ..waker import Waker
from .errors import DaemonUnavailable, KVTierError
from .handover import check_daemon_socket
from .session import Session, Unsent


class Channel:
    def __init__(self, path: str, session: Session, timeout: float, on_forgotten: Callable[[], None],
                 on_hangup: Callable[[], None] = lambda: None):
        self.path, self.session, self.timeout = path, session, timeout
        self.on_forgotten = on_forgotten   # the daemon answered NOT_CONNECTED
        self.on_hangup = on_hangup         # the connection closed (its replies are filed first)
        self.link_up = False               # libzmq holds a connection to the daemon now
        self.cv = threading.Condition(threading.Lock())  # guards session, outbox, owner
        self._owner: int | None = None
        self._depth = 0
        self._outbox: list[tuple[int, bytes]] = []
        self._waker = Waker()
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._monitor = None
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
        # Not ZMQ_IMMEDIATE: with it libzmq throws away replies that arrived but
        # were not read yet when the daemon hangs up (its last answers before an
        # exit). Frames sent while no daemon is connected are queued instead;
        # whether anyone will answer them is the session's call (kernel liveness).
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint(self.path))
        self._sock, self.link_up = sock, False
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._waker.fd, zmq.POLLIN)

    def close_socket(self) -> None:
        """Owner only."""
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            self._sock = self._monitor = self._poller = None
            self.link_up = False

    def close(self) -> None:
        self._waker.close()

    # ---- requests ---------------------------------------------------------------------------
    def send(self, msg) -> int:
        """Send (or queue for the socket's owner) one request; returns its id.
        Never waits: raises DaemonUnavailable when this thread sends and the
        frame cannot be queued (no socket, send queue full)."""
        with self.cv:
            req_id, frame = self.session.request(msg)
            if self._owner not in (None, threading.get_ident()):
                self._outbox.append((req_id, frame))
                self._waker.wake()  # the owner is in poll(): wake it to send
                return req_id
            self._owner = threading.get_ident()
            self._depth += 1
        try:
            self._flush()
            self._transmit(frame)
        except DaemonUnavailable:
            with self.cv:
                self.session.abandon(req_id)
            raise
        finally:
            self._give()
        return req_id

    def call(self, msg, timeout: float | None = None):
        """Send and wait for the reply; raises DaemonUnavailable or KVTierError."""
        timeout = self.timeout if timeout is None else timeout
        req_id = self.send(msg)
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

    def cancel_and_confirm(self, limit: float | None, only: set[int] | None = None) -> bool:
        """Cancel every transfer in flight (``only``: those of these ids); True
        once each is answered or the daemon is gone, False past ``limit`` s."""
        with self.cv:
            waiting = self.session.transfers_waiting()
            pending = sorted(waiting & only if only is not None else waiting)
        for rid in pending:
            self.cancel(rid)
        deadline = None if limit is None else time.monotonic() + limit
        while pending and not self.session.daemon.gone():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.pump(0.05)  # replies are filed for their handles
            with self.cv:
                pending = [r for r in pending if r in self.session.waiting and r not in self.session.replies]
        return True

    def pump(self, timeout: float) -> None:
        """File whatever replies arrive within ``timeout`` (for their waiters)."""
        self.poll_reply(0, timeout)  # request ids start at 1: this one never comes

    def settle(self, limit: float) -> None:
        """The daemon's process is gone: file what it sent before it hung up.
        libzmq reads a connection up to its end before reporting the hang-up,
        so once the monitor said so, every last reply is in our socket."""
        deadline = time.monotonic() + limit
        while self.link_up and time.monotonic() < deadline:
            self.pump(0.05)
        self.pump(0.0)

    def wake(self) -> None:
        """Make the owner's poll return (a waiter was resolved from outside)."""
        self._waker.wake()

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
    def _transmit(self, frame: bytes) -> None:
        """Queue one frame without waiting: a full queue (thousands of frames no
        daemon took) means nobody is reading them."""
        if self._sock is None:
            raise DaemonUnavailable(f"no connection to {self.path}")
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"no kvtier daemon reads from {self.path}") from None

    def _flush(self) -> None:
        """Send what other threads queued; a failure fails that request."""
        while True:
            with self.cv:
                if not self._outbox:
                    return
                req_id, frame = self._outbox.pop(0)
            try:
                self._transmit(frame)
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
        if self._monitor is not None and self._monitor in events:
            self._link_events()

    def _link_events(self) -> None:
        """Follow the connection's state; on a hang-up, file the replies that
        came before it, then tell the client."""
        hung_up = False
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self.link_up = event == zmq.EVENT_CONNECTED
            hung_up |= event == zmq.EVENT_DISCONNECTED
        if hung_up:
            self._drain()
            self.on_hangup()

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
