"""systemd's notify protocol, without libsystemd.

A ``Type=notify`` service tells systemd how it is doing by sending datagrams
of ``KEY=value`` lines to the Unix socket named in ``$NOTIFY_SOCKET`` (a path,
or ``@name`` for the abstract namespace). We send:

  STATUS=<text>     at each startup step, so ``systemctl status`` shows progress
  READY=1, MAINPID  once the pool is mapped and the socket is listening
  WATCHDOG=1        from the poll loop, at half of ``$WATCHDOG_USEC``
  RELOADING=1       + MONOTONIC_USEC while applying SIGHUP, then READY=1 again
  STOPPING=1        when draining for shutdown

Without ``$NOTIFY_SOCKET`` every call is a cheap no-op, so the daemon runs
the same way by hand, under a test, or under systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("kvtier.daemon")


def socket_address(name: str) -> str | bytes:
    """``@foo`` is the abstract socket ``\\0foo``; anything else is a path."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


def sd_notify(state: str, name: str | None = None) -> bool:
    """Send one notification; False when there is no socket or sending failed."""
    name = os.environ.get("NOTIFY_SOCKET", "") if name is None else name
    if not name:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(state.encode(), socket_address(name))
        return True
    except OSError as exc:  # systemd gone or socket wrong: never fatal to the daemon
        log.debug("sd_notify %r failed: %s", state, exc)
        return False


class Notifier:
    """The daemon's view of its supervisor; every method is a no-op when unsupervised."""

    def __init__(self, env: dict | None = None):
        env = os.environ if env is None else env
        self.socket = env.get("NOTIFY_SOCKET", "")
        self.watchdog_s = watchdog_interval(env)
        self._next_ping = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.socket)

    def send(self, state: str) -> bool:
        return bool(self.socket) and sd_notify(state, self.socket)

    def status(self, text: str) -> None:
        self.send("STATUS=" + text.replace("\n", " "))

    def ready(self, text: str = "serving") -> None:
        self.send(f"READY=1\nSTATUS={text}\nMAINPID={os.getpid()}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=draining copies and stopping")

    def watchdog_tick(self, now: float | None = None) -> float:
        """Ping when half the watchdog period has passed; return seconds to the next ping."""
        if not self.watchdog_s or not self.socket:
            return float("inf")
        now = time.monotonic() if now is None else now
        if now >= self._next_ping:
            self.send("WATCHDOG=1")
            self._next_ping = now + self.watchdog_s / 2
        return self._next_ping - now


def watchdog_interval(env) -> float:
    """``$WATCHDOG_USEC`` in seconds, 0 when off or meant for another pid."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0") or 0)
    except ValueError:
        return 0.0
    if usec <= 0 or (pid and pid != os.getpid()):
        return 0.0
    return usec / 1e6
