"""Request handlers: one method per op, called from the single dispatch point.

A handler returns a reply message, or ``None`` when the reply comes later
(copies answer when they finish). Expected failures raise ``DaemonError``;
the dispatcher turns every exception into an error reply.
"""

from __future__ import annotations

import hmac
import logging

import numpy as np

from ..protocol import messages as m
from ..protocol.arrays import pack_ids, unpack_hashes, unpack_ids
from ..protocol.errors import ErrorCode
from ..transfer.layout import KVLayout
from ..transfer.shm import SpecError, open_specs
from .state import ClientState, DaemonError, Op, Registration, process_start

log = logging.getLogger("kvtier.daemon")
MAX_BLOCKS_PER_OP = 1 << 16


class Handlers:
    # ---- session ----------------------------------------------------------------
    def on_hello(self, identity: bytes, client, req_id: int, msg: m.Hello):
        if msg.version != m.PROTOCOL_VERSION:
            raise DaemonError(ErrorCode.VERSION_MISMATCH,
                              f"client speaks v{msg.version}, daemon v{m.PROTOCOL_VERSION}")
        if self.config.token and not hmac.compare_digest(msg.token.encode(), self.config.token.encode()):
            raise DaemonError(ErrorCode.UNAUTHORIZED, "bad or missing token")
        if client is not None:  # HELLO again on the same connection: start over
            self.reap(client, "re-hello")
        # pid <= 0: a remote (TCP) client; only its heartbeat proves it alive.
        start = process_start(msg.pid) if msg.pid > 0 else None
        self.next_client += 1
        c = ClientState(self.next_client, identity, msg.pid, msg.name[:128], start,
                        swap_quota=self.config.swap_quota)
        self.clients[identity] = c
        log.info("client %d connected: pid=%d name=%r", c.id, c.pid, c.name)
        return m.Welcome(m.PROTOCOL_VERSION, c.id, self.config.heartbeat_s, self.config.max_message)

    def on_ping(self, identity, client, req_id, msg):
        return m.Ok()

    def on_bye(self, identity, client, req_id, msg):
        self.reap(client, "bye")
        return m.Ok()

    # ---- registration -------------------------------------------------------------
    def on_register(self, identity, client: ClientState, req_id, msg: m.Register):
        if not 0 < len(msg.namespace) <= 1024:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "namespace fingerprint must be 1..1024 chars")
        if not 1 <= msg.block_factor <= 1024:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "block_factor must be in [1, 1024]")
        if len(client.regs) >= 64:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "too many registrations for one client")
        try:
            tensors, dims, segments = open_specs(msg.tensors, gpu_uuids=self.gpu.uuids if self.gpu else None)
        except SpecError as exc:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, str(exc)) from None
        device = getattr(segments[0], "gpu_device", None)  # set only on CUDA mappings
        try:
            layout = KVLayout(tensors, dims, msg.block_factor)
            ns = self.index.namespace(msg.namespace, layout.block_bytes)
            copier = self.gpu.engine(layout, device) if device is not None else None
        except (ValueError, RuntimeError) as exc:  # RuntimeError: CUDA refused the stream/event
            del tensors
            layout = None
            for seg in segments:
                seg.close()
            code = ErrorCode.BAD_ARGUMENT if isinstance(exc, ValueError) else ErrorCode.INTERNAL
            raise DaemonError(code, str(exc)) from None
        self.next_reg += 1
        reg = Registration(self.next_reg, client, ns, layout, segments, copier)
        client.regs[reg.id] = reg
        if msg.swap_quota >= 0:
            client.swap_quota = msg.swap_quota
        log.info("client %d registered cache %d: namespace=%r block=%d bytes x %d blocks",
                 client.id, reg.id, ns.fingerprint, layout.block_bytes, layout.num_blocks)
        return m.Registered(reg.id, ns.id, layout.block_bytes, layout.num_blocks)

    def on_unregister(self, identity, client, req_id, msg: m.Unregister):
        reg = self.registration(client, msg.reg)
        self.close_registration(reg)
        return m.Ok()

    # ---- prefix cache -----------------------------------------------------------------
    def on_lookup(self, identity, client, req_id, msg: m.Lookup):
        reg = self.registration(client, msg.reg)
        keys = self.keys(msg.hashes)
        return m.Hits(self.index.lookup(reg.ns, keys))

    def on_store(self, identity, client, req_id, msg: m.Store):
        reg = self.registration(client, msg.reg)
        wait = self.event_handle(reg, msg.event)
        keys = self.keys(msg.hashes)
        ids = self.engine_ids(reg, msg.blocks, len(keys) * reg.layout.block_factor)
        plan = self.index.prepare_store(reg.ns, keys)
        offsets = [e.offset if e is not None else None for e in plan.entries]
        pairs = reg.layout.pairs(offsets, ids)
        reply = lambda failed: m.TransferDone(  # noqa: E731
            len(keys) - len(plan.skipped) - len(failed), len(plan.skipped),
            pack_ids(sorted(failed)), bool(plan.no_space))
        if not pairs:
            return reply(plan.no_space)
        self.start_copy(Op("store", client, reg, req_id, plan, len(pairs) * reg.layout.engine_block_bytes,
                           extra=reply, event=wait), pairs, to_pool=True)
        return None

    def on_load(self, identity, client, req_id, msg: m.Load):
        reg = self.registration(client, msg.reg)
        wait = self.event_handle(reg, msg.event)
        keys = self.keys(msg.hashes)
        k = reg.layout.block_factor
        if not 0 <= msg.skip < k:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"skip must be in [0, {k})")
        if msg.skip and not keys:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "skip needs at least one hash")
        ids = self.engine_ids(reg, msg.blocks, len(keys) * k - msg.skip)
        plan = self.index.prepare_load(reg.ns, keys)
        offsets = [e.offset if e is not None else None for e in plan.entries]
        pairs = reg.layout.pairs(offsets, ids, msg.skip)
        op = Op("load", client, reg, req_id, plan, len(pairs) * reg.layout.engine_block_bytes, event=wait)
        op.extra = lambda failed: m.TransferDone(  # the event: CUDA only, set when the copy finished
            len(keys) - len(failed), 0, pack_ids(sorted(failed)), event=op.done_event)
        if not pairs:
            self.index.complete_load(plan)
            return op.extra(plan.missing)
        self.start_copy(op, pairs, to_pool=False)
        return None

    # ---- management ----------------------------------------------------------------
    def on_stats(self, identity, client, req_id, msg):
        return m.StatsReply(self.stats())

    def on_flush(self, identity, client, req_id, msg: m.Flush):
        ns = None
        if msg.namespace:
            ns = self.index.namespaces.get(msg.namespace)
            if ns is None:
                raise DaemonError(ErrorCode.UNKNOWN_NAMESPACE, f"no namespace {msg.namespace!r}")
        removed = self.index.flush(ns)
        log.info("flush %s: %d blocks removed", msg.namespace or "(all)", removed)
        return m.Flushed(removed)

    # ---- validation helpers ------------------------------------------------------------
    def registration(self, client: ClientState, reg_id: int) -> Registration:
        reg = client.regs.get(reg_id)
        if reg is None or reg.closing:
            raise DaemonError(ErrorCode.UNKNOWN_NAMESPACE,
                              f"cache {reg_id} is not registered by this client")
        return reg

    @staticmethod
    def event_handle(reg: Registration, event: bytes) -> bytes:
        """A worker event to fence on: only meaningful for CUDA registrations."""
        if not event:
            return b""
        if reg.copier is None:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "event given for a cache that is not on a GPU")
        if len(event) > 4096:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "event handle too long")
        return event

    @staticmethod
    def keys(hashes: bytes) -> list[bytes]:
        keys = unpack_hashes(hashes)
        if len(keys) > MAX_BLOCKS_PER_OP:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"at most {MAX_BLOCKS_PER_OP} blocks per call")
        return keys

    @staticmethod
    def engine_ids(reg: Registration, blocks: bytes, expected: int) -> np.ndarray:
        ids = unpack_ids(blocks)
        if len(ids) != expected:
            raise DaemonError(ErrorCode.BAD_ARGUMENT,
                              f"expected {expected} block ids, got {len(ids)}")
        why = reg.layout.check_ids(ids)
        if why:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, why)
        return ids
