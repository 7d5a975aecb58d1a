"""Who is on the other end: kernel-verified peer credentials.

A client's uid, gid and pid come from ``SO_PEERCRED`` on its Unix socket,
never from what it says. For the ZeroMQ socket the daemon learns which
connection a frame came from (``ZMQ_SRCFD``) and asks the kernel about that
connection; for the hand-over socket it asks directly.

Primitives: ``Peer`` (uid, gid, pid, groups), ``peer_of(sock)``, ``uid_of(sock)``,
``peer_of_fd(fd, expect_path)``, ``groups_of(pid)``.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int
    groups: frozenset = frozenset()   # primary + supplementary gids (read at connect)


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(uid, gid, pid, frozenset({gid}) | groups_of(pid))


def uid_of(sock: socket.socket) -> int:
    """The peer's uid alone (one getsockopt, no /proc read)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


def peer_of_fd(fd: int, expect_path: str) -> Peer | None:
    """Credentials of the peer on connection ``fd`` (a libzmq-owned socket),
    or None when ``fd`` is no longer a connection accepted on ``expect_path``
    (closed in the meantime, number reused, or a TCP connection)."""
    if fd < 0:
        return None
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    with s:
        try:
            if s.family != socket.AF_UNIX or s.getsockname() != expect_path:
                return None
            return peer_of(s)
        except OSError:
            return None


def groups_of(pid: int) -> frozenset:
    """Supplementary groups of ``pid`` (empty if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()
