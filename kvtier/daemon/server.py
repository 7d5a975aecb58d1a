"""The daemon: composes its parts and runs the synchronous poll loop.

Parts (each in its own module, each given what it needs):
  pool        ShmSegment + BlockIndex (prefix cache, eviction) + SwapTable
  Listener    ROUTER/PUB sockets                       (listen.py)
  Sessions    clients, registrations, reaping          (sessions.py)
  CopyRunner  running copies, cancel, completion       (copies.py, ops.py)
  Dispatcher       the one dispatch point               (dispatch.py)
  RequestHandlers  the dispatch table                  (requests.py)
  Housekeeping     systemd notify, reload, metrics     (housekeeping.py)
  start-up checks  RAM, pool segment, mirrors, CUDA    (startup.py)
  DiskBridge       optional local disk tier             (kvtier/disk)
  RemoteBridge     optional Redis Cluster tier          (kvtier/remote)

Loop: poll the ROUTER, the copy worker's wakeup fd and the signal waker;
dispatch each frame at one point that maps every exception to an error
reply; finish copies that completed; reap dead clients; publish block
events. Copies run on worker threads; everything else is touched only by
this thread, so it needs no locks.

Stopping (SIGTERM): the loop keeps serving while in-flight copies finish -
new work gets SHUTTING_DOWN, pings and cancels are answered, each transfer
is answered when its copy ends; after ``drain_timeout_s`` the rest are
cancelled (they stop within one chunk) and answered too. Only then are
clients reaped and the pool unmapped.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

import msgpack
import torch
import zmq

from ..disk.setup import open_disk
from ..pool.allocator import SlabAllocator, fit_warning
from ..pool.index import BlockIndex
from ..pool.keys import split_key
from ..pool.policy import POLICIES
from ..pool.segment import cleanup_stale, unlink_segment
from ..pool.sizes import format_size
from ..pool.swap import SwapTable
from ..protocol.errors import ErrorCode
from ..waker import Waker
from .config import DaemonConfig
from .copies import CopyRunner
from .dispatch import Dispatcher
from .flushes import Flushes
from .housekeeping import Housekeeping
from .guard import ConnectionGuard, fd_headroom, map_headroom
from .listen import HANDOVER_SUFFIX, Listener, StartupError, UnfitConfig, remove_our_socket, take_socket_lock
from .lookup_index import STALE_PREFIX as INDEX_PREFIX
from .replies import Replies
from .requests import RequestHandlers
from .sessions import Sessions
from .startup import POOL_PREFIX, check_checksum, check_ram, new_pool, start_gpu, start_lookup_indexes
from .stats import daemon_stats
from .tenancy import cluster_names
from .warm import WarmPool, discard_kept

__all__ = ["Daemon", "StartupError", "UnfitConfig"]
log = logging.getLogger("kvtier.daemon")
QUIET_BEFORE_EXIT_MS = 100  # at exit, requests that arrive within this of each other are still read
CANCEL_GRACE_S = 5.0  # after cancelling at the drain deadline, wait this long for copies to stop
MAX_EVENTS_PER_MESSAGE = 512  # a flush of 100,000 blocks is 196 messages of ~15 KiB, not one of 3 MiB


class Daemon:
    def __init__(self, config: DaemonConfig, notifier=None, reloader=None):
        self.housekeeping = Housekeeping(config, notifier, reloader, self.stats)
        self.copies = self.remote = self.disk = self.lookup_indexes = None
        self.notifier = self.housekeeping.notifier
        self.started = time.time()
        self.counters: Counter = Counter()
        self.errors: Counter = Counter()
        self.stopping = False
        self._closed = False
        self._lock_fd = take_socket_lock(config.socket)
        self.notifier.status("removing stale shared memory")
        for prefix in (POOL_PREFIX, INDEX_PREFIX):
            cleanup_stale(prefix)
        self.warm = WarmPool(config) if config.warm_restart else None  # warm.py: the pool outlives us
        if self.warm is None:
            discard_kept(config)
        check_ram(config, self.warm.kept_bytes() if self.warm else 0)
        check_checksum()
        self.notifier.status(f"mapping pool ({format_size(config.pool_size)})")
        log.info("reserving and prefaulting a %s pool (about a second per GiB per core) unless one was kept...",
                 format_size(config.pool_size))
        try:
            self.segment = self.warm.open() if self.warm else None
            if self.segment is None:  # warm_restart off, or its name is held by another user
                self.warm = None
                self.segment = new_pool(config)
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self.pool_name = self.segment.name
        self.pool = torch.frombuffer(self.segment.buffer, dtype=torch.uint8)
        self.lookup_indexes = start_lookup_indexes(config)
        # Built whole, each given what it talks to; the tiers first, handed down to what calls them.
        background = self.segment.background  # a new pool still faulting in: its slabs come as they are in
        self.index = BlockIndex(SlabAllocator(config.pool_size, config.slab_size,
                                              background.done if background is not None else None),
                                POLICIES[config.policy](),
                                config.tenant_share, events=bool(config.events), mirror=self.lookup_indexes,
                                journal=self.warm)
        if (why := fit_warning(config.pool_size, config.slab_size)) is not None:
            log.warning("%s", why)  # status counts the blocks the slabs hold, not the pool's size
        self.event_seq = 0  # last block-event message number published
        self.swap = SwapTable(self.index, int(config.pool_size * config.swap_max))
        self.crcs: dict[int, int] = {}  # pool offset -> crc32 of its committed bytes (copies, tiers, warm)
        crcs = self.crcs if config.checksums else None
        try:
            self.gpu = start_gpu(self.pool, config)
        except StartupError as exc:  # gpu = on and CUDA cannot serve
            self._abort_start(str(exc))
        self.notifier.status(f"binding {config.socket}")
        try:
            fd_headroom(config)
            map_headroom(config)
        except ValueError as exc:
            self._abort_start(str(exc))
        self.listener = Listener(config, owns_path=self._lock_fd is not None)
        send, getter = self.listener.send, (lambda: self.config)  # the config: replaced whole on SIGHUP
        from ..remote.bridge import open_remote  # here: redis is imported only when it is used
        self.disk = self._start_tier(open_disk, config, self.index, crcs, self.warm, self.segment.name)
        self.remote = self._start_tier(open_remote, config, self.index, send, crcs, cluster_names(config))
        tiers = [t for t in (self.disk, self.remote) if t is not None]
        self.sessions = Sessions(getter, self.index, self.swap, self.counters, self.gpu, self.listener.handover,
                                 self.lookup_indexes, self.disk)
        if self.lookup_indexes is not None and self.listener.handover is not None:  # engines of other users
            mirrors, sessions = self.lookup_indexes, self.sessions
            self.listener.handover.serve_mirrors(lambda peer, name: mirrors.open_for(sessions.clients.values(), peer, name))
        self.copies = CopyRunner(self.pool, self.segment.buffer if config.checksums or self.warm else None,
                                 getter, send, self.sessions.release_if_idle, self.counters, self.errors,
                                 self.housekeeping.latency, crcs=self.crcs, journal=self.warm,
                                 on_commit=[t.committed for t in tiers])  # the tiers' write-behind
        self.guard = ConnectionGuard(self.listener.router, self._lock_fd is not None and config.socket or "",
                                     getter, self.sessions.hung_up)
        if self.warm is not None:  # the kept blocks become READY before the first request
            # and the tiers get them: what a SIGKILL left unwritten below is written now, or counted
            self.warm.adopt(self.index, crcs, tiers)
            self.warm.journal.cap_tenants(config.tenant_share)  # its records, like its slabs
        self.flushes = Flushes(self.index, send, self.counters, self.disk)
        replies = Replies(send, self.errors)
        self.handlers = RequestHandlers(self.sessions, self.copies, self.index, self.swap, self.stats, self.flushes,
                                        replies, lambda: self.stopping, self.disk, self.remote)
        self.dispatcher = Dispatcher(getter, self.listener, self.sessions, self.handlers, self.guard, replies,
                                     lambda: self.stopping, self.counters)
        self.signals = Waker()
        try:
            self.housekeeping.start_metrics()
        except OSError as exc:
            self.shutdown()
            raise StartupError(f"metrics {config.metrics}: {exc}") from None
        log.info("kvtier-daemon pid %d: pool %s (%s), socket %s", os.getpid(), self.pool_name,
                 format_size(config.pool_size), config.socket)

    @property
    def config(self) -> DaemonConfig:
        return self.housekeeping.config  # replaced whole on SIGHUP

    def stats(self, viewer=None) -> dict:
        """The stats document as ``viewer`` (a client; None: the operator) may see it."""
        return daemon_stats(self, viewer)

    # ---- startup ------------------------------------------------------------------
    def _start_tier(self, open_tier, config: DaemonConfig, *args):
        """The disk tier (disk.setup) or the remote tier (remote.bridge) behind this pool, or None
        when off. It answers some lookups later through ``send`` (remote), and hands a load it
        took back to the load path once its blocks are in the pool (daemon/pending.py)."""
        try:
            return open_tier(config, self.segment.buffer, *args)
        except ImportError as exc:
            self.shutdown()
            raise StartupError(str(exc)) from None
        except ValueError as exc:  # a secret file or disk_path missing, exposed or malformed: no retry fixes that
            self.shutdown()
            raise UnfitConfig(str(exc)) from None

    def _abort_start(self, why: str):
        self.pool = None  # the tensor over the mapping must go before the unmap
        self.segment.close(unlink=self.warm is None)
        raise StartupError(why)

    # ---- signals --------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        """Signal-safe: start draining; the loop exits when copies are done."""
        self.stopping = True
        self.signals.wake(b"s")

    def request_reload(self, *_args) -> None:
        """Signal-safe (SIGHUP): re-read the config at the next loop turn."""
        self.housekeeping.request_reload()
        self.signals.wake(b"h")

    def request_gc_audit(self, *_args) -> None:
        """Signal-safe (SIGUSR1): log what freezing the collector's survivors kept (tenure.py)."""
        self.housekeeping.request_gc_audit()
        self.signals.wake(b"g")

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        signal.signal(signal.SIGUSR1, self.request_gc_audit)

    def notify_ready(self) -> None:
        self.housekeeping.notify_ready()

    # ---- loop -------------------------------------------------------------------------
    def serve_forever(self, ready=None) -> None:
        poller = zmq.Poller()
        poller.register(self.listener.router, zmq.POLLIN)
        poller.register(self.copies.wakeup_fd, zmq.POLLIN)
        poller.register(self.signals.fd, zmq.POLLIN)
        tiers = [t for t in (self.disk, self.remote) if t is not None]  # their I/O threads report here
        for t in tiers:
            poller.register(t.wakeup_fd, zmq.POLLIN)
        poller.register(self.guard.fd, zmq.POLLIN)
        faulting = self.segment.background
        if faulting is not None:
            poller.register(faulting.fd, zmq.POLLIN)
        handover = self.listener.handover
        polled: set[int] = set()  # hand-over descriptors in the poller (they come and go)
        if ready:
            ready()
        next_reap = time.monotonic()
        drain_deadline = None
        try:
            while True:
                now = time.monotonic()
                if self.stopping:
                    if drain_deadline is None:
                        drain_deadline = now + self.config.drain_timeout_s
                        log.info("shutting down: draining %d copies (up to %.0fs)",
                                 self.copies.pending, self.config.drain_timeout_s)
                    if not self.copies.pending and not self.flushes.pending:
                        # What a client sent before the signal was seen is answered first: a
                        # flush sent just before SIGTERM runs to its end (new work gets
                        # SHUTTING_DOWN). ZeroMQ's I/O thread may still be moving it off the
                        # wire, so wait a moment for the socket to stay quiet; a client that
                        # never goes quiet holds the exit no longer than the drain deadline.
                        if now >= drain_deadline or not self.listener.router.poll(QUIET_BEFORE_EXIT_MS,
                                                                                  zmq.POLLIN):
                            break
                        self.dispatcher.read_requests()
                        continue
                    if now >= drain_deadline:
                        n = self.copies.cancel_all("daemon shutting down")
                        log.warning("drain deadline: cancelled %d copies", n)
                        if now >= drain_deadline + CANCEL_GRACE_S:
                            log.error("%d copies did not stop; exiting anyway", self.copies.pending)
                            break
                timeout = min(max(0.0, next_reap - now), self._tick(), 0.25 if self.stopping else 60.0,
                              0.0 if self.flushes.pending else 60.0)  # a flush frees a slice per turn
                if handover is not None:
                    polled = _sync_poller(poller, polled, handover.poll_fds())
                events = dict(poller.poll(timeout * 1000))
                try:
                    if self.signals.fd in events:
                        self.signals.clear()
                    if self.guard.fd in events:
                        self.guard.on_events()  # before reading: a new connection is counted first
                    if self.listener.router in events:
                        self.dispatcher.read_requests()
                    if handover is not None:
                        for fd in polled.intersection(events):
                            handover.on_ready(fd)
                    if self.copies.wakeup_fd in events:
                        self.copies.finish_completed()
                    if faulting is not None and faulting.fd in events and self._faulted_in(faulting):
                        poller.unregister(faulting.fd)
                        faulting = None
                    for t in tiers:
                        if t.wakeup_fd in events:
                            t.poll()
                    if time.monotonic() >= next_reap:
                        next_reap = time.monotonic() + self.config.reap_interval_s
                        self.sessions.reap_dead()
                        if handover is not None:
                            handover.expire(time.monotonic())
                        self.guard.expire(time.monotonic())
                    self.flushes.step()
                    self._publish_events()
                except Exception:  # a bug must not take every engine's cache down with it
                    log.exception("internal error in the daemon loop; continuing")
                    self.errors[ErrorCode.INTERNAL.name] += 1
        finally:
            self.shutdown()

    def _faulted_in(self, faulting) -> bool:
        """More of a new pool is in: its whole slabs are handed out from now on. True once
        the background prefault has ended (all in, or stopped short: logged)."""
        self.index.pages_in(faulting.take())
        if faulting.running:
            return False
        if faulting.finished:
            log.info("pool faulted in: %s, the last %s in %.1fs while serving", format_size(self.segment.size),
                     format_size(self.segment.size - faulting.start), faulting.seconds)
        else:
            log.error("the pool stops at the %s faulted in: %s", format_size(faulting.done),
                      faulting.error or "stopped")
        return True

    def _tick(self) -> float:
        try:
            return self.housekeeping.tick()
        except Exception:  # a failed reload or stats snapshot must not stop the cache either
            log.exception("internal error in housekeeping; continuing")
            self.errors[ErrorCode.INTERNAL.name] += 1
            return 1.0

    # ---- events --------------------------------------------------------------------------
    def _publish_events(self) -> None:
        events = self.index.take_events()
        if not events or self.listener.pub is None:
            return
        by_ns: dict[str, list] = {}
        for kind, ns, key in events:
            by_ns.setdefault(ns, []).append((kind, key))
        counters, now = self.counters, time.time()
        for ns, items in by_ns.items():
            tenant, fingerprint = split_key(ns)  # topic: the engine's fingerprint; body says whose
            for i in range(0, len(items), MAX_EVENTS_PER_MESSAGE):
                chunk = items[i:i + MAX_EVENTS_PER_MESSAGE]
                self.event_seq += 1  # also for a dropped message: subscribers see the gap
                body = {"seq": self.event_seq, "ts": now, "tenant": tenant,
                        "events": [[kind, key] for kind, key in chunk]}
                if self.listener.publish([fingerprint.encode(), msgpack.packb(body, use_bin_type=True)]):
                    counters["events_published"] += len(chunk)
                else:  # a subscriber is EVENTS_HWM messages behind: counted, never queued
                    counters["events_dropped"] += len(chunk)
                    counters["event_messages_dropped"] += 1

    # ---- shutdown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.housekeeping.stop()
        if self.copies is not None:
            # Normally already empty (serve_forever drains first); a startup failure lands here.
            self.copies.cancel_all("daemon shutting down")
            self.copies.drain(CANCEL_GRACE_S)
            self.copies.finish_completed()
            for c in list(self.sessions.clients.values()):
                self.sessions.reap(c, "daemon shutdown")
            self.copies.close()
        for t in (self.disk, self.remote):  # their threads touch the pool: stop them before the unmap
            if t is not None:
                t.close()
        if self.lookup_indexes is not None:
            self.lookup_indexes.close()
        if getattr(self, "guard", None) is not None:
            self.guard.close()
        self.listener.close()
        if self.gpu is not None:
            self.gpu.close()  # unpin before the pool is unmapped
            self.gpu = None
        self.pool = None
        self.copies = None
        try:
            self.segment.close(unlink=self.warm is None)  # warm: kept for the next daemon
        except BufferError:
            if self.warm is None:
                unlink_segment(self.pool_name)
        if self.warm is not None:
            self.warm.close()
        if self._lock_fd is not None:
            for path in (self.config.socket, self.config.socket + HANDOVER_SUFFIX):
                try:
                    remove_our_socket(path)
                except (OSError, StartupError) as exc:
                    log.error("leaving %s: %s", path, exc)
            os.close(self._lock_fd)
        if getattr(self, "signals", None) is not None:
            self.signals.close()
        log.info("kvtier-daemon stopped")


def _sync_poller(poller: zmq.Poller, polled: set[int], fds: list[int]) -> set[int]:
    """Make the poller watch exactly ``fds`` of the hand-over socket."""
    want = set(fds)
    for fd in polled - want:
        poller.unregister(fd)
    for fd in want - polled:
        poller.register(fd, zmq.POLLIN)
    return want
