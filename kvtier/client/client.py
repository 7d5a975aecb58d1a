"""The engine-side client: one KV cache registered on a ``Connection``.

Thread-safe for one engine worker. The daemon must never be the reason an
engine stalls or crashes: the connection's ``Keeper`` notices a daemon that
exited (from the kernel) or hangs (pings), marks the session lost and
reconnects with backoff when a daemon is back, replaying every registration.
While the session is lost the data path degrades instead of raising or
waiting - ``lookup`` returns 0, new transfers resolve at once with every
block failed (so the engine recomputes), ``discard`` is a no-op. Transfers
already sent are the exception: they stay held until the daemon answers
them or its process is gone (see ``handles.py``).

Primitives: ``register_kv_cache``, ``lookup``, ``lookup_many``, ``store``/``load`` (handles),
``offload``/``restore`` (handles), ``discard``, ``stats``, ``flush``, ``ping``,
``close``, ``connected``, ``registration``, ``share``.

One connection, several caches: ``Client(...)`` opens a ``Connection`` and is
its first registration; ``share()`` gives another ``Client`` on the same
connection (session, heartbeat, reconnects) with a registration of its own:
its own namespace, transfers and swap quota. The connection closes with the
last ``Client`` on it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Mapping, Sequence

from ..protocol import messages as m
from ..protocol.arrays import pack_hashes, pack_ids, unpack_ids
from ..protocol.errors import ErrorCode
from .connection import Connection
from .errors import DaemonUnavailable, KVTierError
from .fences import Fences
from .handover import fetch_mirror, hand_over
from .tally import Tally
from .handles import TransferHandle, failed_all
from .namespace import Namespace

if TYPE_CHECKING:  # torch is only needed by engines that allocate KV tensors
    from ..transfer.cuda import CudaKVCache
    from ..transfer.shm import ShmKVCache

log = logging.getLogger("kvtier.client")
UNSET_QUOTA = -1  # the wire's "daemon default" (protos/PROTOCOL.md, REGISTER)


class Client:
    def __init__(self, socket: str | None = None, *, name: str = "", timeout: float = 5.0,
                 transfer_timeout: float = 60.0, token: str = "", heartbeat: bool = True,
                 require_daemon: bool = True, connection: Connection | None = None):
        """Connect and say HELLO (a new ``Connection``), or, given ``connection``,
        be one more cache on it (the other arguments are the connection's).
        With ``require_daemon=False`` a missing daemon is not an error: the
        client starts degraded and connects when one appears."""
        if connection is None:
            connection = Connection(socket, name=name, timeout=timeout, transfer_timeout=transfer_timeout,
                                    token=token, heartbeat=heartbeat, require_daemon=require_daemon)
        self.connection = connection
        self._register_args: tuple | None = None
        self._reg: m.Registered | None = None
        self._mirror = None  # ShmIndexReader of the namespace's ready hashes, when offered
        self.tally = Tally()  # lookups the mirror answered, reported on the heartbeat (tally.py)
        self.kv: "ShmKVCache | CudaKVCache | None" = None
        self.block_factor = 1
        self._fences = Fences()  # CUDA: events on the engine's stream, the daemon's events
        self._sent: set[int] = set()  # transfers this Client sent (a shared one's close cancels only these)
        self.closed = self._closing = False
        connection.attach(self)

    def share(self) -> "Client":
        """Another Client on this connection, for another KV cache: its own
        ``register_kv_cache`` (replayed with this one's after a reconnect),
        lookups, transfers and swap quota; the same session, heartbeat and
        degraded mode. Closing one gives its registration back; the last one
        closes the connection. Raises KVTierError once the connection is closed."""
        return Client(connection=self.connection)

    # ---- the connection's, read through this cache ----------------------------------------
    channel = property(lambda self: self.connection.channel)
    session = property(lambda self: self.connection.session)
    keeper = property(lambda self: self.connection.keeper)
    socket_path = property(lambda self: self.connection.socket_path)
    name = property(lambda self: self.connection.name)
    timeout = property(lambda self: self.connection.timeout)
    transfer_timeout = property(lambda self: self.connection.transfer_timeout,
                                lambda self, v: setattr(self.connection, "transfer_timeout", v))
    connected = property(lambda self: self.connection.connected)
    client_id = property(lambda self: self.connection.client_id)
    reconnects = property(lambda self: self.connection.reconnects)
    heartbeat_s = property(lambda self: self.connection.session.heartbeat_s)
    max_message = property(lambda self: self.connection.session.max_message)

    def close(self, timeout: float | None = None) -> bool:
        """Cancel what is in flight, wait until the daemon confirmed each cancel
        (or its process is gone), then give the registration back; the last
        Client on the connection also says BYE and closes it. Until then the
        daemon may still touch those transfers' engine blocks (a daemon that
        was only stopped resumes its copies), so close never gives them up early.

        ``timeout``: how long to wait for the confirmations (None: as long as
        they take - one copy chunk each, or until the daemon's process is
        gone). Past it, close returns False and closes nothing: the handles
        stay pending (``held_blocks``), the memory stays registered, and a
        later ``close`` continues. True once closed."""
        if self.closed:
            return True
        conn = self.connection
        with conn.channel.cv:  # decided under the lock: two closing at once leave one last
            shared = any(r is not self and not (r.closed or r._closing) for r in conn.registrations)
            self._closing = True
        if shared:
            return self._give_back(timeout)
        if not conn.close(timeout):
            self._closing = False
            return False
        self.closed = True
        conn.detach(self)
        self._open_mirror("")
        return True

    def _give_back(self, timeout: float | None) -> bool:
        """Close one of several Clients on a connection: its transfers first (as
        ``close``), then its registration; the connection stays for the others."""
        if not self.channel.cancel_and_confirm(timeout, only=self._sent):
            log.error("kvtier: close: the daemon has not confirmed every cancelled transfer; "
                      "their blocks stay held and the cache stays registered")
            self._closing = False
            return False
        self.closed = True
        self.connection.report(min(self.timeout, 1.0), only=self)  # before its registration goes
        self.connection.detach(self)
        if self._reg is not None and self.connection.connected:
            try:  # the daemon unmaps the cache once no copy uses it
                self.connection.call(m.Unregister(self._reg.reg), timeout=min(self.timeout, 1.0))
            except KVTierError:
                pass  # a lost session: the daemon forgot the registration anyway
        self._reg = None
        self._open_mirror("")
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- registration ---------------------------------------------------------------
    def register_kv_cache(self, kv: "ShmKVCache | CudaKVCache", block_dims: Sequence[int], namespace: Namespace | str,
                          block_factor: int = 1, swap_quota: int | None = None) -> m.Registered | None:
        """Export the engine's KV tensors once. ``block_dims[i]`` is the dimension
        of tensor i that indexes engine blocks (1 for FlashAttention's
        ``(2, num_blocks, ...)``, 0 for FlashInfer/MLA). ``swap_quota``: the
        bytes this cache may hold swapped out (``offload``): None is the
        daemon's default, 0 no swap at all; never more than the operator's
        cap. Set once, for this registration only. Replayed automatically
        after a daemon restart; returns None while no daemon is reachable."""
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else namespace
        args = (fp, kv.specs(list(block_dims)), block_factor, wire_quota(swap_quota))
        self.kv, self.block_factor = kv, block_factor
        reg = self.connection.degrade(lambda: self.connection.call(self._register_msg(args, self.timeout)), None)
        if reg is not None:
            self._reg = reg
            self._open_mirror(reg.index)
        self._register_args = args  # a refusal raised above: nothing to replay
        return self.registration

    def replay(self, wait: float) -> None:
        """REGISTER again on the connection's new session (after a reconnect)."""
        self.tally.take()  # counted against the lost session's registration: gone with it
        if self._register_args is not None:
            self._reg = self.connection.call(self._register_msg(self._register_args, wait), timeout=wait)
            self._open_mirror(self._reg.index)

    def _register_msg(self, args: tuple, timeout: float) -> m.Register:
        """REGISTER for ``args``; CPU memory is handed over first (descriptors
        over the side socket, never names) and the message carries the ticket."""
        fds = self.kv.fds() if hasattr(self.kv, "fds") else []
        ticket = hand_over(self.socket_path, fds, timeout) if fds else ""
        return m.Register(*args, ticket=ticket)

    @property
    def registration(self) -> m.Registered | None:
        """The daemon's answer to the current registration (None while degraded)."""
        return self._reg if self.session.healthy else None

    def _reg_id(self) -> int:
        if self._register_args is None:
            raise KVTierError(ErrorCode.UNKNOWN_NAMESPACE, "register_kv_cache first", "client")
        return self._reg.reg if self._reg is not None else 0

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` ready in the pool (one round trip, or
        none when the daemon mirrors the namespace in shared memory); 0 while
        the daemon is unreachable."""
        packed = pack_hashes(hashes)
        mirror = self._mirror
        if mirror is not None and self.session.healthy:
            hits = mirror.ready_prefix(packed)
            if hits is not None:  # None: the mirror cannot say (overflowed, busy): ask
                self.tally.add(len(hashes), hits)
                return hits
        msg = m.Lookup(self._reg_id(), packed)
        return self.connection.degrade(lambda: self.connection.call(msg).hits, 0)

    def _open_mirror(self, name: str) -> None:
        """Map the daemon's lookup mirror if offered and readable by this user."""
        old, self._mirror = self._mirror, None
        if old is not None:
            old.close()
        if not name:
            return
        from ..pool.shm_index import ShmIndexReader
        from ..pool.segment import SegmentError
        try:
            self._mirror = ShmIndexReader(name)
            return
        except SegmentError as exc:  # another user's daemon (mode 0600): ask it for a descriptor
            why = exc
        try:
            self._mirror = ShmIndexReader(name, fd=fetch_mirror(self.socket_path, name, self.timeout))
        except (SegmentError, DaemonUnavailable) as exc:
            log.info("kvtier: lookup mirror not readable here (%s; %s); lookups go over the socket", why, exc)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """``lookup`` for many requests (a scheduling step) in one round trip;
        all 0 while the daemon is unreachable."""
        if not chains:
            return []
        msg = m.LookupMany(self._reg_id(), [pack_hashes(c) for c in chains])
        zeros = [0] * len(chains)
        return self.connection.degrade(lambda: unpack_ids(self.connection.call(msg).hits).tolist(), zeros)

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, event=None,
              stream=None) -> TransferHandle:
        """Copy engine blocks into the pool under ``hashes`` (block_factor ids
        per hash). Blocks already stored are skipped.

        The source blocks stay the daemon's to read until the handle is done:
        the engine must not free, reuse or overwrite ``handle.held_blocks``
        before then. GPU caches: pass the ``stream`` whose kernels wrote the
        blocks (the client records an interprocess event on it) or your own
        ``torch.cuda.Event(interprocess=True)`` already recorded there as
        ``event``; the daemon's copy waits for it instead of reading early."""
        _check_len(len(block_ids), len(hashes) * self.block_factor)
        msg = m.Store(self._reg_id(), pack_hashes(hashes), pack_ids(block_ids), self._fences.handle(event, stream))
        return self._transfer(msg, len(hashes), block_ids)

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], skip: int = 0, *, event=None,
             stream=None, prefix: bool = False) -> TransferHandle:
        """Copy pool blocks into engine blocks. The result's ``failed`` lists the
        hashes that were not loaded: the engine must recompute those.

        ``prefix=True`` is lookup and load in one round trip: only the longest
        ready prefix of ``hashes`` is loaded (``block_ids`` still names a block
        for every hash); ``result.done + len(result.failed)`` is the prefix
        length, and the blocks after it are not reported failed - they were
        simply not cached.

        GPU caches: ``stream``/``event`` as for ``store``, marking when the
        engine is done with the destination blocks; before attention reads
        them, call ``handle.wait_event(stream)`` so that stream waits for the
        daemon's copy."""
        _check_len(len(block_ids), len(hashes) * self.block_factor - skip)
        msg = m.Load(self._reg_id(), pack_hashes(hashes), pack_ids(block_ids), skip, self._fences.handle(event, stream),
                     prefix)
        return self._transfer(msg, len(hashes), block_ids)

    # ---- request swap --------------------------------------------------------------------
    def offload(self, request: str | Mapping[str, Sequence[int]],
                block_ids: Sequence[int] | None = None) -> TransferHandle:
        """Swap preempted requests' engine blocks out to the pool.

        ``offload("req-1", ids)`` or ``offload({"req-1": ids, "req-2": ids2})``.
        ``result.done`` counts requests offloaded; those that do not fit (pool
        full of swap, quota) come back in ``result.failed_requests`` at once,
        without a copy: soft-reset those. Keep the blocks untouched until the
        handle is done."""
        reqs = {request: block_ids} if isinstance(request, str) else dict(request)
        if not reqs or any(ids is None or len(ids) == 0 for ids in reqs.values()):
            raise ValueError("offload needs at least one request with at least one block")
        msg = m.Offload(self._reg_id(), [[r, pack_ids(ids)] for r, ids in reqs.items()])
        return self._transfer(msg, len(reqs), [b for ids in reqs.values() for b in ids], names=tuple(reqs))

    def restore(self, request: str, block_ids: Sequence[int]) -> TransferHandle:
        """Copy a swapped request back into (new) engine blocks and free its swap
        space. ``block_ids`` must have as many ids as were offloaded."""
        return self._transfer(m.Restore(self._reg_id(), request, pack_ids(block_ids)), len(block_ids), block_ids)

    def discard(self, request: str) -> None:
        """Free a swapped request (cancelled). Raises KVTierError if unknown;
        a no-op while the daemon is unreachable (its swap is gone anyway)."""
        msg = m.Discard(self._reg_id(), request)
        self.connection.degrade(lambda: self.connection.call(msg), None)

    # ---- management --------------------------------------------------------------------
    def stats(self, check: bool = False) -> dict:
        """The daemon's stats document; ``check`` also verifies pool integrity."""
        return self.connection.stats(check)

    def flush(self, namespace: Namespace | str | None = None, timeout: float | None = None) -> int:
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else (namespace or "")
        return self.connection.flush(fp, timeout)

    def ping(self) -> None:
        """One round trip; it carries what the lookup mirrors answered since the last report."""
        self.connection.ping()

    # ---- plumbing -----------------------------------------------------------------------
    def _transfer(self, msg, count: int, block_ids: Sequence[int] = (),
                  names: tuple[str, ...] = ()) -> TransferHandle:
        deadline = time.monotonic() + self.transfer_timeout
        if not self.session.healthy:
            return TransferHandle(self.channel, 0, count, deadline,
                                  failed_all(count, "daemon unavailable", names), names)
        try:
            self.connection.piggyback()  # the mirror's counts, ahead of it (no round trip)
            req_id = self.channel.send(msg)
        except DaemonUnavailable as exc:  # never sent: nothing can touch the blocks
            self.connection.lose_session(str(exc))
            return TransferHandle(self.channel, 0, count, deadline, failed_all(count, str(exc), names), names)
        # Which transfers a close of this Client cancels when others share the connection.
        if len(self._sent) >= 4096:
            with self.channel.cv:
                self._sent &= self.session.transfers_waiting()
        self._sent.add(req_id)
        return TransferHandle(self.channel, req_id, count, deadline, None, names, tuple(block_ids),
                              self._fences.open)


def wire_quota(quota: int | None) -> int:
    """A cache's swap quota as REGISTER carries it: None (the daemon's default)
    is the wire's -1; a negative or non-integer quota is the caller's mistake."""
    if quota is None:
        return UNSET_QUOTA
    if isinstance(quota, bool) or not isinstance(quota, int) or quota < 0:
        raise ValueError(f"swap_quota must be None (the daemon's default) or a byte count >= 0, not {quota!r}")
    return quota


def _check_len(got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"expected {want} block ids, got {got}")
