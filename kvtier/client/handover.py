"""Engine side of the trust boundary: is this the real daemon, and hand it memory.

Before a client sends anything (a token, its memory) it checks that the
socket belongs to the daemon's user: the socket file and its directory are
owned by an expected uid and the directory is not writable by others (else
anyone could have swapped the socket); on the hand-over socket, the kernel
tells the uid of the process that listens (``SO_PEERCRED``), which no file
swap can fake. Expected uids: ``$KVTIER_DAEMON_USER`` (user names or uids,
comma-separated), default root, the current user and the service user
``kvtier`` if it exists.

``hand_over(path, fds)`` passes KV memory descriptors to the daemon
(SCM_RIGHTS over ``PATH.fd``) and returns the one-time ticket the
REGISTER presents; ``fetch_mirror(path, name)`` gets a read-only descriptor
of a lookup mirror the other way (engines of other users than the daemon's).

Primitives: ``expected_daemon_uids()``, ``check_daemon_socket(path)``,
``hand_over(path, fds, timeout)``, ``fetch_mirror(path, name, timeout) -> fd``, ``UntrustedSocket``.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct

import msgpack

from ..ownership import distrust
from .errors import DaemonUnavailable

ENV_DAEMON_USER = "KVTIER_DAEMON_USER"
SERVICE_USER = "kvtier"
HANDOVER_SUFFIX = ".fd"


class UntrustedSocket(DaemonUnavailable):
    """The socket is not the expected daemon's: nothing is sent to it."""


def expected_daemon_uids() -> set[int]:
    value = os.environ.get(ENV_DAEMON_USER, "").strip()
    if not value:
        uids = {0, os.getuid()}
        try:  # the documented service runs as user kvtier: trusted out of the box
            uids.add(pwd.getpwnam(SERVICE_USER).pw_uid)
        except KeyError:
            pass
        return uids
    uids = set()
    for user in filter(None, (u.strip() for u in value.split(","))):
        if user.isdigit():
            uids.add(int(user))
        else:
            try:
                uids.add(pwd.getpwnam(user).pw_uid)
            except KeyError:
                raise UntrustedSocket(f"${ENV_DAEMON_USER}: no user {user!r}") from None
    return uids


def check_daemon_socket(path: str) -> None:
    """Raise UntrustedSocket unless ``path`` (if it exists) and its directory
    belong to an expected daemon uid. A missing socket is no daemon yet."""
    if path.startswith(("tcp://", "ipc://")):
        return
    uids = expected_daemon_uids()
    d = os.path.dirname(os.path.abspath(path))
    try:
        dst = os.stat(d)
    except FileNotFoundError:
        return
    why = distrust(dst, "directory", uids)
    if why:
        raise UntrustedSocket(f"refusing {path}: its directory: {why} (set ${ENV_DAEMON_USER})")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    why = distrust(st, "socket", uids, deny=0)
    if why:
        raise UntrustedSocket(f"refusing {path}: {why} (set ${ENV_DAEMON_USER})")


def fetch_mirror(path: str, name: str, timeout: float = 5.0) -> int:
    """A read-only descriptor of lookup mirror ``name`` (the ``index`` of this process's
    REGISTER reply) from the daemon at ``path``: for engines of other users than the
    daemon's, which cannot open the 0600 table by name. Raises DaemonUnavailable
    (no socket, untrusted, refused: the caller asks over ZeroMQ instead)."""
    path = path[len("ipc://"):] if path.startswith("ipc://") else path
    if path.startswith("tcp://"):
        raise DaemonUnavailable("lookup mirrors are handed over on the local Unix socket only")
    with _connect(path, timeout) as s:
        try:
            s.send(msgpack.packb({"v": 1, "mirror": name}))
            data, fds, _, _ = socket.recv_fds(s, 4096, 1)
            reply = msgpack.unpackb(data)
        except (OSError, ValueError) as exc:
            raise DaemonUnavailable(f"mirror hand-over from {path}{HANDOVER_SUFFIX} failed: {exc}") from None
    if not fds or not isinstance(reply, dict) or reply.get("mirror") != name:
        for fd in fds:
            os.close(fd)
        why = reply.get("error", "no descriptor") if isinstance(reply, dict) else "bad reply"
        raise DaemonUnavailable(f"the daemon did not hand over mirror {name}: {why}")
    return fds[0]


def _connect(path: str, timeout: float) -> socket.socket:
    """The hand-over socket of the daemon at ``path``, once the kernel says an expected uid listens."""
    check_daemon_socket(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        s.connect(path + HANDOVER_SUFFIX)
    except OSError as exc:
        s.close()
        raise DaemonUnavailable(f"no hand-over socket at {path}{HANDOVER_SUFFIX}: {exc.strerror}") from None
    pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    uids = expected_daemon_uids()
    if uid not in uids:  # the kernel's word: no swapped file can fake this
        s.close()
        raise UntrustedSocket(f"refusing to talk to pid {pid}: it runs as uid {uid}, "
                              f"expected one of {sorted(uids)} (set ${ENV_DAEMON_USER})")
    return s


def hand_over(path: str, fds: list[int], timeout: float = 5.0) -> str:
    """Give the daemon at ``path`` these descriptors; the ticket for REGISTER."""
    if path.startswith("ipc://"):
        path = path[len("ipc://"):]
    elif path.startswith("tcp://"):
        from ..protocol.errors import ErrorCode
        from .errors import KVTierError
        raise KVTierError(ErrorCode.BAD_ARGUMENT, "CPU caches are handed over on the local Unix socket, "
                          "not over TCP", "client")
    with _connect(path, timeout) as s:
        try:
            socket.send_fds(s, [msgpack.packb({"v": 1})], list(fds))
            reply = msgpack.unpackb(s.recv(4096))
        except (OSError, ValueError) as exc:
            raise DaemonUnavailable(f"hand-over to {path}{HANDOVER_SUFFIX} failed: {exc}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ticket"), str):
        from ..protocol.errors import ErrorCode
        from .errors import KVTierError
        why = reply.get("error", "no ticket") if isinstance(reply, dict) else "bad reply"
        raise KVTierError(ErrorCode.BAD_ARGUMENT, f"the daemon refused the memory: {why}", "client")
    return reply["ticket"]
