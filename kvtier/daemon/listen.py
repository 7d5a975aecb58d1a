"""The daemon's sockets: the lock that makes it the only daemon on a path,
the ROUTER clients connect to, and the optional event PUB socket.

Primitives: ``take_socket_lock(path) -> fd | None``, ``check_socket_dir``,
``remove_our_socket``, ``Listener(config)`` with ``.router``, ``.pub``,
``.handover`` (descriptor hand-over, None for URL endpoints),
``.send(identity, req_id, msg)``, ``.publish(frames) -> bool``, ``.close()``.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os

import zmq

from ..ownership import distrust, ours, ours_or_root
from ..protocol.codec import encode
from ..protocol.endpoints import endpoint
from .config import DaemonConfig, admin_gid
from .handover import Handover
from .operators import bind_private_ipc

HANDOVER_SUFFIX = ".fd"  # the hand-over socket lives next to the ZeroMQ socket

log = logging.getLogger("kvtier.daemon")
FINAL_REPLY_LINGER_MS = 1000  # at exit, give queued final replies this long to leave
# Per event subscriber: messages the daemon holds for it (each at most MAX_EVENTS_PER_MESSAGE
# events, ~15 KiB) before it drops - and counts - new ones. 256 x 15 KiB: ~4 MiB per subscriber.
EVENTS_HWM = 256


class StartupError(RuntimeError):
    """The daemon cannot start (message says why): exit 1, systemd may retry."""

    exit_code = 1


class UnfitConfig(StartupError):
    """The configuration can never work on this machine (e.g. a pool larger
    than RAM allows): exit 2, which the unit's RestartPreventExitStatus honours."""

    exit_code = 2


def take_socket_lock(path: str) -> int | None:
    """Hold ``PATH.lock`` for the daemon's life (None for tcp:// and ipc:// URLs).

    The directory must be ours (or root's) and closed to writes by others,
    or whoever can write there could swap our socket for theirs; the lock
    file is opened without following links and its mode set on the open file."""
    if path.startswith(("tcp://", "ipc://")):
        return None
    check_socket_dir(os.path.dirname(os.path.abspath(path)))
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:  # ELOOP: a symlink planted where the lock goes
        raise StartupError(f"lock file {path}.lock: {exc.strerror}") from None
    why = distrust(os.fstat(fd), "regular file", ours(), deny=0)  # its mode is set just below
    if why:
        os.close(fd)
        raise StartupError(f"lock file {path}.lock is not a regular file of ours ({why}); remove it")
    os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartupError(f"another kvtier-daemon is serving {path}") from None
    return fd


def check_socket_dir(d: str) -> None:
    """Create ``d`` (0750) if missing; refuse one we do not own or others may write to."""
    try:
        os.makedirs(d, mode=0o750, exist_ok=True)
        st = os.lstat(d)
    except OSError as exc:
        raise StartupError(f"socket directory {d}: {exc.strerror}") from None
    why = distrust(st, "directory", ours_or_root())  # an lstat: a link is not a directory
    if why:
        raise StartupError(f"socket directory {d}: {why}: someone else could swap the socket")


def remove_our_socket(path: str) -> None:
    """Unlink a stale socket we left (we hold the lock) - and nothing else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = distrust(st, "socket", ours(), deny=0)
    if why:
        raise StartupError(f"{path} exists and is not a socket of ours ({why}); refusing to remove it")
    os.unlink(path)


class Listener:
    def __init__(self, config: DaemonConfig, owns_path: bool):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # Per peer: a peer that reads nothing can make the daemon hold at most this many
        # replies (mostly tens of bytes; stats are withheld from such a peer, server.py).
        self.router.setsockopt(zmq.SNDHWM, 10_000)
        # Per peer: frames read from its connection but not yet handled. Past it libzmq stops
        # reading that connection (the sender waits), so one peer's flood of 16 MiB frames
        # costs at most max_queued_frames of them, not 100,000 (it used to: GiBs of RSS).
        self.router.setsockopt(zmq.RCVHWM, config.max_queued_frames)
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_message)  # hard backstop
        if owns_path:  # we hold the lock: the old daemon is gone
            remove_our_socket(config.socket)
            remove_our_socket(config.socket + HANDOVER_SUFFIX)
        old = os.umask(0o777 & ~config.socket_mode)
        try:
            self.router.bind(endpoint(config.socket))
        finally:
            os.umask(old)
        self.handover = None
        if owns_path:
            os.chmod(config.socket, config.socket_mode)
            gid = None
            if config.socket_group:
                try:
                    gid = grp.getgrnam(config.socket_group).gr_gid
                    os.chown(config.socket, -1, gid)
                except (KeyError, PermissionError) as exc:
                    self.close()
                    raise StartupError(f"socket_group {config.socket_group!r}: {exc}") from None
            self.handover = Handover(config.socket + HANDOVER_SUFFIX, config.socket_mode, gid,
                                     config.max_handovers_per_user)
        if config.tcp:
            self.router.bind(config.tcp)
        self.pub = None
        if config.events:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            # A subscriber that never reads must not grow the daemon: at most EVENTS_HWM messages
            # wait for it; past that a send fails (NODROP: a plain PUB would drop silently, and
            # what was dropped could not be counted) and the daemon counts the drop.
            self.pub.setsockopt(zmq.SNDHWM, EVENTS_HWM)
            self.pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._bind_events(config)

    def _bind_events(self, config: DaemonConfig) -> None:
        """Every tenant's block hashes: an ipc socket only operators can connect to
        (operators.py); a tcp endpoint cannot be restricted by user, and the log says so."""
        if config.events.startswith("tcp://"):
            self.pub.bind(config.events)
            log.warning("events on %s: whoever reaches that address reads every tenant's block events "
                        "(an ipc path limits them to root, the daemon's user and admin_group)", config.events)
            return
        path = config.events.removeprefix("ipc://")
        gid = admin_gid(config.admin_group) if config.admin_group else None
        try:
            bind_private_ipc(self.pub, path, gid)
        except PermissionError as exc:
            self.close()
            raise StartupError(f"events {path}: cannot give it to admin_group {config.admin_group!r}: {exc}") \
                from None

    def send(self, identity: bytes, req_id: int, reply) -> None:
        try:
            self.router.send_multipart([identity, encode(reply, req_id)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    def publish(self, frames: list[bytes]) -> bool:
        """One event message, never blocking; False when a subscriber's queue is full
        (the message went to no one: with NODROP a send is all or nothing)."""
        try:
            self.pub.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        if self.handover is not None:
            self.handover.close()
        # Final replies (drained transfers) may still sit in the queue: let them leave.
        self.router.close(FINAL_REPLY_LINGER_MS)
        if self.pub is not None:
            self.pub.close(0)
        self.ctx.term()
