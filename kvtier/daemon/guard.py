"""Connection bounds the ZeroMQ socket cannot enforce by itself.

libzmq accepts every connection and has no cap; ~1,000 silent connections
used to exhaust the daemon's descriptors until libzmq aborted. The guard
watches the ROUTER's monitor (each accepted connection's fd), asks the
kernel whose it is (``SO_PEERCRED``), and cuts (``shutdown``) a connection
that is over the total or per-user cap, or that has not said HELLO by
``hello_deadline_s``. libzmq then sees the hang-up and closes its fd.
At startup ``fd_headroom`` raises the descriptor limit and refuses a limit
too low for the configured caps, and ``map_headroom`` refuses a
``vm.max_map_count`` too low for ``max_mappings`` plus the daemon's own.

What the daemon holds per user, all capped: ZeroMQ connections
(``max_connections_per_user``), unanswered hand-over connections
(``max_handovers_per_user``), unused hand-over tickets and their
descriptors (8 x 16), memory mappings (``max_mappings_per_user``; a mapping
keeps no descriptor). The totals over all users fit the process limits.

It also tells the sessions when a connection closed (``on_closed(fd)``):
that, and the process's exit, is how a local client's session ends.

Primitives: ``ConnectionGuard(router, path, config, on_closed)``, ``.fd`` (poll it),
``.on_events()``, ``.hello(fd)``, ``.expire(now)``, ``.close()``,
``fd_headroom(config)``, ``map_headroom(config)``, ``fd_need(config)``, ``map_need(config)``.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..pool.index import MAX_NAMESPACES
from .config import DaemonConfig
from .handover import MAX_FDS, MAX_PENDING, MAX_TICKETS
from .peers import peer_of_fd

log = logging.getLogger("kvtier.daemon")
BASE_FDS = 256  # the daemon's own: pool, logs, CUDA, metrics, copy threads' wakeups, slack
BASE_MAPPINGS = 8192  # the daemon's own (~400 measured on CPU: libraries, thread stacks, arenas; CUDA adds many)
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


@dataclass
class Conn:
    uid: int | None
    since: float
    helloed: bool = False


def fd_headroom(config: DaemonConfig) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one; the limit, or an
    error message when it cannot hold every connection and ticket we allow."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    need = fd_need(config)
    if soft != resource.RLIM_INFINITY and soft < need:
        raise ValueError(f"the descriptor limit ({soft}) cannot hold max_connections "
                         f"({config.max_connections}) plus hand-overs; need {need}: raise LimitNOFILE "
                         "or lower max_connections")
    return soft


def fd_need(config: DaemonConfig) -> int:
    """Descriptors the daemon may hold with every cap reached (mappings hold none)."""
    return config.max_connections + MAX_PENDING + MAX_TICKETS * MAX_FDS + BASE_FDS


def map_need(config: DaemonConfig) -> int:
    """Memory mappings the daemon may hold with every cap reached."""
    return config.max_mappings + (MAX_NAMESPACES if config.lookup_index else 0) + BASE_MAPPINGS


def map_headroom(config: DaemonConfig, path: str = MAX_MAP_COUNT) -> int:
    """The kernel's per-process mapping limit, or an error message when
    ``max_mappings`` plus lookup mirrors plus the daemon's own would not fit
    (past it every mmap fails, torch's and Python's allocations included)."""
    try:
        with open(path) as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return 0  # not Linux, or hidden: nothing to check against
    need = map_need(config)
    if limit < need:
        raise ValueError(f"vm.max_map_count ({limit}) cannot hold max_mappings ({config.max_mappings}) plus the "
                         f"daemon's own; need {need}: raise vm.max_map_count or lower max_mappings")
    return limit


class ConnectionGuard:
    def __init__(self, router: zmq.Socket, path: str, config: Callable[[], DaemonConfig],
                 on_closed: Callable[[int], None] = lambda fd: None):
        self.path, self.config = path, config
        self.on_closed = on_closed  # the sessions: the ones said HELLO on that connection end
        self.monitor = router.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.fd = self.monitor
        self.conns: dict[int, Conn] = {}
        self.counters: Counter = Counter()

    def on_events(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = ev["value"]
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:
                self.conns.pop(fd, None)
                self.on_closed(fd)

    def _accepted(self, fd: int) -> None:
        config = self.config()
        peer = peer_of_fd(fd, self.path)
        uid = peer.uid if peer is not None else None
        conn = Conn(uid, time.monotonic())
        self.conns[fd] = conn
        mine = sum(1 for c in self.conns.values() if c.uid == uid)
        if len(self.conns) > config.max_connections:
            self._cut(fd, f"over max_connections ({config.max_connections})")
        elif mine > config.max_connections_per_user:
            self._cut(fd, f"uid {uid} over max_connections_per_user ({config.max_connections_per_user})")

    def hello(self, fd: int) -> None:
        # libzmq queues ACCEPTED at accept time, before the handshake that must
        # precede any frame: reading the monitor now finds this connection.
        self.on_events()
        conn = self.conns.get(fd)
        if conn is not None:
            conn.helloed = True

    def expire(self, now: float) -> None:
        limit = self.config().hello_deadline_s
        for fd, conn in list(self.conns.items()):
            if not conn.helloed and now - conn.since > limit:
                self._cut(fd, f"no HELLO within {limit:g}s")

    def _cut(self, fd: int, why: str) -> None:
        """Hang up connection ``fd`` under libzmq (it closes its end on EOF)."""
        self.conns.pop(fd, None)
        self.counters["connections_cut"] += 1
        try:
            dup = os.dup(fd)
        except OSError:
            return
        try:
            with socket.socket(fileno=dup) as s:
                # The number may have been reused since the event: cut only our own kind.
                if s.family == socket.AF_UNIX and s.getsockname() != self.path:
                    return
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        log.warning("closed a connection: %s", why)

    def close(self) -> None:
        self.monitor.close(0)
