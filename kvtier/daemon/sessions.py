"""Clients and their registrations: HELLO, REGISTER, and reaping.

A client is reaped when its process exited (pid and start time checked), when
its connection closed, at BYE, at a second HELLO on the same connection, and
at shutdown. A local client is never reaped for silence: the kernel says
whether it lives, and an engine whose threads fill every core may not get to
its heartbeat for seconds. Only remote (TCP) clients, whose process the
kernel cannot show, are reaped after ``reap_after_s`` without a frame. Reaping cancels its transfers (each is still
answered once its copy stopped), frees its swap, and closes its
registrations; a registration's mappings go when its last copy returned.

Bounds: a user's registrations together keep at most ``max_mappings_per_user``
memory mappings, all users at most ``max_mappings`` (below ``vm.max_map_count``,
checked at start); a mapping keeps no descriptor (``transfer/mapping.py``).
A registration over a cap is refused (``OVER_LIMIT``; ``EXHAUSTED`` when the
kernel refuses the mapping) before anything is mapped. A failure to look at
a client's process (``EMFILE``) never drops the client: it is looked at again
at the next pass.

Primitives: ``Sessions.hello(identity, msg)``, ``.register(client, msg)``,
``.registration(client, reg_id)``, ``.close_registration(reg)``,
``.release_if_idle(reg)``, ``.reap(client, why)``, ``.reap_dead()``, ``.hung_up(fd)``.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import Counter
from typing import Callable

from ..pool.index import BlockIndex
from ..pool.swap import SwapTable
from ..protocol import messages as m
from ..protocol.errors import ErrorCode
from ..transfer.layout import KVLayout
from ..transfer.mapping import OutOfResources, open_specs
from ..transfer.specs import NoCudaPath, SpecError
from .config import DaemonConfig
from .peers import Peer
from ..pool.keys import ns_key
from .tenancy import identify
from .state import NO_CAP, ClientState, DaemonError, Registration, process_start

log = logging.getLogger("kvtier.daemon")
MAX_REGISTRATIONS = 64


def operator_quota(config: DaemonConfig) -> int | float:
    """The operator's swap cap per registered cache, in bytes: unset is no cap
    (infinity), 0 no swap. It is every cache's default and its ceiling."""
    return NO_CAP if config.swap_quota is None else config.swap_quota


def cache_quota(asked: int, config: DaemonConfig) -> int | float:
    """The swap quota REGISTER sets for its cache, once: ``asked`` is -1 for the
    operator's (the wire's "unset"), else bytes (0: no swap), never above the
    operator's cap. Any other negative number is refused."""
    if asked < -1:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "swap_quota must be -1 (the daemon's default) or bytes >= 0")
    return operator_quota(config) if asked == -1 else min(asked, operator_quota(config))


