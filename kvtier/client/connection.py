"""One ZeroMQ link to the daemon, and the cache registrations on it.

A ``Connection`` owns what a process needs once per daemon, however many KV
caches it registers: the ``Channel`` (socket), the ``Session`` (request ids,
waiters), the ``Keeper`` thread (liveness, reconnects) and the degraded mode.
Each cache is a registration on it (a ``Client``): its own REGISTER, mirror,
transfers and swap quota. A hybrid model's KV cache groups, one per
namespace, cost one connection and one keeper thread per process, not one per
group - the shape pyzmq and redis-py use (a context or pool, and handles on it).

The connection never looks inside a registration beyond the small protocol
it needs: ``replay(wait)`` after a reconnect, and ``closed``. It closes with
its last registration (``Client.close``), or at once with ``close()``.

Primitives: ``Connection(socket, ...)``, ``.attach(reg)``, ``.detach(reg)``,
``.call(msg)``, ``.degrade(call, default)``, ``.lose_session(why)``,
``.close(timeout)``, ``.connected``, ``.client_id``, ``.reconnects``,
``.stats()``, ``.flush(ns)``, ``.ping()``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Protocol

from ..protocol import messages as m
from ..protocol.endpoints import default_socket
from ..protocol.errors import ErrorCode
from .channel import Channel
from .errors import DaemonUnavailable, KVTierError
from .keeper import Keeper
from .session import SESSION_LOST, Session
from .tally import Tally

log = logging.getLogger("kvtier.client")
DEGRADED = (SESSION_LOST, ErrorCode.SHUTTING_DOWN)  # answers that mean "no daemon for now"
# A transfer carries the mirror's counts at most this often (s): one report ahead of every
# store and load was one more message each way, ~0.05 ms of a 4 KiB-block store here
# (BENCHMARKS 20.4). Management calls, pings, heartbeats and a close still report at once.
REPORT_EVERY = 0.2


class Registered(Protocol):
    """What the connection needs of a cache registered on it."""

    closed: bool
    tally: Tally                         # lookups its mirror answered, for the next report
    registration: "m.Registered | None"  # None while degraded

    def replay(self, wait: float) -> None:
        """REGISTER again on a new session (no-op before the first register)."""


class Connection:
    def __init__(self, socket: str | None = None, *, name: str = "", timeout: float = 5.0,
                 transfer_timeout: float = 60.0, token: str = "", heartbeat: bool = True,
                 require_daemon: bool = True):
        """Connect and say HELLO. With ``require_daemon=False`` a missing daemon
        is not an error: the connection starts degraded (waiting at most 1 s for
        a socket file nobody answers) and connects when one appears."""
        self.socket_path = socket or default_socket()
        self.name = name or f"pid{os.getpid()}"
        self.timeout, self.transfer_timeout = timeout, transfer_timeout
        self.token = token or os.environ.get("KVTIER_TOKEN", "")  # same variable as the daemon's
        self.session = Session()
        self.channel = Channel(self.socket_path, self.session, timeout, self._forgotten,
                               lambda: self.lose_session("the daemon hung up"))
        self.registrations: list[Registered] = []
        self.closed = False
        self._reported = 0.0  # monotonic time of the last report sent (piggyback's rate)
        try:
            self._open_session(self.timeout if require_daemon else min(self.timeout, 1.0))
        except DaemonUnavailable:
            if require_daemon:
                self.channel.close()
                raise
        self.keeper = None
        if heartbeat:
            self.keeper = Keeper(self.channel, self.session, self._open_session, self.lose_session, self.timeout,
                                 report=self.report)
            self.keeper.start()

    # ---- registrations on it ----------------------------------------------------------
    def attach(self, reg: Registered) -> None:
        """Add a cache to this connection. Raises KVTierError once it is closed."""
        with self.channel.cv:
            if self.closed:
                raise KVTierError(ErrorCode.UNKNOWN_NAMESPACE, "this client's connection is closed", "client")
            self.registrations.append(reg)

    def detach(self, reg: Registered) -> None:
        with self.channel.cv:
            if reg in self.registrations:
                self.registrations.remove(reg)

    # ---- session ----------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.session.healthy

    @property
    def client_id(self) -> int:
        return self.session.client_id

    @property
    def reconnects(self) -> int:
        return self.keeper.reconnects if self.keeper is not None else 0

    def _open_session(self, wait: float) -> None:
        """New socket, HELLO, replay every registration. Raises DaemonUnavailable."""
        if not self.socket_path.startswith(("tcp://", "ipc://")) and not os.path.exists(self.socket_path):
            # No socket file: no daemon to wait for (engines starting degraded do not stall).
            raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path} (no such socket)")
        with self.channel.own(time.monotonic() + wait):
            self.channel.open()
            try:
                pid = 0 if self.socket_path.startswith("tcp://") else os.getpid()
                welcome = self.channel.call(m.Hello(m.PROTOCOL_VERSION, pid, self.name, self.token), timeout=wait)
                with self.channel.cv:
                    self.session.welcome(welcome, self.socket_path)
                    regs = list(self.registrations)
                for reg in regs:
                    if not reg.closed:
                        reg.replay(wait)
            except KVTierError:
                # Frames queued on this socket must not reach a daemon that starts later.
                self.channel.close_socket()
                raise
            self.session.healthy = True

    def lose_session(self, why: str) -> None:
        """Mark the daemon gone: waiters that may fail now resolve as failed."""
        gone = self.session.daemon.gone()
        if gone:  # its last answers may already sit in our socket: file them first
            self.channel.pump(0.0)
        with self.channel.cv:
            was = self.session.lose(why, daemon_gone=gone)
            self.channel.cv.notify_all()
        self.channel.wake()  # a thread pumping the socket sees its waiter resolved at once
        if was:
            log.warning("kvtier: %s; degrading (0 hits, transfers fail) until it is back", why)

    def _forgotten(self) -> None:
        self.lose_session("the daemon no longer knows this client")

    def degrade(self, call: Callable, default):
        """Run a data-path call; a missing or draining daemon gives ``default``, not an error."""
        if not self.session.healthy:
            return default
        try:
            return call()
        except DaemonUnavailable as exc:
            self.lose_session(str(exc))
        except KVTierError as exc:
            if exc.code not in DEGRADED:
                raise
        return default

    def call(self, msg, timeout: float | None = None):
        self.piggyback(every=0.0)
        return self.channel.call(msg, timeout=timeout)

    # ---- management --------------------------------------------------------------------
    def stats(self, check: bool = False) -> dict:
        """The daemon's stats document; ``check`` also verifies pool integrity."""
        return self.call(m.Stats(check)).stats

    def flush(self, fingerprint: str = "", timeout: float | None = None) -> int:
        """Blocks removed; the reply comes once all are freed (``timeout``: how long to wait for it)."""
        return self.call(m.Flush(fingerprint), timeout=timeout).removed

    def ping(self) -> None:
        if not self.report(self.timeout):  # a report is a round trip too
            self.channel.call(m.Ping())

    def _tallies(self, only=None) -> tuple[list, list]:
        """(taken, rows): each cache's mirror counts since the last report, taken, and the report's rows."""
        taken = [(r, r.tally.take()) for r in list(self.registrations)
                 if (only is None or r is only) and r.tally.lookups]
        return taken, [[reg.reg, *counts] for r, counts in taken if (reg := r.registration) is not None]

    def piggyback(self, every: float | None = None) -> None:
        """Send the mirror's counts ahead of the request about to go, not waiting for their
        reply (the daemon reads its socket in order: by that request's reply, they count),
        unless a report went less than ``every`` s ago (None, a transfer's: ``REPORT_EVERY``)."""
        every = REPORT_EVERY if every is None else every
        if every and time.monotonic() - self._reported < every:
            return
        taken, rows = self._tallies()
        if not rows:
            return
        try:
            self._reported = time.monotonic()
            self.channel.abandon(self.channel.send(m.LookupsAnswered(rows)))
        except DaemonUnavailable:  # never sent: the next report carries them
            for r, counts in taken:
                r.tally.give_back(counts)

    def report(self, timeout: float, only=None) -> bool:
        """Send what the caches' lookup mirrors answered since the last report (``tally.py``;
        ``only``: one cache's); False when there was nothing to send. Counts of a report the
        daemon never got are given back for the next; one it refused is dropped (logged)."""
        taken, rows = self._tallies(only)
        if not rows:
            return False
        try:
            self._reported = time.monotonic()
            self.channel.call(m.LookupsAnswered(rows), timeout=timeout)
        except DaemonUnavailable:
            for r, counts in taken:
                r.tally.give_back(counts)
            raise
        except KVTierError as exc:
            log.warning("kvtier: the daemon refused this client's lookup counts (%s)", exc)
        return True

    # ---- the end ------------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> bool:
        """Cancel every transfer in flight, wait until the daemon confirmed each
        cancel (or its process is gone), say BYE, close. False (nothing closed,
        the handles still pending) if the confirmations take past ``timeout``."""
        if self.closed:
            return True
        if not self.channel.cancel_and_confirm(timeout):
            log.error("kvtier: close: the daemon has not confirmed every cancelled transfer; "
                      "their blocks stay held and the client stays open")
            return False
        with self.channel.cv:
            self.closed = True
        if self.keeper is not None:
            self.keeper.stop()
        if self.session.healthy:
            try:
                self.report(min(self.timeout, 1.0))  # the last lookups the mirrors answered
                self.channel.call(m.Bye(), timeout=min(self.timeout, 1.0))
            except KVTierError:
                pass
        try:
            with self.channel.own(time.monotonic() + self.timeout):
                self.channel.close_socket()
        except DaemonUnavailable:
            pass
        lost = m.Error(int(SESSION_LOST), "client closed", "client")
        self.channel.fail_all(lost, transfers_too=True)  # none is left that the daemon may touch
        self.session.healthy = False
        self.channel.close()
        return True
