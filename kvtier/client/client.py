"""The engine-side client: one DEALER socket to the daemon.

Thread-safe for one engine worker: calls from several threads share the socket
under a lock; replies are matched to requests by id. A background thread
sends a PING when the client has been quiet for a heartbeat period, so the
daemon can tell a live idle client from a hung one.

Primitives: ``register_kv_cache``, ``lookup``, ``store``/``load`` (handles),
``stats``, ``flush``, ``close``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Sequence

import zmq

from ..protocol import messages as m
from ..protocol.arrays import pack_hashes, pack_ids
from ..protocol.codec import decode, encode
from ..protocol.endpoints import default_socket, endpoint
from ..protocol.errors import ErrorCode
from .errors import DaemonUnavailable, KVTierError
from .handles import TransferHandle, failed_all
from .namespace import Namespace

if TYPE_CHECKING:  # torch is only needed by engines that allocate KV tensors
    from ..transfer.cuda import CudaKVCache
    from ..transfer.shm import ShmKVCache


class Client:
    def __init__(self, socket: str | None = None, *, name: str = "", timeout: float = 5.0,
                 transfer_timeout: float = 60.0, token: str = "", heartbeat: bool = True):
        self.socket_path = socket or default_socket()
        self.name = name or f"pid{os.getpid()}"
        self.timeout, self.transfer_timeout, self.token = timeout, transfer_timeout, token
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._replies: dict[int, object] = {}
        self._waiting: set[int] = set()
        self._last_send = time.monotonic()
        self._ctx = zmq.Context.instance()
        self._sock = None
        self._reg: m.Registered | None = None
        self.kv: "ShmKVCache | CudaKVCache | None" = None
        self._ipc_event = None  # CUDA: the event recorded on the caller's stream for fences
        self._events: dict = {}  # CUDA: daemon events opened from their IPC handles
        self._closed = False
        self._connect()
        self._hb_stop = threading.Event()
        self._hb = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat, name="kvtier-heartbeat", daemon=True)
            self._hb.start()

    # ---- session --------------------------------------------------------------------
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a daemon that is not there
        sock.connect(endpoint(self.socket_path))
        self._sock = sock
        pid = 0 if self.socket_path.startswith("tcp://") else os.getpid()
        welcome = self._call(m.Hello(m.PROTOCOL_VERSION, pid, self.name, self.token))
        self.client_id, self.heartbeat_s = welcome.client_id, welcome.heartbeat_s
        self.max_message = welcome.max_message

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        try:
            self._call(m.Bye(), timeout=min(self.timeout, 1.0))
        except KVTierError:
            pass
        with self._lock:
            self._sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- registration ---------------------------------------------------------------
    def register_kv_cache(self, kv: "ShmKVCache | CudaKVCache", block_dims: Sequence[int], namespace: Namespace | str,
                          block_factor: int = 1, swap_quota: int = -1) -> m.Registered:
        """Export the engine's KV tensors once. ``block_dims[i]`` is the dimension
        of tensor i that indexes engine blocks (1 for FlashAttention's
        ``(2, num_blocks, ...)``, 0 for FlashInfer/MLA)."""
        fp = namespace.fingerprint() if isinstance(namespace, Namespace) else namespace
        reply = self._call(m.Register(fp, kv.specs(list(block_dims)), block_factor, swap_quota))
        self._reg, self.kv = reply, kv
        self.block_factor = block_factor
        return reply

    @property
    def registration(self) -> m.Registered:
        if self._reg is None:
            raise KVTierError(ErrorCode.UNKNOWN_NAMESPACE, "register_kv_cache first", "client")
        return self._reg

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` ready in the pool (one round trip)."""
        return self._call(m.Lookup(self.registration.reg, pack_hashes(hashes))).hits

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
        reg = self.registration
        self._check_len(len(block_ids), len(hashes) * self.block_factor)
        msg = m.Store(reg.reg, pack_hashes(hashes), pack_ids(block_ids), self._fence(event, stream))
        return self._transfer(msg, len(hashes), block_ids)

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], skip: int = 0, *, event=None,
             stream=None) -> TransferHandle:
        """Copy pool blocks into engine blocks. The result's ``failed`` lists the
        hashes that were not loaded: the engine must recompute those.

        GPU caches: ``stream``/``event`` as for ``store``, marking when the
        engine is done with the destination blocks; before attention reads
        them, call ``handle.wait_event(stream)`` so that stream waits for the
        daemon's copy."""
        reg = self.registration
        self._check_len(len(block_ids), len(hashes) * self.block_factor - skip)
        msg = m.Load(reg.reg, pack_hashes(hashes), pack_ids(block_ids), skip, self._fence(event, stream))
        return self._transfer(msg, len(hashes), block_ids)

    # ---- management --------------------------------------------------------------------
    def stats(self) -> dict:
        return self._call(m.Stats()).stats

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

    def _transfer(self, msg, count: int, block_ids: Sequence[int] = ()) -> TransferHandle:
        deadline = time.monotonic() + self.transfer_timeout
        held = tuple(int(b) for b in block_ids)
        try:
            req_id = self._send(msg)
        except DaemonUnavailable as exc:
            return TransferHandle(self, 0, count, deadline, failed_all(count, str(exc)), held)
        return TransferHandle(self, req_id, count, deadline, None, held)

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

    def _send(self, msg) -> int:
        req_id = next(self._ids)
        frame = encode(msg, req_id)
        with self._lock:
            # IMMEDIATE: writable only once a daemon is connected. Wait a bounded
            # time for the connection (fresh socket, daemon restarting).
            if not self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
                raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path}")
            try:
                self._sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                raise DaemonUnavailable(f"no kvtier daemon at {self.socket_path}") from None
            self._waiting.add(req_id)
            self._last_send = time.monotonic()
        return req_id

    def _call(self, msg, timeout: float | None = None):
        req_id = self._send(msg)
        reply = self._poll_reply(req_id, self.timeout if timeout is None else timeout)
        if reply is None:
            self._abandon(req_id)
            raise DaemonUnavailable(f"no reply from {self.socket_path} within "
                                    f"{self.timeout if timeout is None else timeout}s")
        if isinstance(reply, m.Error):
            raise KVTierError(reply.code, reply.message, reply.side)
        return reply

    def _poll_reply(self, req_id: int, timeout: float):
        """The reply for ``req_id`` if it arrives within ``timeout``, else None."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if req_id in self._replies:
                    self._waiting.discard(req_id)
                    return self._replies.pop(req_id)
                remaining = deadline - time.monotonic()
                # Short slices so another thread's reply is never held back long.
                if self._sock.poll(int(max(0.0, min(remaining, 0.05)) * 1000)):
                    self._drain()
                    continue
            if remaining <= 0:
                return None

    def _drain(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            rid, reply = decode(frame, 1 << 30)
            if rid in self._waiting:
                self._replies[rid] = reply

    def _abandon(self, req_id: int) -> None:
        with self._lock:
            self._waiting.discard(req_id)
            self._replies.pop(req_id, None)

    def _heartbeat(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_s / 2):
            if time.monotonic() - self._last_send < self.heartbeat_s:
                continue
            try:
                rid = self._send(m.Ping())
                self._abandon(rid)  # the reply is not needed, only the traffic
            except (KVTierError, zmq.ZMQError):
                pass

