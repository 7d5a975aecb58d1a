"""Operator-only surfaces: the Prometheus endpoint and the block event socket
carry every tenant's namespaces (metrics) and block hashes (events).

Operators are root, the daemon's own user and members of ``admin_group``,
the same people who may flush any tenant over the daemon socket.

- Event socket (``events`` an ipc path): bound with mode 0600, then given to
  ``admin_group`` with mode 0660 when one is set; no other user can connect.
  A ``tcp://`` event endpoint cannot be restricted by user: the daemon says
  so in its log, and the README says who can read it then (anyone who
  reaches the address).
- Metrics over TCP: for each connection the kernel's socket table
  (``/proc/net/tcp``, ``/proc/net/tcp6``) names the uid owning the peer's
  socket when the peer is on this machine; a local peer that is not an
  operator gets ``403`` and nothing else. A peer on another machine is not in
  this machine's table: binding ``metrics`` to a non-loopback address leaves
  who reaches it to the network (firewall), as the README says.

Primitives: ``is_operator(config)(uid) -> bool``, ``tcp_peer_uid(peer, local)
-> int | None``, ``bind_private_ipc(socket, path, gid)``.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd

from .config import DaemonConfig, admin_gid


def is_operator(config: DaemonConfig):
    """uid -> may this user read every tenant's metrics and events?"""
    gid = admin_gid(config.admin_group) if config.admin_group else None

    def check(uid: int) -> bool:
        if uid in (0, os.geteuid()):
            return True
        if gid is None:
            return False
        try:
            user = pwd.getpwuid(uid)
            return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
        except KeyError:
            return False
    return check


def _address(hex_addr: str) -> tuple[str, int]:
    """``/proc/net/tcp`` ``ADDR:PORT`` (address in host-order 32-bit words) -> (ip, port)."""
    addr, port = hex_addr.split(":")
    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, len(addr), 8))
    return _plain(str(ipaddress.ip_address(raw))), int(port, 16)


def _plain(ip: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 form (a v4 peer of a dual-stack listener)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def tcp_peer_uid(peer: tuple, local: tuple) -> int | None:
    """The uid owning the other end of the TCP connection ``local`` <- ``peer``,
    or None when that end is not a socket of this machine (a remote host)."""
    want_local = (_plain(peer[0]), peer[1])   # the peer's socket: its local end is our peer address
    want_remote = (_plain(local[0]), local[1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if _address(cols[1]) == want_local and _address(cols[2]) == want_remote:
                        return int(cols[7])
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return None


def bind_private_ipc(sock, path: str, gid: int | None) -> None:
    """Bind the ZeroMQ ``sock`` at ipc ``path`` so that only this user (and group
    ``gid``, when given) can connect: created 0600, then handed to the group."""
    old = os.umask(0o177)
    try:
        sock.bind("ipc://" + path)
    finally:
        os.umask(old)
    if gid is not None:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)
