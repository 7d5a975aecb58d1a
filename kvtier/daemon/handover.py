"""The hand-over socket: engines give the daemon memory, never a name.

ZeroMQ cannot carry file descriptors, so next to the ZeroMQ socket at
``PATH`` the daemon listens on ``PATH.fd`` (AF_UNIX, SOCK_SEQPACKET: one
message per read, descriptors attached to it). A client connects, sends one
message ``{"v": 1}`` with its KV memory descriptors attached (SCM_RIGHTS),
and gets back ``{"ticket": HEX}`` (or ``{"error": TEXT}``); then it closes.
The daemon records who handed the descriptors over (``SO_PEERCRED``: uid,
gid, pid - the kernel's word, not the client's) and gives the descriptors
to a REGISTER that presents the ticket over ZeroMQ from a session of the
same pid. A ticket is good once, for ``TICKET_TTL_S``.

The same socket hands lookup mirrors the other way (engines of other users
than the daemon's cannot open the 0600 tables by name): a client sends
``{"v": 1, "mirror": NAME}`` with no descriptors, NAME being the ``index``
its REGISTER was answered with, and gets ``{"mirror": NAME}`` with a
read-only descriptor of that table attached (or ``{"error": TEXT}``). It is
given only to a process (kernel pid and uid) with a live session holding a
registration in that table's namespace (``serve_mirrors``), so a tenant
never gets a table that is not its own; the descriptor is O_RDONLY, so it
can be mapped for reading only (a writable mapping or a reopen for writing
through /proc is refused by the kernel: the file stays 0600, the daemon's).

Everything here is non-blocking and served by the daemon's poll loop; what
one peer can hold is bounded (pending connections per uid and in all,
tickets per uid, descriptors per ticket, time): one user holding every
pending slot used to block every other user's hand-over. When accepting
fails for want of descriptors (``EMFILE``), the listener rests for
``ACCEPT_BACKOFF_S`` instead of waking the loop again at once (it used to
spin and log ~1 MB/s).

Primitives: ``Handover(path, mode, gid, per_uid)``, ``.poll_fds()``, ``.on_ready(fd)``,
``.expire(now)``, ``.take(ticket, peer) -> Ticket | str``, ``.serve_mirrors(open_for)``, ``.close()``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass, field

import msgpack

from .peers import Peer, peer_of, uid_of

log = logging.getLogger("kvtier.daemon")

MAX_PENDING = 64          # connections accepted but not answered yet
CONNECT_DEADLINE_S = 2.0  # a connection that sends nothing is closed after this
MAX_FDS = 16              # descriptors per hand-over
MAX_TICKETS_PER_UID = 8
MAX_TICKETS = 64
TICKET_TTL_S = 30.0
MAX_REQUEST = 256         # bytes of the request message
ACCEPT_BATCH = 256        # connections accepted (or refused) per loop turn
ACCEPT_BACKOFF_S = 0.2    # after EMFILE/ENFILE/ENOMEM on accept, the listener rests this long


@dataclass(eq=False)
class Ticket:
    peer: Peer
    fds: list[int]
    expires: float = field(default_factory=lambda: time.monotonic() + TICKET_TTL_S)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


class Handover:
    def __init__(self, path: str, mode: int, gid: int | None, per_uid: int = 8):
        self.path, self.per_uid = path, per_uid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.setblocking(False)
        old = os.umask(0o777 & ~mode)
        try:
            self.sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)  # the directory is ours and closed to others (listen.check_socket_dir)
        if gid is not None:
            os.chown(path, -1, gid)
        self.sock.listen(64)
        self.pending: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (conn, deadline, uid)
        self.tickets: dict[str, Ticket] = {}
        self.counters = {"handovers": 0, "refused": 0, "accept_failed": 0, "mirrors": 0}
        self._resting_until = 0.0
        self.open_mirror = None  # (peer, name) -> read-only fd | why not; None: no mirrors to hand

    def serve_mirrors(self, open_for) -> None:
        """Hand lookup mirrors out: ``open_for(peer, name)`` is a read-only descriptor of the
        table (the caller closes it) or why not. Once, at start, when lookup_index is on."""
        self.open_mirror = open_for

    # ---- poll loop ---------------------------------------------------------------------
    def poll_fds(self) -> list[int]:
        if time.monotonic() < self._resting_until:  # out of descriptors a moment ago: let them come back
            return list(self.pending)
        return [self.sock.fileno(), *self.pending]

    def on_ready(self, fd: int) -> None:
        if fd == self.sock.fileno():
            self._accept()
        elif fd in self.pending:
            self._serve(fd)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: rest instead of spinning on a readable socket
                self.counters["accept_failed"] += 1
                if self._resting_until == 0.0 or self.counters["accept_failed"] % 100 == 1:
                    log.warning("hand-over accept failed (%s); resting %.1fs (%d failures so far)", exc,
                                ACCEPT_BACKOFF_S, self.counters["accept_failed"])
                self._resting_until = time.monotonic() + ACCEPT_BACKOFF_S
                return
            try:
                uid = uid_of(conn)
            except OSError:
                conn.close()
                continue
            mine = sum(1 for _, _, u in self.pending.values() if u == uid)
            if len(self.pending) >= MAX_PENDING or mine >= self.per_uid:
                self.counters["refused"] += 1
                conn.close()  # too many half-open hand-overs (of this user): this one is dropped
                continue
            conn.setblocking(False)
            self.pending[conn.fileno()] = (conn, time.monotonic() + CONNECT_DEADLINE_S, uid)

    def _serve(self, fd: int) -> None:
        conn = self.pending[fd][0]
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("hand-over read failed: %s", exc)
            data, fds, flags = None, [], 0
        del self.pending[fd]
        with conn:
            if data is None:
                return
            request = _request(data)
            if isinstance(request, dict) and "mirror" in request:
                self._mirror_for(conn, request["mirror"], fds, flags)
                return
            reply = self._ticket_for(conn, data, fds, flags)
            try:
                conn.send(msgpack.packb(reply))
            except OSError:
                pass

    def _mirror_for(self, conn: socket.socket, name, fds: list[int], flags: int) -> None:
        peer = peer_of(conn)
        for fd in fds:  # a mirror request carries none
            os.close(fd)
        if fds or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or not isinstance(name, str) or len(name) > 128:
            got: int | str = "a mirror request is {'v': 1, 'mirror': NAME} and nothing else"
        elif self.open_mirror is None:
            got = "this daemon has no lookup mirrors (lookup_index is off)"
        else:
            got = self.open_mirror(peer, name)
        if isinstance(got, str):
            self.counters["refused"] += 1
            log.warning("mirror %.80r for pid %d uid %d refused: %s", name, peer.pid, peer.uid, got)
            reply, out = {"error": got}, []
        else:
            self.counters["mirrors"] += 1
            reply, out = {"mirror": name}, [got]
        try:
            socket.send_fds(conn, [msgpack.packb(reply)], out)
        except OSError:
            pass
        finally:
            for fd in out:
                os.close(fd)

    def _ticket_for(self, conn: socket.socket, data: bytes, fds: list[int], flags: int) -> dict:
        ticket = Ticket(peer_of(conn), list(fds))
        why = None
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            why = f"at most {MAX_FDS} descriptors and {MAX_REQUEST} bytes per hand-over"
        elif not _is_request(data):
            why = "expected a msgpack map {'v': 1}"
        elif not all(_is_memory(fd) for fd in fds):
            why = "only memory files may be handed over"
        elif len(self.tickets) >= MAX_TICKETS or \
                sum(t.peer.uid == ticket.peer.uid for t in self.tickets.values()) >= MAX_TICKETS_PER_UID:
            why = "too many unused tickets; register with the ones you have first"
        if why is not None:
            ticket.close()
            self.counters["refused"] += 1
            log.warning("hand-over from pid %d uid %d refused: %s", ticket.peer.pid, ticket.peer.uid, why)
            return {"error": why}
        token = secrets.token_hex(16)
        self.tickets[token] = ticket
        self.counters["handovers"] += 1
        return {"ticket": token}

    def expire(self, now: float) -> None:
        for fd, (conn, deadline, _) in list(self.pending.items()):
            if now >= deadline:
                del self.pending[fd]
                conn.close()
        for token, t in list(self.tickets.items()):
            if now >= t.expires:
                del self.tickets[token]
                t.close()

    # ---- REGISTER ------------------------------------------------------------------------
    def take(self, token: str, peer: Peer | None) -> Ticket | str:
        """The ticket's descriptors for the session of ``peer`` (the caller
        closes them), or why not. A ticket is used up even when refused."""
        t = self.tickets.pop(token, None) if isinstance(token, str) else None
        if t is None:
            return "unknown or expired ticket: hand the memory over again"
        if peer is None or (peer.uid, peer.pid) != (t.peer.uid, t.peer.pid):
            t.close()
            return "the ticket was issued to another process"
        return t

    def close(self) -> None:
        for conn, _, _ in self.pending.values():
            conn.close()
        self.pending.clear()
        for t in self.tickets.values():
            t.close()
        self.tickets.clear()
        self.sock.close()


def _request(data: bytes):
    """The request map, or None when it is not one of ours."""
    try:
        obj = msgpack.unpackb(data)
    except Exception:  # msgpack raises several unrelated types
        return None
    return obj if isinstance(obj, dict) and obj.get("v") == 1 else None


def _is_request(data: bytes) -> bool:
    return _request(data) is not None


def _is_memory(fd: int) -> bool:
    """A regular file (memfd/tmpfs): never a socket, directory or device -
    those could make the daemon block or hold something it should not."""
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