class Sessions:
    def __init__(self, config: Callable[[], DaemonConfig], index: BlockIndex, swap: SwapTable,
                 counters: Counter, gpu=None, handover=None, lookup_indexes=None, disk=None):
        self.config, self.index, self.swap = config, index, swap  # config: a getter (SIGHUP replaces it)
        self.counters, self.gpu, self.handover, self.lookup_indexes = counters, gpu, handover, lookup_indexes
        self.disk = disk  # the disk tier (kvtier/disk/bridge.py), or None: namespaces on disk count too
        self.clients: dict[bytes, ClientState] = {}
        self.mappings: Counter = Counter()  # uid (None: TCP) -> memory mappings its registrations hold
        self._next_client = self._next_reg = 0
        if config().swap_quota == 0:  # an older config's 0 meant "no cap": say what it means now
            log.warning('swap_quota = 0: no cache may swap requests out (swap_quota = "" is no cap)')

    # ---- HELLO / BYE -------------------------------------------------------------------
    def hello(self, identity: bytes, msg: m.Hello, peer: Peer | None = None, conn_fd: int = -1) -> m.Welcome:
        """``peer``: the kernel's credentials of the connection (None: remote/TCP).
        A local session's pid is the kernel's; the pid in HELLO is ignored then.
        ``conn_fd``: the connection's descriptor (the session ends when it closes)."""
        config = self.config()
        if msg.version != m.PROTOCOL_VERSION:
            raise DaemonError(ErrorCode.VERSION_MISMATCH, f"client speaks v{msg.version}, daemon v{m.PROTOCOL_VERSION}")
        if config.token and not hmac.compare_digest(msg.token.encode(), config.token.encode()):
            raise DaemonError(ErrorCode.UNAUTHORIZED, "bad or missing token")
        old = self.clients.get(identity)
        if old is not None:  # HELLO again on the same connection: start over
            self.reap(old, "re-hello")
        # No peer: a remote (TCP) client (pid 0); only its heartbeat proves it alive.
        pid = peer.pid if peer is not None else 0
        if peer is not None and msg.pid not in (0, pid):
            log.info("HELLO says pid %d, the kernel says %d; using the kernel's", msg.pid, pid)
        start = process_start(pid) if pid > 0 else None
        tenant, admin = identify(peer, config)
        self._next_client += 1
        c = ClientState(self._next_client, identity, pid, msg.name[:128], start, peer=peer, tenant=tenant,
                        admin=admin, conn_fd=conn_fd)
        self.clients[identity] = c
        log.info("client %d connected: pid=%d uid=%s tenant=%s%s name=%r", c.id, c.pid, c.uid, tenant,
                 " (admin)" if admin else "", c.name)
        return m.Welcome(m.PROTOCOL_VERSION, c.id, config.heartbeat_s, config.max_message, os.getpid())

    # ---- registrations -----------------------------------------------------------------
    def register(self, client: ClientState, msg: m.Register) -> m.Registered:
        """The ticket is used up first, whatever happens next (refused tickets
        must not pile up); its descriptors are closed once the memory is mapped."""
        ticket = None
        if msg.ticket:
            ticket = self.handover.take(msg.ticket, client.peer) if self.handover else "no hand-over socket"
            if isinstance(ticket, str):
                raise DaemonError(ErrorCode.UNAUTHORIZED, ticket)
        try:
            return self._register(client, msg, ticket.fds if ticket is not None else [])
        finally:
            if ticket is not None:
                ticket.close()

    def _register(self, client: ClientState, msg: m.Register, fds: list[int]) -> m.Registered:
        config = self.config()
        if not 0 < len(msg.namespace) <= 1024:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "namespace fingerprint must be 1..1024 chars")
        if not 1 <= msg.block_factor <= 1024:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "block_factor must be in [1, 1024]")
        if len(client.regs) >= MAX_REGISTRATIONS:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "too many registrations for one client")
        if client.peer is None:
            raise DaemonError(ErrorCode.UNAUTHORIZED, "only local, kernel-identified clients may register memory")
        swap_quota = cache_quota(msg.swap_quota, config)  # checked before anything is mapped
        key = ns_key(client.tenant, msg.namespace)
        if not self.index.has_namespace(key):
            self._namespace_room(client.tenant, key, config.max_namespaces_per_user)
        self._check_mappings(client, config, max(1, len(fds)))
        try:
            tensors, dims, segments = open_specs(msg.tensors, fds, gpu_uuids=self.gpu.uuids if self.gpu else None)
        except NoCudaPath as exc:  # valid, but this daemon cannot serve it: the engine runs without kvtier
            raise DaemonError(ErrorCode.NO_GPU, str(exc)) from None
        except OutOfResources as exc:
            raise DaemonError(ErrorCode.EXHAUSTED, str(exc)) from None
        except SpecError as exc:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, str(exc)) from None
        device = getattr(segments[0], "gpu_device", None)  # set only on CUDA mappings
        error = None
        try:
            layout = KVLayout(tensors, dims, msg.block_factor)
            pieces = layout.block_factor * len(tensors)  # separate copies per kvtier block, at worst
            if pieces > config.max_copy_pieces:
                raise ValueError(f"one block costs {pieces} separate copies "
                                 f"(max_copy_pieces {config.max_copy_pieces}); register fewer or larger tensors")
            ns = self.index.namespace(key, layout.block_bytes)
            cuda_engine = self.gpu.engine(layout, device) if device is not None else None
        except (ValueError, RuntimeError) as exc:  # RuntimeError: CUDA refused the stream/event
            error = (ErrorCode.BAD_ARGUMENT if isinstance(exc, ValueError) else ErrorCode.INTERNAL, str(exc))
        if error is not None:  # outside the except: its traceback holds tensor views
            del tensors
            layout = None
            for seg in segments:
                seg.close()
            raise DaemonError(*error)
        self._next_reg += 1
        reg = Registration(self._next_reg, client, ns, layout, segments, cuda_engine,
                           max_copy_pieces=config.max_copy_pieces, swap_quota=swap_quota)
        client.regs[reg.id] = reg
        self.mappings[client.uid] += len(segments)
        log.info("client %d registered cache %d: namespace=%r block=%d bytes x %d blocks",
                 client.id, reg.id, msg.namespace, layout.block_bytes, layout.num_blocks)
        mirror = self.lookup_indexes.segment_for(ns, lambda: self.index.ready_keys(ns)) if self.lookup_indexes is not None else ""
        return m.Registered(reg.id, ns.id, layout.block_bytes, layout.num_blocks, mirror)

    @staticmethod
    def registration(client: ClientState, reg_id: int) -> Registration:
        reg = client.regs.get(reg_id)
        if reg is None or reg.closing:
            raise DaemonError(ErrorCode.UNKNOWN_NAMESPACE, f"cache {reg_id} is not registered by this client")
        return reg

    def close_registration(self, reg: Registration) -> None:
        reg.closing = True
        self.release_if_idle(reg)

    def _check_mappings(self, client: ClientState, config: DaemonConfig, more: int) -> None:
        mine, everyone = self.mappings[client.uid], sum(self.mappings.values())
        if mine + more > config.max_mappings_per_user:
            raise DaemonError(ErrorCode.OVER_LIMIT, f"this user's registrations hold {mine} memory mappings "
                              f"(max_mappings_per_user {config.max_mappings_per_user}); close some first")
        if everyone + more > config.max_mappings:
            raise DaemonError(ErrorCode.EXHAUSTED, f"the daemon holds {everyone} memory mappings "
                              f"(max_mappings {config.max_mappings}); try again later")

    def release_if_idle(self, reg: Registration) -> None:
        """Unmap a closing registration once no copy uses it any more."""
        if not reg.closing or reg.inflight:
            return
        if reg.segments:  # what this user's mappings count gives back
            uid = reg.client.uid
            self.mappings[uid] -= len(reg.segments)
            if self.mappings[uid] <= 0:
                del self.mappings[uid]
        reg.client.regs.pop(reg.id, None)
        reg.cuda_engine = None
        reg.layout = None  # drop every tensor view before unmapping (CUDA: closes the IPC mapping)
        for seg in reg.segments:
            try:
                seg.close(unlink=False)
            except BufferError:
                log.error("segment %s still has live views; leaving it mapped", seg.name)
        reg.segments = []

    def _namespace_room(self, tenant: str, key: str, cap: int) -> None:
        """``max_namespaces_per_user`` counts a tenant's namespaces in every tier: in RAM
        (blocks, registrations, swap) and on disk. At the cap, a new namespace first drops
        the tenant's namespaces that are on disk only, least recently used first (their
        files and directories go); it is refused when the tenant's RAM namespaces alone
        reach the cap, as before."""
        prefix = ns_key(tenant, "")
        ram = {ns.key for ns in self.index.namespaces_matching(lambda k: k.startswith(prefix))}
        disk = self.disk
        on_disk = {k for k in disk.namespace_keys() if k.startswith(prefix)} if disk is not None else set()
        if key in on_disk:
            return  # counted already
        over = len(ram | on_disk) + 1 - cap
        if over <= 0:
            return
        spare = disk.oldest_first(on_disk - ram) if disk is not None else []
        if over > len(spare):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"tenant {tenant} has {cap} namespaces already "
                              "(max_namespaces_per_user)")
        dropped = disk.drop_namespaces(spare[:over])
        log.info("tenant %s at max_namespaces_per_user (%d): dropped its %d least recently used namespaces "
                 "on disk (%d blocks, their files dropped over the next loop turns) for a new one",
                 tenant, cap, over, dropped.hidden)

    def forget_idle_namespaces(self) -> int:
        """Drop namespaces with no blocks, no registration and no swap, so a
        tenant's namespace budget counts only what it really uses."""
        used = {reg.ns for c in self.clients.values() for reg in c.regs.values()}
        used.update(rec.ns for rec in self.swap.records.values())
        idle = self.index.forget_empty(used)
        if self.lookup_indexes is not None:  # their mirror tables go with them
            for ns in idle:
                self.lookup_indexes.forget(ns)
        return len(idle)

    # ---- reaping -------------------------------------------------------------------------
    def reap_dead(self) -> None:
        now, limit = time.monotonic(), self.config().reap_after_s
        for c in list(self.clients.values()):
            try:
                alive = c.process_alive()
            except OSError as exc:  # EMFILE and friends: cannot tell now; look again next pass
                log.warning("cannot check client %d's process (%s); checking again later", c.id, exc)
                continue
            try:
                if not alive:
                    self.reap(c, "process exited")
                elif c.hung_up:
                    self.reap(c, "connection closed")
                elif c.peer is None and now - c.last_seen > limit:
                    self.reap(c, f"silent for {now - c.last_seen:.1f}s")
            except Exception:  # one odd entry must not stop every other client's reaping
                log.exception("reaping client %d failed; dropping it", c.id)
                self.clients.pop(c.identity, None)
        self.forget_idle_namespaces()

    def hung_up(self, fd: int) -> None:
        """Connection ``fd`` closed: the sessions said HELLO on it end."""
        for c in [c for c in self.clients.values() if c.conn_fd == fd >= 0]:
            if not c.process_alive():
                self.reap(c, "process exited")
            else:  # a dying process closes its sockets before it is seen dead: ask again next pass
                c.hung_up, c.conn_fd = True, -1

    def reap(self, c: ClientState, why: str) -> None:
        """Forget a client: cancel its copies, free its swap, close its caches."""
        self.clients.pop(c.identity, None)
        caches = len(c.regs)
        for op in list(c.ops.values()):
            op.cancel("client " + why)
        for reg in list(c.regs.values()):
            self.close_registration(reg)
        n = self.swap.release_owner(c.id)
        if n:
            log.info("client %d: freed %d swapped requests", c.id, n)
        self.counters["reaped"] += why not in ("bye", "re-hello")
        log.info("client %d (pid %d) %s: released %d caches", c.id, c.pid,
                 "disconnected" if why == "bye" else f"reaped ({why})", caches)
