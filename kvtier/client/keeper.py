"""The client's background thread: keeps the session, never in an engine step's way.

- **Liveness from the kernel.** It waits on a pidfd of the daemon's process
  (its pid comes with WELCOME). When the process exits, the replies it sent
  last are filed (up to libzmq's hang-up) and every waiter resolves at once;
  no heartbeat has to be missed first.
- **A hung daemon** (stopped, deadlocked) answers nothing while its process
  lives: a ping every heartbeat period notices it after ``timeout`` and the
  client degrades, so engine calls stop waiting on it.
- **Reconnect quietly, with backoff.** While no daemon is there it only
  checks that the socket file exists (one ``stat``). It connects at once to
  a new socket file (a restarted daemon), otherwise retries a stale one after
  1, 2, 4, then every 8 s.

Engine threads never connect, retry or wait for any of this: while the
session is lost the client answers lookups with 0 and fails transfers at once.

Primitives: ``Keeper(channel, session, reopen, lose, timeout)``, ``.start()``,
``.stop()``, ``.alive``, ``.reconnects``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Callable

from ..protocol import messages as m
from ..waker import Waker
from .channel import Channel
from .errors import DaemonUnavailable, KVTierError
from .session import SESSION_LOST, Session, file_id

log = logging.getLogger("kvtier.client")
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)   # waits between connection attempts to one socket file
SETTLE_S = 2.0                     # after the daemon exited: how long its hang-up may take to show


class Keeper:
    def __init__(self, channel: Channel, session: Session, reopen: Callable[[float], None],
                 lose: Callable[[str], None], timeout: float, report: Callable[[float], bool] = lambda t: False):
        self.channel, self.session, self.reopen, self.lose = channel, session, reopen, lose
        self.report = report  # a beat's report of mirror lookups, sent in place of its ping when there is one
        self.timeout = timeout
        self.reconnects = 0
        self._stop = False
        self._waker = Waker()
        self._pidfd: int | None = None
        self._watched = 0                   # pid the pidfd refers to
        self._failed_file = None            # socket file identity of the last failed attempt
        self._tries = 0
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._run, name="kvtier-keeper", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._waker.wake()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._unwatch()
        self._waker.close()

    # ---- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._watch()
            fds = [self._waker.fd] + ([self._pidfd] if self._pidfd is not None else [])
            try:
                ready, _, _ = select.select(fds, [], [], self.session.heartbeat_s)
            except (OSError, ValueError):  # a descriptor closed under us at stop
                ready = []
            if self._stop:
                return
            if self._waker.fd in ready:
                self._waker.clear()
            try:
                if self._pidfd is not None and self._pidfd in ready:
                    self._daemon_exited()
                else:
                    self._beat()
            except Exception:  # if this thread died the client would never reconnect
                log.exception("kvtier: session keeper failed; trying again next period")

    def _watch(self) -> None:
        """Hold a pidfd of the daemon the session talks to (when its pid is known)."""
        daemon = self.session.daemon
        if daemon.pid == self._watched:
            return
        self._unwatch()
        if not daemon.known or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(daemon.pid)
        except OSError:  # gone already, or not visible: the ping and gone() decide
            return
        if daemon.gone():  # pid reused between WELCOME and here: not our daemon
            os.close(fd)
            return
        self._pidfd, self._watched = fd, daemon.pid

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pidfd, self._watched = None, 0

    def _daemon_exited(self) -> None:
        self._unwatch()
        self._watched = self.session.daemon.pid  # do not watch the dead pid again
        try:
            with self.channel.own(time.monotonic() + SETTLE_S):
                self.channel.settle(SETTLE_S)
        except DaemonUnavailable:  # another thread pumps: it files the replies and sees the hang-up
            pass
        self.lose("the daemon exited")

    # ---- one period -----------------------------------------------------------------------
    def _beat(self) -> None:
        """Ping while healthy; reconnect while not - but never replace a socket
        whose transfers the living daemon has not answered yet."""
        if self.session.healthy:
            self._ping(self.timeout if self.session.daemon.known else max(2 * self.session.heartbeat_s, 1.0))
            return
        if self.session.daemon.gone():
            lost = m.Error(int(SESSION_LOST), "daemon exited", "daemon")
            self.channel.fail_all(lost, transfers_too=True)
        elif self.session.transfers_waiting():
            try:  # same socket: the daemon may just have been slow
                self.channel.call(m.Ping(), timeout=min(self.timeout, 1.0))
                self.session.healthy = True
            except KVTierError:
                pass
            return
        self._reconnect()

    def _ping(self, timeout: float) -> None:
        try:
            if not self.report(timeout):
                self.channel.call(m.Ping(), timeout=timeout)
        except DaemonUnavailable as exc:
            self.lose(str(exc))
        except KVTierError as exc:
            if exc.code == SESSION_LOST:
                self.lose("the daemon no longer knows this client")

    def _reconnect(self) -> None:
        path = self.channel.path
        ident = None if path.startswith(("tcp://", "ipc://")) else file_id(path)
        if ident is None and not path.startswith(("tcp://", "ipc://")):
            return  # no socket file: no daemon to try
        now = time.monotonic()
        if ident == self._failed_file and now < self._next_try:
            return
        try:
            self.reopen(min(self.timeout, 1.0))
        except KVTierError:
            self._tries = self._tries + 1 if ident == self._failed_file else 1
            self._failed_file = ident
            self._next_try = now + BACKOFF_S[min(self._tries, len(BACKOFF_S)) - 1]
            return
        self._failed_file, self._tries = None, 0
        self.reconnects += 1
        log.warning("kvtier: reconnected to %s as client %d", path, self.session.client_id)
