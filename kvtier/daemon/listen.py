"""The daemon's sockets: the lock that makes it the only daemon on a path,
the ROUTER clients connect to, and the optional event PUB socket.

Primitives: ``take_socket_lock(path) -> fd | None``, ``Listener(config)``
with ``.router``, ``.pub``, ``.send(identity, req_id, msg)``, ``.close()``.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os

import zmq

from ..protocol.codec import encode
from ..protocol.endpoints import endpoint
from .config import DaemonConfig

log = logging.getLogger("kvtier.daemon")
FINAL_REPLY_LINGER_MS = 1000  # at exit, give queued final replies this long to leave


class StartupError(RuntimeError):
    """The daemon cannot start (message says why): exit 1, systemd may retry."""

    exit_code = 1


class UnfitConfig(StartupError):
    """The configuration can never work on this machine (e.g. a pool larger
    than RAM allows): exit 2, which the unit's RestartPreventExitStatus honours."""

    exit_code = 2


def take_socket_lock(path: str) -> int | None:
    """Hold ``PATH.lock`` for the daemon's life (None for tcp:// and ipc:// URLs)."""
    if path.startswith(("tcp://", "ipc://")):
        return None
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o750, exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartupError(f"another kvtier-daemon is serving {path}") from None
    return fd


class Listener:
    def __init__(self, config: DaemonConfig, owns_path: bool):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.router.setsockopt(zmq.RCVHWM, 100_000)
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message)  # hard backstop
        if owns_path and os.path.exists(config.socket):
            os.unlink(config.socket)  # we hold the lock: the old daemon is gone
        old = os.umask(0o777 & ~config.socket_mode)
        try:
            self.router.bind(endpoint(config.socket))
        finally:
            os.umask(old)
        if owns_path:
            os.chmod(config.socket, config.socket_mode)
            if config.socket_group:
                try:
                    os.chown(config.socket, -1, grp.getgrnam(config.socket_group).gr_gid)
                except (KeyError, PermissionError) as exc:
                    self.close()
                    raise StartupError(f"socket_group {config.socket_group!r}: {exc}") from None
        if config.tcp:
            self.router.bind(config.tcp)
        self.pub = None
        if config.events:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(endpoint(config.events))

    def send(self, identity: bytes, req_id: int, reply) -> None:
        try:
            self.router.send_multipart([identity, encode(reply, req_id)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    def close(self) -> None:
        # Final replies (drained transfers) may still sit in the queue: let them leave.
        self.router.close(FINAL_REPLY_LINGER_MS)
        if self.pub is not None:
            self.pub.close(0)
        self.ctx.term()
