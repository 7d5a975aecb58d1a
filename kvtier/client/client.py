"""The engine-side client: one DEALER socket to the daemon.

Thread-safe for one engine worker: calls from several threads share the socket
under a lock; replies are matched to requests by id.

The daemon must never be the reason an engine stalls or crashes. A background
thread pings the daemon every heartbeat period; when the daemon stops
answering (killed, restarting) the session is marked lost and the client
degrades instead of raising: ``lookup`` returns 0, transfers resolve at once
with every block failed (so the engine recomputes), ``discard`` is a no-op.
The same thread reconnects when a daemon is back and replays the
registration, so the engine keeps working without noticing more than misses.

Primitives: ``register_kv_cache``, ``lookup``, ``store``/``load`` (handles),
``offload``/``restore`` (handles), ``discard``, ``stats``, ``flush``, ``close``,
``connected``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Mapping, Sequence

import zmq

from ..protocol import messages as m
from ..protocol.arrays import pack_hashes, pack_ids
from ..protocol.codec import decode, encode
from ..protocol.endpoints import default_socket, endpoint
from ..protocol.errors import ErrorCode, ProtocolError
from .errors import DaemonUnavailable, KVTierError
from .handles import TransferHandle, failed_all
from .namespace import Namespace

if TYPE_CHECKING:  # torch is only needed by engines that allocate KV tensors
    from ..transfer.cuda import CudaKVCache
    from ..transfer.shm import ShmKVCache

log = logging.getLogger("kvtier.client")


class _Unsent(str):
    """Reply slot of a queued frame the socket's owner could not send (text: why).
    Handles treat it like any non-``done`` reply: every block failed."""
SESSION_LOST = ErrorCode.NOT_CONNECTED


class Client:
    def __init__(self, socket: str | None = None, *, name: str = "", timeout: float = 5.0,
                 transfer_timeout: float = 60.0, token: str = "", heartbeat: bool = True,
                 require_daemon: bool = True):
        """Connect and say HELLO. With ``require_daemon=False`` a missing daemon
        is not an error: the client starts degraded and connects when one appears."""
        self.socket_path = socket or default_socket()
        self.name = name or f"pid{os.getpid()}"
        self.timeout, self.transfer_timeout = timeout, transfer_timeout
        self.token = token or os.environ.get("KVTIER_TOKEN", "")  # same variable as the daemon's
        self._ids = itertools.count(1)
        # One thread at a time owns the socket (ZeroMQ sockets are not thread-safe):
        # it sends, polls and files every reply it reads. Others queue frames in
        # the outbox (waking the owner through a pipe) and wait on the condition
        # for their reply, so a thread blocked on a long transfer never delays
        # another thread's lookup.
        self._cv = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._outbox: list[tuple[int, bytes, float]] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = None
        self._replies: dict[int, object] = {}
        self._waiting: set[int] = set()
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._register_args: tuple | None = None
        self._reg: m.Registered | None = None
        self.kv: "ShmKVCache | CudaKVCache | None" = None
        self.block_factor = 1
        self.heartbeat_s = 1.0
        self.reconnects = 0
        self._healthy = False
        self._ipc_event = None  # CUDA: the event recorded on the caller's stream for fences
        self._events: dict = {}  # CUDA: daemon events opened from their IPC handles
        self._closed = False
        try:
            self._open_session(self.timeout)
        except DaemonUnavailable:
            if require_daemon:
                self._close_socket()
                raise
        self._hb_stop = threading.Event()
        self._hb = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat, name="kvtier-heartbeat", daemon=True)
            self._hb.start()

    # ---- session --------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._healthy

    def _open_session(self, wait: float) -> None:
        """New socket, HELLO, replay the registration. Raises DaemonUnavailable."""
        if not self._take(time.monotonic() + wait):
            raise DaemonUnavailable("another thread holds the connection")
        try:
            self._close_socket()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
            sock.connect(endpoint(self.socket_path))
            self._sock = sock
            self._poller = zmq.Poller()
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._wake_r, zmq.POLLIN)
            pid = 0 if self.socket_path.startswith("tcp://") else os.getpid()
            welcome = self._call(m.Hello(m.PROTOCOL_VERSION, pid, self.name, self.token),
                                 timeout=wait, connect_wait=wait)
            self.client_id, self.heartbeat_s = welcome.client_id, welcome.heartbeat_s
            self.max_message = welcome.max_message
            if self._register_args is not None:
                self._reg = self._call(m.Register(*self._register_args), timeout=wait)
            self._healthy = True
        finally:
            self._give()

    def _lose_session(self, why: str) -> None:
        """Mark the daemon gone: every waiting request resolves as failed now."""
        with self._cv:
            if not self._healthy:
                return
            self._healthy = False
            self._fail_waiting(m.Error(int(SESSION_LOST), f"daemon connection lost: {why}", "daemon"))
        log.warning("kvtier: %s; degrading (0 hits, transfers fail) until it is back", why)

    def _fail_waiting(self, reply) -> None:
        """Resolve every request still waiting (and drop unsent ones). Under _cv."""
        for rid in self._waiting:
            self._replies.setdefault(rid, reply)
        self._outbox.clear()
        self._cv.notify_all()

    def _close_socket(self) -> None:
        """Owner only."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            self._poller = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._hb is not None:
            self._hb_stop.set()
            self._hb.join(timeout=5)
        if self._healthy:
            try:
                self._call(m.Bye(), timeout=min(self.timeout, 1.0))
            except KVTierError:
                pass
        owned = self._take(time.monotonic() + self.timeout)
        try:
            if owned:
                self._close_socket()
            with self._cv:
                # BYE made the daemon drop whatever was in flight: fail it now
                # rather than when each handle's transfer_timeout runs out.
                self._fail_waiting(m.Error(int(SESSION_LOST), "client closed", "client"))
                self._healthy = False
        finally:
            if owned:
                self._give()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

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
        if self._healthy:
            try:
                self._reg = self._call(m.Register(*args))
            except DaemonUnavailable as exc:  # gone since the last heartbeat: replay later
                self._lose_session(str(exc))
            except KVTierError as exc:
                if exc.code != SESSION_LOST:
                    raise  # refused (bad spec, namespace clash): nothing to replay
        self._register_args = args
        return self._reg if self._healthy else None

    @property
    def registration(self) -> m.Registered | None:
        """The daemon's answer to the current registration (None while degraded)."""
        return self._reg if self._healthy else None

    def _reg_id(self) -> int:
        if self._register_args is None:
            raise KVTierError(ErrorCode.UNKNOWN_NAMESPACE, "register_kv_cache first", "client")
        return self._reg.reg if self._reg is not None else 0

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` ready in the pool (one round trip); 0
        while the daemon is unreachable."""
        msg = m.Lookup(self._reg_id(), pack_hashes(hashes))
        if not self._healthy:
            return 0
        try:
            return self._call(msg).hits
        except DaemonUnavailable as exc:
            self._lose_session(str(exc))
        except KVTierError as exc:
            if exc.code != SESSION_LOST:
                raise
        return 0

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
        self._check_len(len(block_ids), len(hashes) * self.block_factor)
        msg = m.Store(self._reg_id(), pack_hashes(hashes), pack_ids(block_ids), self._fence(event, stream))
        return self._transfer(msg, len(hashes), block_ids)

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], skip: int = 0, *, event=None,
             stream=None) -> TransferHandle:
        """Copy pool blocks into engine blocks. The result's ``failed`` lists the
        hashes that were not loaded: the engine must recompute those.

        GPU caches: ``stream``/``event`` as for ``store``, marking when the
        engine is done with the destination blocks; before attention reads
        them, call ``handle.wait_event(stream)`` so that stream waits for the
        daemon's copy."""
        self._check_len(len(block_ids), len(hashes) * self.block_factor - skip)
        msg = m.Load(self._reg_id(), pack_hashes(hashes), pack_ids(block_ids), skip, self._fence(event, stream))
        return self._transfer(msg, len(hashes), block_ids)

    # ---- request swap --------------------------------------------------------------------
    def offload(self, request: str | Mapping[str, Sequence[int]],
                block_ids: Sequence[int] | None = None) -> TransferHandle:
        """Swap preempted requests' engine blocks out to the pool.

        ``offload("req-1", ids)`` or ``offload({"req-1": ids, "req-2": ids2})``.
        Requests that do not fit (pool full of swap, quota) come back in
        ``result.failed_requests`` at once, without a copy: soft-reset those.
        Keep the blocks untouched until the handle is done."""
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
        if self._healthy:
            try:
                self._call(msg)
            except DaemonUnavailable as exc:
                self._lose_session(str(exc))
            except KVTierError as exc:
                if exc.code != SESSION_LOST:  # forgotten by the daemon: the swap went with it
                    raise

    # ---- management --------------------------------------------------------------------
    def stats(self, check: bool = False) -> dict:
        """The daemon's stats document; ``check`` also verifies pool integrity."""
        return self._call(m.Stats(check)).stats

    def flush(self, namespace: Namespace | str | None = None) -> int:
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else (namespace or "")
        return self._call(m.Flush(fp)).removed

    def ping(self) -> None:
        self._call(m.Ping())

    # ---- plumbing -----------------------------------------------------------------------
    @staticmethod
    def _check_len(got: int, want: int) -> None:
        if got != want:
            raise ValueError(f"expected {want} block ids, got {got}")

    def _transfer(self, msg, count: int, block_ids: Sequence[int] = (),
                  names: tuple[str, ...] = ()) -> TransferHandle:
        deadline = time.monotonic() + self.transfer_timeout
        held = tuple(block_ids)  # already validated by pack_ids; no per-id conversion
        if not self._healthy:
            return TransferHandle(self, 0, count, deadline,
                                  failed_all(count, "daemon unavailable", names), names)
        try:
            req_id = self._send(msg)
        except DaemonUnavailable as exc:
            self._lose_session(str(exc))
            return TransferHandle(self, 0, count, deadline, failed_all(count, str(exc), names), names)
        return TransferHandle(self, req_id, count, deadline, None, names, held)

    def _fence(self, event, stream) -> bytes:
        """IPC handle of the worker event the daemon must wait on (b"" = none)."""
        if event is not None and stream is not None:
            raise ValueError("pass either event or stream, not both")
        if event is None and stream is None:
            return b""
        if stream is not None:
            from ..transfer.events import record_on
            self._ipc_event = record_on(stream, self._ipc_event)
            event = self._ipc_event
        return event if isinstance(event, bytes) else bytes(event.ipc_handle())

    def open_event(self, handle: bytes, device):
        """The daemon's interprocess event for ``handle``, opened once."""
        from ..transfer.events import open_event
        return open_event(self._events, handle, device)

    # The socket role: reentrant, one thread at a time.
    def _take(self, deadline: float | None = None) -> bool:
        """Become the socket's owner; False if another thread keeps it past ``deadline``
        (None: do not wait at all)."""
        me = threading.get_ident()
        with self._cv:
            while self._owner not in (None, me):
                remaining = -1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cv.wait(remaining)
            self._owner = me
            self._depth += 1
            return True

    def _give(self) -> None:
        with self._cv:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cv.notify_all()  # a waiter may take over (and flush the outbox)

    def _send(self, msg, connect_wait: float | None = None) -> int:
        """Send (or queue for the socket's owner) one request; returns its id.
        Raises DaemonUnavailable when this thread sends and no daemon is there."""
        req_id = next(self._ids)
        frame = encode(msg, req_id)
        wait = min(self.timeout, 1.0) if connect_wait is None else connect_wait
        with self._cv:
            self._waiting.add(req_id)
            if self._owner not in (None, threading.get_ident()):
                self._outbox.append((req_id, frame, wait))
                try:
                    os.write(self._wake_w, b"x")  # the owner is in poll(): wake it to send
                except BlockingIOError:
                    pass  # pipe full: the owner is already due to wake
                return req_id
            self._owner = threading.get_ident()
            self._depth += 1
        try:
            self._flush()
            self._transmit(frame, wait)
        except DaemonUnavailable:
            with self._cv:
                self._waiting.discard(req_id)
            raise
        finally:
            self._give()
        return req_id

    def _transmit(self, frame: bytes, wait: float) -> None:
        """Owner only. IMMEDIATE: writable only while a daemon is connected; wait a
        bounded time (fresh socket, daemon restarting), then report it missing."""
        if self._sock is None or not self._sock.poll(int(wait * 1000), zmq.POLLOUT):
            raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path}")
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path}") from None

    def _flush(self) -> None:
        """Owner only: send what other threads queued; a failure fails that request."""
        while True:
            with self._cv:
                if not self._outbox:
                    return
                req_id, frame, wait = self._outbox.pop(0)
            try:
                self._transmit(frame, wait)
            except DaemonUnavailable as exc:
                with self._cv:
                    if req_id in self._waiting:
                        self._replies[req_id] = _Unsent(str(exc))
                        self._cv.notify_all()

    def _call(self, msg, timeout: float | None = None, connect_wait: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        req_id = self._send(msg, connect_wait)
        reply = self._poll_reply(req_id, timeout)
        if reply is None:
            self._abandon(req_id)
            raise DaemonUnavailable(f"no reply from {self.socket_path} within {timeout}s")
        if isinstance(reply, _Unsent):  # queued by us; the owner found no daemon to send it to
            raise DaemonUnavailable(str(reply))
        if isinstance(reply, m.Error):
            raise KVTierError(reply.code, reply.message, reply.side)
        return reply

    def _poll_reply(self, req_id: int, timeout: float):
        """The reply for ``req_id`` if it arrives within ``timeout``, else None.
        Pumps the socket when no other thread does; otherwise waits to be told."""
        deadline = time.monotonic() + timeout
        me = threading.get_ident()
        while True:
            with self._cv:
                if req_id in self._replies:
                    self._waiting.discard(req_id)
                    return self._replies.pop(req_id)
                remaining = deadline - time.monotonic()
                if self._owner not in (None, me):
                    if remaining <= 0:
                        return None
                    self._cv.wait(remaining)  # the owner files replies and notifies
                    continue
                self._owner = me
                self._depth += 1
            try:
                self._pump(max(0.0, min(remaining, 0.1)))
            finally:
                self._give()
            if remaining <= 0:
                with self._cv:
                    if req_id in self._replies:
                        self._waiting.discard(req_id)
                        return self._replies.pop(req_id)
                return None

    def _pump(self, slice_s: float) -> None:
        """Owner only: send queued frames, wait up to ``slice_s`` for traffic, file replies."""
        self._flush()
        if self._poller is None:
            time.sleep(min(slice_s, 0.05))
            return
        events = dict(self._poller.poll(int(slice_s * 1000)))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            self._flush()
        if self._sock in events:
            self._drain()

    def _drain(self) -> None:
        """Owner only: read every reply available and hand each to its waiter."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                rid, reply = decode(frame, 1 << 30)
            except ProtocolError as exc:  # never the engine's problem: its caller times out
                log.warning("kvtier: dropped an undecodable reply from the daemon: %s", exc)
                continue
            if isinstance(reply, m.Error) and reply.code == SESSION_LOST:
                # The daemon forgot us (restart, reaped): it will answer nothing
                # else in flight, so fail those now and let the heartbeat reconnect.
                self._lose_session("the daemon no longer knows this client")
            with self._cv:
                if rid in self._waiting:
                    self._replies[rid] = reply
                    self._cv.notify_all()

    def _abandon(self, req_id: int) -> None:
        with self._cv:
            self._waiting.discard(req_id)
            self._replies.pop(req_id, None)

    def _heartbeat(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_s):
            try:
                self._beat()
            except Exception:  # if this thread died the client would never reconnect
                log.exception("kvtier: heartbeat failed; trying again next period")

    def _beat(self) -> None:
        """Ping while healthy, reconnect while not."""
        if not self._healthy:
            self._reconnect()
            return
        try:
            self._call(m.Ping(), timeout=max(2 * self.heartbeat_s, 1.0))
        except DaemonUnavailable as exc:
            self._lose_session(str(exc))
        except KVTierError as exc:
            if exc.code == SESSION_LOST:
                self._lose_session("the daemon no longer knows this client")

    def _reconnect(self) -> None:
        try:
            self._open_session(min(self.timeout, 1.0))
        except KVTierError:
            return
        self.reconnects += 1
        log.warning("kvtier: reconnected to %s as client %d", self.socket_path, self.client_id)
