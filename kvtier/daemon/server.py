"""The daemon: pool owner, ZeroMQ ROUTER, synchronous poll loop.

Loop: poll the ROUTER socket, the copy worker's wakeup pipe and the signal
pipe; decode each frame, dispatch it at one point that maps every exception to
an error reply; finish copies that completed; reap dead clients; publish
block events. Copies run on the worker threads; everything else (index,
allocator, client table) is touched only by this thread, so it needs no locks.
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import signal
import time
from collections import Counter

import msgpack
import psutil
import torch
import zmq

from ..pool.allocator import SlabAllocator
from ..pool.index import BlockIndex
from ..pool.policy import POLICIES
from ..pool.swap import SwapTable
from ..pool.segment import ShmSegment, cleanup_stale, pid_of, unlink_segment
from ..pool.sizes import format_size
from ..protocol import messages as m
from ..protocol.codec import decode, encode
from ..protocol.endpoints import endpoint
from ..protocol.errors import ErrorCode, ProtocolError, side_of
from ..transfer.shm import KV_PREFIX
from ..transfer.worker import CopyWorker
from .config import DaemonConfig
from .copies import Copies
from .handlers import Handlers
from .housekeeping import Housekeeping
from .state import ClientState, DaemonError, Registration
from .stats import StatsMixin

log = logging.getLogger("kvtier.daemon")
POOL_PREFIX = "kvtier-pool."
DRAIN_TIMEOUT_S = 30.0


class StartupError(RuntimeError):
    """The daemon cannot start with this configuration (message says why)."""


class Daemon(Handlers, Copies, StatsMixin, Housekeeping):
    def __init__(self, config: DaemonConfig, notifier=None, reloader=None):
        self.config = config
        self.init_housekeeping(notifier, reloader)
        self.started = time.time()
        self.clients: dict[bytes, ClientState] = {}
        self.next_client = self.next_reg = 0
        self.counters: Counter = Counter()
        self.errors: Counter = Counter()
        self._stop = False
        self.remote = None
        self._lock_fd = self._take_socket_lock()
        self.notifier.status("removing stale shared memory")
        for prefix in (POOL_PREFIX, KV_PREFIX):
            cleanup_stale(prefix)
        self._check_ram()
        self.pool_name = f"/{POOL_PREFIX}{os.getpid()}"
        self.notifier.status(f"mapping pool ({format_size(config.pool_size)})")
        try:
            self.segment = ShmSegment(self.pool_name, config.pool_size, create=True, mode=config.shm_mode)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self.pool = torch.frombuffer(self.segment.buffer, dtype=torch.uint8)
        self.index = BlockIndex(SlabAllocator(config.pool_size, config.slab_size),
                                POLICIES[config.policy]())
        self.index.record_events = bool(config.events)
        self.event_seq = 0  # last block-event message number published
        self.crcs: dict[int, int] = {}  # pool offset -> crc32 of its last committed bytes
        self.swap = SwapTable(self.index, int(config.pool_size * config.swap_max))
        self.gpu = self._start_gpu()
        self.worker = CopyWorker(config.copy_threads)
        self.notifier.status(f"binding {config.socket}")
        self._bind()
        self.remote = self._start_remote()  # remote tier hook: None when config.remote is off
        try:
            self.start_metrics()
        except OSError as exc:
            self.shutdown()
            raise StartupError(f"metrics {config.metrics}: {exc}") from None
        log.info("kvtier-daemon pid %d: pool %s (%s), socket %s", os.getpid(), self.pool_name,
                 format_size(config.pool_size), config.socket)

    # ---- startup ------------------------------------------------------------------
    def _take_socket_lock(self) -> int | None:
        if self.config.socket.startswith(("tcp://", "ipc://")):
            return None
        d = os.path.dirname(os.path.abspath(self.config.socket))
        os.makedirs(d, mode=0o750, exist_ok=True)
        fd = os.open(self.config.socket + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(f"another kvtier-daemon is serving {self.config.socket}") from None
        return fd

    def _check_ram(self) -> None:
        avail = psutil.virtual_memory().available
        limit = int(avail * self.config.ram_fraction)
        if self.config.pool_size > limit:
            raise StartupError(
                f"pool size {format_size(self.config.pool_size)} exceeds {self.config.ram_fraction:.0%} "
                f"of available RAM ({format_size(avail)}); lower pool_size or raise ram_fraction")

    def _start_gpu(self):
        """The CUDA data path (pins the pool in the background), or None.
        CUDA code is imported only when a device is visible and gpu != off."""
        if self.config.gpu == "off":
            return None
        if not torch.cuda.is_available():
            if self.config.gpu == "on":
                self._abort_start("gpu = on but no CUDA device is visible")
            return None
        from ..transfer.gpu import GpuContext
        slab = self.config.slab_size  # chunks of whole slabs: no block straddles two registrations
        chunk = max(slab, self.config.pin_chunk // slab * slab)
        try:
            ctx = GpuContext(self.pool, chunk, self.config.gpu_copy)
        except Exception as exc:  # a broken driver must not take the CPU tier down with it
            if self.config.gpu == "on":
                self._abort_start(f"gpu = on but CUDA failed to start: {exc}")
            log.error("CUDA data path disabled: %s", exc)
            return None
        log.info("CUDA data path on %d device(s); pinning the pool in %s chunks",
                 len(ctx.uuids), format_size(chunk))
        return ctx

    def _start_remote(self):
        # remote tier hook: the bridge answers some lookups/loads later, via _send / handle
        from ..remote.bridge import open_remote
        try:
            return open_remote(self.config, self.segment.buffer, self.index, self._send, self.handle,
                               self.crcs if self.config.checksums else None)
        except ImportError as exc:
            self.shutdown()
            raise StartupError(str(exc)) from None

    def _abort_start(self, why: str):
        self.pool = None  # the tensor over the mapping must go before the unmap
        self.segment.close(unlink=True)
        raise StartupError(why)

    def _bind(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 100_000)
        self.router.setsockopt(zmq.RCVHWM, 100_000)
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.max_message)  # hard backstop
        if self._lock_fd is not None and os.path.exists(self.config.socket):
            os.unlink(self.config.socket)  # we hold the lock: the old daemon is gone
        old = os.umask(0o777 & ~self.config.socket_mode)
        try:
            self.router.bind(endpoint(self.config.socket))
        finally:
            os.umask(old)
        if self._lock_fd is not None:
            os.chmod(self.config.socket, self.config.socket_mode)
            if self.config.socket_group:
                try:
                    os.chown(self.config.socket, -1, grp.getgrnam(self.config.socket_group).gr_gid)
                except (KeyError, PermissionError) as exc:
                    raise StartupError(f"socket_group {self.config.socket_group!r}: {exc}") from None
        if self.config.tcp:
            self.router.bind(self.config.tcp)
        self.pub = None
        if self.config.events:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(endpoint(self.config.events))
        self._sig_r, self._sig_w = os.pipe()
        os.set_blocking(self._sig_w, False)
        os.set_blocking(self._sig_r, False)

    # ---- loop -------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        """Signal-safe: ask the loop to drain and exit."""
        self._stop = True
        self.wake_loop(b"s")

    def wake_loop(self, why: bytes) -> None:
        """Signal-safe: make the poll return now (the signal pipe is in the poller)."""
        try:
            os.write(self._sig_w, why)
        except OSError:
            pass

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def serve_forever(self, ready=None) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.worker.wakeup_fd, zmq.POLLIN)
        poller.register(self._sig_r, zmq.POLLIN)
        if self.remote is not None:  # remote tier hook: its completions wake the loop
            poller.register(self.remote.wakeup_fd, zmq.POLLIN)
        if ready:
            ready()
        next_reap = next_sweep = time.monotonic()
        try:
            while not self._stop:
                timeout = min(max(0.0, next_reap - time.monotonic()), self._housekeeping())
                events = dict(poller.poll(timeout * 1000))
                try:
                    if self.router in events:
                        self._read_requests()
                    if self.worker.wakeup_fd in events:
                        self._finish_copies()
                    if self.remote is not None and self.remote.wakeup_fd in events:
                        self.remote.poll()  # remote tier hook: probes, fetches, write-behind done
                    if time.monotonic() >= next_reap:
                        next_reap = time.monotonic() + self.config.reap_interval_s
                        self.reap_dead()
                    if time.monotonic() >= next_sweep:
                        # KV segments of workers that died before HELLO or after BYE (or exited
                        # without closing their cache): no reap ever unlinks those.
                        next_sweep = time.monotonic() + max(10 * self.config.reap_interval_s, 1.0)
                        cleanup_stale(KV_PREFIX)
                    self._publish_events()
                except Exception:  # a bug must not take every engine's cache down with it
                    log.exception("internal error in the daemon loop; continuing")
                    self.errors[ErrorCode.INTERNAL.name] += 1
        finally:
            self.shutdown()

    def _housekeeping(self) -> float:
        try:
            return self.housekeeping()
        except Exception:  # a failed reload or stats snapshot must not stop the cache either
            log.exception("internal error in housekeeping; continuing")
            self.errors[ErrorCode.INTERNAL.name] += 1
            return 1.0

    def _read_requests(self) -> None:
        for _ in range(256):  # bounded batch so completions and reaping stay timely
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.errors[ErrorCode.BAD_MESSAGE.name] += 1
                log.warning("dropped message with %d frames (expected identity + 1)", len(frames))
                if len(frames) > 2:
                    self._send(frames[0], 0, m.Error(ErrorCode.BAD_MESSAGE, "expected exactly one frame",
                                                     "client"))
                continue
            self.handle(frames[0], frames[1])

    def handle(self, identity: bytes, frame: bytes) -> None:
        """The one dispatch point: every request gets a reply or an error."""
        req_id = 0
        client = self.clients.get(identity)
        try:
            try:
                req_id, msg = decode(frame, self.config.max_message)
            except ProtocolError as exc:
                req_id = exc.request_id  # answer under the caller's id when it was readable
                raise
            self.counters["requests"] += 1
            handler = getattr(self, "on_" + type(msg).__name__.lower(), None)
            if handler is None or msg.TAG not in REQUEST_TAGS:
                raise DaemonError(ErrorCode.UNKNOWN_OP, f"{msg.TAG!r} is not a request")
            # PING needs a session: its NOT_CONNECTED answer tells a forgotten client to reconnect.
            # STATS is served without a session only when no token guards the daemon.
            if client is None and not (isinstance(msg, m.Hello)
                                       or (isinstance(msg, m.Stats) and not self.config.token)):
                raise DaemonError(ErrorCode.NOT_CONNECTED, "say HELLO first")
            if self._stop and isinstance(msg, (m.Store, m.Load, m.Offload, m.Restore, m.Register)):
                raise DaemonError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
            if client is not None:
                client.last_seen = time.monotonic()
            reply = handler(identity, client, req_id, msg)
        except (ProtocolError, DaemonError) as exc:
            reply = self._error(exc.code, exc.message, client)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("internal error handling a request from %r", client.id if client else identity)
            reply = self._error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", client)
        if reply is not None:
            self._send(identity, req_id, reply)

    def _error(self, code: ErrorCode, message: str, client) -> m.Error:
        self.errors[code.name] += 1
        log.warning("error %s to client %s: %s", code.name, client.id if client else "-", message)
        return m.Error(int(code), message, side_of(code))

    def _send(self, identity: bytes, req_id: int, reply) -> None:
        try:
            self.router.send_multipart([identity, encode(reply, req_id)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("reply dropped: %s", exc)

    # ---- clients -----------------------------------------------------------------------
    def reap_dead(self) -> None:
        now = time.monotonic()
        for c in list(self.clients.values()):
            if not c.process_alive():
                self.reap(c, "process exited")
            elif now - c.last_seen > self.config.reap_after_s:
                self.reap(c, f"silent for {now - c.last_seen:.1f}s")

    def reap(self, c: ClientState, why: str) -> None:
        """Release everything a client holds; its in-flight stores commit nothing."""
        self.clients.pop(c.identity, None)
        caches = len(c.regs)
        for op in list(c.ops):
            if op.kind == "store":
                op.plan.abandoned = True
        for reg in list(c.regs.values()):
            self.close_registration(reg)
        self.release_swap(c)
        self.counters["reaped"] += why not in ("bye", "re-hello")
        log.info("client %d (pid %d) %s: released %d caches", c.id, c.pid,
                 "disconnected" if why == "bye" else f"reaped ({why})", caches)
        if why == "process exited":
            self._unlink_client_segments(c)

    def close_registration(self, reg: Registration) -> None:
        reg.closing = True
        if reg.inflight == 0:
            self._release(reg)

    def _release(self, reg: Registration) -> None:
        reg.client.regs.pop(reg.id, None)
        reg.copier = None
        reg.layout = None  # drop every tensor view before unmapping (CUDA: closes the IPC mapping)
        for seg in reg.segments:
            try:
                seg.close(unlink=False)
            except BufferError:
                log.error("segment %s still has live views; leaving it mapped", seg.name)
        reg.segments = []

    def _unlink_client_segments(self, c: ClientState) -> None:
        prefix = "/" + KV_PREFIX
        for name in os.listdir("/dev/shm"):
            if name.startswith(KV_PREFIX) and pid_of(name[len(KV_PREFIX) - 1:]) == c.pid:
                unlink_segment(prefix + name[len(KV_PREFIX):])

    def release_swap(self, c: ClientState) -> None:
        n = self.swap.release_owner(c.id)
        if n:
            log.info("client %d: freed %d swapped requests", c.id, n)

    # ---- events --------------------------------------------------------------------------
    def _publish_events(self) -> None:
        events = self.index.take_events()
        if not events or self.pub is None:
            return
        by_ns: dict[str, list] = {}
        for kind, ns, key in events:
            by_ns.setdefault(ns, []).append((kind, key))
        for ns, items in by_ns.items():
            self.event_seq += 1
            body = {"seq": self.event_seq, "ts": time.time(),
                    "events": [[kind, key] for kind, key in items]}
            try:
                self.pub.send_multipart([ns.encode(), msgpack.packb(body, use_bin_type=True)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.stop_housekeeping()
        log.info("shutting down: draining %d copies", self.worker.pending)
        self.worker.drain(DRAIN_TIMEOUT_S)
        self._finish_copies()
        for c in list(self.clients.values()):
            self.reap(c, "daemon shutdown")
        self.worker.close()
        if self.remote is not None:  # remote tier hook: its threads write into the pool
            self.remote.close()
        self.router.close(0)
        if self.pub is not None:
            self.pub.close(0)
        self.ctx.term()
        if self.gpu is not None:
            self.gpu.close()  # unpin before the pool is unmapped
            self.gpu = None
        self.pool = None
        try:
            self.segment.close(unlink=True)
        except BufferError:
            unlink_segment(self.pool_name)
        if self._lock_fd is not None:
            for path in (self.config.socket,):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            os.close(self._lock_fd)
        for fd in (self._sig_r, self._sig_w):
            os.close(fd)
        log.info("kvtier-daemon stopped")


REQUEST_TAGS = {cls.TAG for cls in (m.Hello, m.Register, m.Unregister, m.Lookup, m.Store, m.Load,
                                    m.Offload, m.Restore, m.Discard, m.Stats, m.Flush, m.Ping, m.Bye)}
