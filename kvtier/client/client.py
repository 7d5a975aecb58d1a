"""The engine-side client: the public API over a ``Channel`` and a ``Session``.

Thread-safe for one engine worker. The daemon must never be the reason an
engine stalls or crashes: a background ``Keeper`` notices a daemon that
exited (from the kernel) or hangs (pings), marks the session lost and
reconnects with backoff when a daemon is back, replaying the registration.
While the session is lost the data path degrades instead of raising or
waiting - ``lookup`` returns 0, new transfers resolve at once with every
block failed (so the engine recomputes), ``discard`` is a no-op. Transfers
already sent are the exception: they stay held until the daemon answers
them or its process is gone (see ``handles.py``).

Primitives: ``register_kv_cache``, ``lookup``, ``lookup_many``, ``store``/``load`` (handles),
``offload``/``restore`` (handles), ``discard``, ``stats``, ``flush``, ``ping``,
``close``, ``connected``, ``registration``, ``share``.

One connection, several caches: ``share()`` gives another ``Client`` over the
same connection (session, heartbeat, reconnects) with a registration of its
own - a hybrid model's KV cache groups, one per namespace, cost one connection
and one keeper thread per process, not one per group. The connection closes
with the last ``Client`` sharing it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..protocol import messages as m
from ..protocol.arrays import pack_hashes, pack_ids, unpack_ids
from ..protocol.endpoints import default_socket
from ..protocol.errors import ErrorCode
from .channel import Channel
from .errors import DaemonUnavailable, KVTierError
from .fences import Fences
from .handover import hand_over
from .handles import TransferHandle, failed_all
from .keeper import Keeper
from .namespace import Namespace
from .session import SESSION_LOST, Session

if TYPE_CHECKING:  # torch is only needed by engines that allocate KV tensors
    from ..transfer.cuda import CudaKVCache
    from ..transfer.shm import ShmKVCache

log = logging.getLogger("kvtier.client")
DEGRADED = (SESSION_LOST, ErrorCode.SHUTTING_DOWN)  # answers that mean "no daemon for now"


class Client:
    def __init__(self, socket: str | None = None, *, name: str = "", timeout: float = 5.0,
                 transfer_timeout: float = 60.0, token: str = "", heartbeat: bool = True,
                 require_daemon: bool = True):
        """Connect and say HELLO. With ``require_daemon=False`` a missing daemon
        is not an error: the client starts degraded (waiting at most 1 s for a
        socket file nobody answers) and connects when one appears."""
        self.socket_path = socket or default_socket()
        self.name = name or f"pid{os.getpid()}"
        self.timeout, self.transfer_timeout = timeout, transfer_timeout
        self.token = token or os.environ.get("KVTIER_TOKEN", "")  # same variable as the daemon's
        self.session = Session()
        self.channel = Channel(self.socket_path, self.session, timeout, self._forgotten,
                               lambda: self._lose_session("the daemon hung up"))
        self._views: list[Client] = [self]  # every Client on this connection (``share``)
        self._init_registration()
        try:
            self._open_session(self.timeout if require_daemon else min(self.timeout, 1.0))
        except DaemonUnavailable:
            if require_daemon:
                self.channel.close()
                raise
        self.keeper = None
        if heartbeat:
            self.keeper = Keeper(self.channel, self.session, self._open_session, self._lose_session, self.timeout)
            self.keeper.start()

    def _init_registration(self) -> None:
        """What is this Client's own, not the connection's."""
        self._register_args: tuple | None = None
        self._reg: m.Registered | None = None
        self._mirror = None  # ShmIndexReader of the namespace's ready hashes, when offered
        self.kv: "ShmKVCache | CudaKVCache | None" = None
        self.block_factor = 1
        self._fences = Fences()  # CUDA: events on the engine's stream, the daemon's events
        self._sent: set[int] = set()  # transfers this Client sent (a shared one's close cancels only these)
        self._closed = self._closing = False

    def share(self) -> "Client":
        """Another Client over this connection, for another KV cache: its own
        ``register_kv_cache`` (replayed with this one's after a reconnect),
        lookups and transfers; the same session, heartbeat and degraded mode.
        Closing one gives its registration back; the last one closes the
        connection. Raises KVTierError once the connection is closed."""
        with self.channel.cv:
            if not any(not v._closed for v in self._views):
                raise KVTierError(ErrorCode.UNKNOWN_NAMESPACE, "this client's connection is closed", "client")
            view = object.__new__(Client)
            view.__dict__.update({k: getattr(self, k) for k in _CONNECTION})
            view._init_registration()
            self._views.append(view)
        return view

    # ---- session --------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self.session.healthy

    @property
    def client_id(self) -> int:
        return self.session.client_id

    @property
    def heartbeat_s(self) -> float:
        return self.session.heartbeat_s

    @property
    def max_message(self) -> int:
        return self.session.max_message

    @property
    def reconnects(self) -> int:
        return self.keeper.reconnects if self.keeper is not None else 0

    def _open_session(self, wait: float) -> None:
        """New socket, HELLO, replay the registration. Raises DaemonUnavailable."""
        if not self.socket_path.startswith(("tcp://", "ipc://")) and not os.path.exists(self.socket_path):
            # No socket file: no daemon to wait for (engines starting degraded do not stall).
            raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path} (no such socket)")
        with self.channel.own(time.monotonic() + wait):
            self.channel.open()
            try:
                pid = 0 if self.socket_path.startswith("tcp://") else os.getpid()
                welcome = self.channel.call(m.Hello(m.PROTOCOL_VERSION, pid, self.name, self.token), timeout=wait)
                with self.channel.cv:
                    self.session.welcome(welcome, self.socket_path)
                for view in list(self._views):  # replay every cache on this connection
                    if view._register_args is not None and not view._closed:
                        view._reg = self.channel.call(view._register_msg(view._register_args, wait), timeout=wait)
                        view._open_mirror(view._reg.index)
            except KVTierError:
                # Frames queued on this socket must not reach a daemon that starts later.
                self.channel.close_socket()
                raise
            self.session.healthy = True

    def _lose_session(self, why: str) -> None:
        """Mark the daemon gone: waiters that may fail now resolve as failed."""
        gone = self.session.daemon.gone()
        if gone:  # its last answers may already sit in our socket: file them first
            self.channel.pump(0.0)
        with self.channel.cv:
            was = self.session.lose(why, daemon_gone=gone)
            self.channel.cv.notify_all()
        self.channel.wake()  # a thread pumping the socket sees its waiter resolved at once
        if was:
            log.warning("kvtier: %s; degrading (0 hits, transfers fail) until it is back", why)

    def _forgotten(self) -> None:
        self._lose_session("the daemon no longer knows this client")

    def _degrade(self, call: Callable, default):
        """Run a data-path call; a missing or draining daemon gives ``default``, not an error."""
        if not self.session.healthy:
            return default
        try:
            return call()
        except DaemonUnavailable as exc:
            self._lose_session(str(exc))
        except KVTierError as exc:
            if exc.code not in DEGRADED:
                raise
        return default

    def close(self, timeout: float | None = None) -> bool:
        """Cancel what is in flight, wait until the daemon confirmed each cancel
        (or its process is gone), say BYE, close. Until then the daemon may
        still touch those transfers' engine blocks (a daemon that was only
        stopped resumes its copies), so close never gives them up early.

        ``timeout``: how long to wait for the confirmations (None: as long as
        they take - one copy chunk each, or until the daemon's process is
        gone). Past it, close returns False and closes nothing: the handles
        stay pending (``held_blocks``), the memory stays registered, and a
        later ``close`` continues. True once closed."""
        if self._closed:
            return True
        with self.channel.cv:  # decided under the lock: two closing at once leave one last
            shared = any(v is not self and not (v._closed or v._closing) for v in self._views)
            self._closing = True
        if shared:
            return self._close_view(timeout)
        if not self.channel.cancel_and_confirm(timeout):
            log.error("kvtier: close: the daemon has not confirmed every cancelled transfer; "
                      "their blocks stay held and the client stays open")
            self._closing = False
            return False
        self._closed = True
        if self.keeper is not None:
            self.keeper.stop()
        if self.session.healthy:
            try:
                self.channel.call(m.Bye(), timeout=min(self.timeout, 1.0))
            except KVTierError:
                pass
        try:
            with self.channel.own(time.monotonic() + self.timeout):
                self.channel.close_socket()
        except DaemonUnavailable:
            pass
        lost = m.Error(int(SESSION_LOST), "client closed", "client")
        self.channel.fail_all(lost, transfers_too=True)  # none is left that the daemon may touch
        self.session.healthy = False
        self.channel.close()
        self._open_mirror("")
        return True

    def _close_view(self, timeout: float | None) -> bool:
        """Close one of several Clients on a connection: its transfers first (as
        ``close``), then its registration; the connection stays for the others."""
        if not self.channel.cancel_and_confirm(timeout, only=self._sent):
            log.error("kvtier: close: the daemon has not confirmed every cancelled transfer; "
                      "their blocks stay held and the cache stays registered")
            self._closing = False
            return False
        with self.channel.cv:
            self._closed = True
            self._views.remove(self)
        if self._reg is not None and self.session.healthy:
            try:  # the daemon unmaps the cache once no copy uses it
                self.channel.call(m.Unregister(self._reg.reg), timeout=min(self.timeout, 1.0))
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
                          block_factor: int = 1, swap_quota: int = -1) -> m.Registered | None:
        """Export the engine's KV tensors once. ``block_dims[i]`` is the dimension
        of tensor i that indexes engine blocks (1 for FlashAttention's
        ``(2, num_blocks, ...)``, 0 for FlashInfer/MLA). Replayed automatically
        after a daemon restart; returns None while no daemon is reachable."""
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else namespace
        args = (fp, kv.specs(list(block_dims)), block_factor, swap_quota)
        self.kv, self.block_factor = kv, block_factor
        reg = self._degrade(lambda: self.channel.call(self._register_msg(args, self.timeout)), None)
        if reg is not None:
            self._reg = reg
            self._open_mirror(reg.index)
        self._register_args = args  # a refusal raised above: nothing to replay
        return self.registration

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
                return hits
        msg = m.Lookup(self._reg_id(), packed)
        return self._degrade(lambda: self.channel.call(msg).hits, 0)

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
        except SegmentError as exc:  # another user's daemon (mode 0600): lookups use the socket
            log.info("kvtier: lookup mirror not readable here (%s); lookups go over the socket", exc)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[int]:
        """``lookup`` for many requests (a scheduling step) in one round trip;
        all 0 while the daemon is unreachable."""
        if not chains:
            return []
        msg = m.LookupMany(self._reg_id(), [pack_hashes(c) for c in chains])
        zeros = [0] * len(chains)
        return self._degrade(lambda: unpack_ids(self.channel.call(msg).hits).tolist(), zeros)

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
        self._degrade(lambda: self.channel.call(msg), None)

    # ---- management --------------------------------------------------------------------
    def stats(self, check: bool = False) -> dict:
        """The daemon's stats document; ``check`` also verifies pool integrity."""
        return self.channel.call(m.Stats(check)).stats

    def flush(self, namespace: Namespace | str | None = None) -> int:
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else (namespace or "")
        return self.channel.call(m.Flush(fp)).removed

    def ping(self) -> None:
        self.channel.call(m.Ping())

    # ---- plumbing -----------------------------------------------------------------------
    def _transfer(self, msg, count: int, block_ids: Sequence[int] = (),
                  names: tuple[str, ...] = ()) -> TransferHandle:
        deadline = time.monotonic() + self.transfer_timeout
        if not self.session.healthy:
            return TransferHandle(self.channel, 0, count, deadline,
                                  failed_all(count, "daemon unavailable", names), names)
        try:
            req_id = self.channel.send(msg)
        except DaemonUnavailable as exc:  # never sent: nothing can touch the blocks
            self._lose_session(str(exc))
            return TransferHandle(self.channel, 0, count, deadline, failed_all(count, str(exc), names), names)
        # Which transfers a close of this Client cancels when others share the connection.
        if len(self._sent) >= 4096:
            with self.channel.cv:
                self._sent &= self.session.transfers_waiting()
        self._sent.add(req_id)
        return TransferHandle(self.channel, req_id, count, deadline, None, names, tuple(block_ids),
                              self._fences.open)



# What Clients sharing one connection (``Client.share``) have in common.
_CONNECTION = ("socket_path", "name", "timeout", "transfer_timeout", "token", "session", "channel",
               "keeper", "_views")


def _check_len(got: int, want: int) -> None:
    if got != want:
        raise ValueError(f"expected {want} block ids, got {got}")
