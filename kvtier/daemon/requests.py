"""What the daemon does for each request: one table keyed by message type.

``RequestHandlers.table[type(msg)](client, msg, ...)`` returns the reply, or
``None`` when a copy answers later. Expected failures raise ``DaemonError``;
the server's single dispatch point turns every exception into an error reply
(``replies.py``). A load naming blocks the pool lacks is checked once, then
offered to the lower tiers in order (disk, remote) as a ``PendingLoad``; the
tier that takes it hands it back to ``resume`` once its blocks are in the pool,
and the load goes on from there (the next tier, then a copy from RAM).
Which messages are requests at all is the protocol's business
(``messages.REQUESTS``); which may come before HELLO or while draining is
decided here.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from ..pool.allocator import IntegrityError
from ..pool.index import BlockIndex
from ..pool.swap import SwapTable
from ..protocol import messages as m
from ..protocol.errors import ErrorCode
from .answered import add_report, check_report
from .copies import CopyRunner
from .flushes import Flushes
from ..protocol.arrays import HASH_BYTES, pack_ids
from .ops import MAX_BLOCKS_PER_OP, LoadOp, OffloadOp, RestoreOp, StoreOp, check_keys
from .pending import PendingLoad
from .replies import Replies
from .sessions import Sessions
from .state import ClientState, DaemonError
from ..pool.keys import split_key

log = logging.getLogger("kvtier.daemon")
MAX_CHAINS = 4096

REFUSED_WHILE_DRAINING = frozenset({m.Hello, m.Register, m.Lookup, m.LookupMany, m.Store, m.Load,
                                    m.Offload, m.Restore})
"""New work gets SHUTTING_DOWN at once during a drain; pings, cancels, stats
and BYE are still served so clients can tell "draining" from "gone"."""


class RequestHandlers:
    def __init__(self, sessions: Sessions, copies: CopyRunner, index: BlockIndex, swap: SwapTable,
                 stats: Callable[[ClientState], dict], flushes: Flushes, replies: Replies,
                 stopping: Callable[[], bool], disk=None, remote=None):
        self.sessions, self.copies, self.index, self.swap = sessions, copies, index, swap
        self.flushes, self.replies, self.stopping = flushes, replies, stopping
        self.stats = stats
        self.disk, self.remote = disk, remote  # DiskBridge, RemoteBridge, or None
        # Where a load's missing blocks come from, in order: .load(ns, pending) -> True when it took it.
        self.tiers: Sequence = [t for t in (disk, remote) if t is not None]
        self.table: dict[type, Callable] = {
            m.Hello: self.hello, m.Ping: self.ping, m.Bye: self.bye,
            m.Register: self.register, m.Unregister: self.unregister,
            m.Lookup: self.lookup, m.LookupMany: self.lookup_many, m.Store: self.store, m.Load: self.load,
            m.Offload: self.offload, m.Restore: self.restore, m.Discard: self.discard,
            m.Cancel: self.cancel, m.Stats: self.stats_request, m.Flush: self.flush,
            m.LookupsAnswered: self.lookups_answered,
        }
        assert set(self.table) == m.REQUESTS, "every request needs a handler"

    # ---- session ----------------------------------------------------------------------
    def hello(self, client, msg: m.Hello, identity: bytes, req_id: int, peer=None, conn_fd: int = -1):
        return self.sessions.hello(identity, msg, peer, conn_fd)

    def ping(self, client, msg, identity, req_id):
        return m.Ok()

    def lookups_answered(self, client: ClientState, msg: m.LookupsAnswered, identity, req_id):
        """What the client's lookup mirrors answered: into the same counters (answered.py)."""
        add_report(check_report(client, msg.counts, self.sessions.registration), self.index.count)
        return m.Ok()

    def bye(self, client: ClientState, msg, identity, req_id):
        self.sessions.reap(client, "bye")
        return m.Ok()

    def register(self, client: ClientState, msg: m.Register, identity, req_id):
        return self.sessions.register(client, msg)

    def unregister(self, client: ClientState, msg: m.Unregister, identity, req_id):
        self.sessions.close_registration(self.sessions.registration(client, msg.reg))
        return m.Ok()

    # ---- prefix cache and swap: copies answer later ------------------------------------
    def lookup(self, client: ClientState, msg: m.Lookup, identity, req_id):
        reg = self.sessions.registration(client, msg.reg)
        keys = check_keys(msg.hashes)
        hits = self.index.lookup(reg.ns, keys)
        # The local prefix ended early: the remote tier may hold the rest (it answers later).
        if self.remote is not None and self.remote.lookup(identity, req_id, reg.ns, keys, hits):
            return None
        return m.Hits(hits)

    def lookup_many(self, client: ClientState, msg: m.LookupMany, identity, req_id):
        """Every waiting request of a scheduling step in one round trip (local pool only)."""
        reg = self.sessions.registration(client, msg.reg)
        if not 0 < len(msg.chains) <= MAX_CHAINS:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"chains must hold 1..{MAX_CHAINS} entries")
        if not all(isinstance(c, bytes) for c in msg.chains):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "each chain must be packed hashes (bytes)")
        if sum(map(len, msg.chains)) > MAX_BLOCKS_PER_OP * HASH_BYTES:  # checked before unpacking
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"at most {MAX_BLOCKS_PER_OP} hashes per call")
        lookup = self.index.lookup
        return m.HitsMany(pack_ids([lookup(reg.ns, check_keys(c)) for c in msg.chains]))

    def store(self, client: ClientState, msg: m.Store, identity, req_id):
        reg = self.sessions.registration(client, msg.reg)
        self._admit(client)
        return self._run(StoreOp.prepare(self.index, client, reg, req_id, msg))

    def load(self, client: ClientState, msg: m.Load, identity, req_id):
        reg = self.sessions.registration(client, msg.reg)
        self._admit(client)
        keys = check_keys(msg.hashes)
        checked = LoadOp.check(reg, msg, keys)  # a bad request is refused before anything is read or fetched
        if self.tiers:
            pending = PendingLoad(identity, req_id, msg, keys, checked, client.uid, self.resume)
            if self._lower(reg, pending):
                return None  # resume() goes on once the blocks read or fetched are in the pool
        return self._run(LoadOp.prepare(self.index, client, reg, req_id, msg, keys, checked))

    def _lower(self, reg, pending: PendingLoad) -> bool:
        """Offer the load to the tiers not asked yet (disk first, then remote; each once)."""
        while pending.next_tier < len(self.tiers):
            tier = self.tiers[pending.next_tier]
            pending.next_tier += 1
            if tier.load(reg.ns, pending):  # disk / remote tier hook
                pending.held = True  # until the tier lands it
                return True
        return False

    def resume(self, pending: PendingLoad) -> None:
        """A lower tier is done with ``pending``: a cancelled load is answered failed (nothing
        copied); else, if its client and cache are still there, it goes on from the next tier
        or copies from RAM, answered like any request (errors through ``replies``)."""
        client = self.sessions.clients.get(pending.identity)
        try:
            if pending.cancelled:  # the engine may reuse its blocks already: copy nothing into them
                reply = m.TransferDone(0, 0, pack_ids(range(pending.count)))
            else:
                reply = self._resumed(client, pending)
        except Exception as exc:
            reply = self.replies.failure(exc, client, pending.identity)
        if reply is not None:
            self.replies.send(pending.identity, pending.req_id, reply)

    def _resumed(self, client: ClientState | None, p: PendingLoad):
        if client is None:  # reaped while its blocks were read: the dispatch point would say the same
            raise DaemonError(ErrorCode.NOT_CONNECTED, "say HELLO first")
        if self.stopping():
            raise DaemonError(ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
        reg = self.sessions.registration(client, p.msg.reg)  # closed meanwhile: UNKNOWN_NAMESPACE
        self._admit(client)  # its wait no longer counts: it takes its own place again
        if self._lower(reg, p):
            return None
        return self._run(LoadOp.prepare(self.index, client, reg, p.req_id, p.msg, p.keys, p.checked))

    def offload(self, client: ClientState, msg: m.Offload, identity, req_id):
        reg = self.sessions.registration(client, msg.reg)
        self._admit(client)
        return self._run(OffloadOp.prepare(self.swap, client, reg, req_id, msg))

    def restore(self, client: ClientState, msg: m.Restore, identity, req_id):
        reg = self.sessions.registration(client, msg.reg)
        self._admit(client)
        return self._run(RestoreOp.prepare(self.swap, client, reg, req_id, msg))

    def _admit(self, client: ClientState) -> None:
        """``max_transfers_per_user`` counts every transfer the user has in the daemon:
        copies running or queued, and loads waiting for a lower tier (disk reads,
        remote fetches)."""
        self.copies.admit(client, sum(t.waiting(client.uid) for t in self.tiers))

    def _run(self, prepared):
        """An op starts its copy (reply later); a reply means nothing to copy."""
        if isinstance(prepared, m.TransferDone):
            return prepared
        why = self.copies.over_limit(prepared)
        if why:
            prepared.finish(True)  # give back what it reserved; nothing was copied
            raise DaemonError(ErrorCode.OVER_LIMIT, why)
        self.copies.start(prepared)
        return None

    def discard(self, client: ClientState, msg: m.Discard, identity, req_id):
        self.sessions.registration(client, msg.reg)
        if not self.swap.discard(client.id, msg.request):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"no swapped request {msg.request[:64]!r}")
        return m.Ok()

    def cancel(self, client: ClientState, msg: m.Cancel, identity, req_id):
        """Stop one of this client's transfers. Ok at once; the transfer's own
        reply follows when its copy has stopped (or had already finished)."""
        op = client.ops.get(msg.request)
        if op is not None:
            op.cancel("cancelled by the client")  # stops at its next chunk, then answered
        else:  # a load whose blocks are still being read (disk: answered now) or fetched (remote)
            any(t.cancel(identity, msg.request) for t in self.tiers)
        return m.Ok()

    # ---- management --------------------------------------------------------------------
    def stats_request(self, client: ClientState, msg: m.Stats, identity, req_id):
        stats = self.stats(client)
        if msg.check and client.admin:  # O(blocks): not for every tenant to trigger
            try:
                self.index.check_integrity()
                self.swap.check_integrity()
                if self.disk is not None:
                    self.disk.check_integrity()
                stats["integrity"] = "ok"
            except (IntegrityError, AssertionError) as exc:
                log.error("integrity check failed: %s", exc)
                stats["integrity"] = str(exc)
        return m.StatsReply(stats)

    def flush(self, client: ClientState, msg: m.Flush, identity, req_id):
        """A tenant flushes its own namespaces; an admin any (every tenant's
        namespace with that fingerprint, or everything). A flush removes what it
        names from every tier: namespaces only on disk (a restart leaves those)
        included; a block in RAM and on disk counts once. What it names is hidden from
        lookups at once and freed over the next loop turns; the reply comes when all
        of it is freed (``flushes.py``)."""
        if len(msg.namespace) > 1024:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "namespace fingerprint must be 0..1024 chars")

        def named(key: str) -> bool:
            tenant, fingerprint = split_key(key)
            return (client.admin or tenant == client.tenant) and (not msg.namespace or fingerprint == msg.namespace)
        targets = self.index.namespaces_matching(named)
        on_disk = [key for key in self.disk.namespace_keys() if named(key)] if self.disk is not None else []
        if msg.namespace and not targets and not on_disk:
            raise DaemonError(ErrorCode.UNKNOWN_NAMESPACE, f"no namespace {msg.namespace[:64]!r}")
        disk_job = self.disk.flush_keys(on_disk) if on_disk else None  # hidden now, dropped over turns
        everything = not msg.namespace and client.admin
        self.flushes.start(identity, req_id, self.index.namespaces_matching() if everything else targets,
                           everything, disk_job, f"client {client.id} (tenant {client.tenant}) flushed "
                           f"{msg.namespace[:64] or '(all)'}")
        return None  # answered by flushes.step once its blocks are freed
