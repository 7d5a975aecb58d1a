"""Request handlers: one method per op, called from the single dispatch point.

A handler returns a reply message, or ``None`` when the reply comes later
(copies answer when they finish). Expected failures raise ``DaemonError``;
the dispatcher turns every exception into an error reply.
"""

from __future__ import annotations

import hmac
import logging

import numpy as np

from ..pool.allocator import IntegrityError
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
        error = None
        try:
            layout = KVLayout(tensors, dims, msg.block_factor)
            ns = self.index.namespace(msg.namespace, layout.block_bytes)
            copier = self.gpu.engine(layout, device) if device is not None else None
        except (ValueError, RuntimeError) as exc:  # RuntimeError: CUDA refused the stream/event
            error = (ErrorCode.BAD_ARGUMENT if isinstance(exc, ValueError) else ErrorCode.INTERNAL, str(exc))
        if error is not None:  # outside the except: its traceback holds tensor views
            del tensors
            layout = None
            for seg in segments:
                seg.close()
            raise DaemonError(*error)
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
        hits = self.index.lookup(reg.ns, keys)
        # remote tier hook: the local prefix ended early; the store may hold the rest of the chain
        if self.remote is not None and self.remote.lookup(identity, req_id, reg.ns, keys, hits):
            return None
        return m.Hits(hits)

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
        # remote tier hook: blocks missing here are fetched into the pool first, then this runs again
        if self.remote is not None and self.remote.load(identity, req_id, msg, reg.ns, keys):
            return None
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

    # ---- request swap -------------------------------------------------------------
    def on_offload(self, identity, client, req_id, msg: m.Offload):
        reg = self.registration(client, msg.reg)
        parsed = self.swap_requests(reg, msg.requests)
        accepted, failed, full = [], [], False
        for i, (request, ids) in enumerate(parsed):
            rec, why = self.swap.prepare_offload(client.id, client.swap_quota, reg.ns, request,
                                                 len(ids), reg.layout.block_factor)
            if rec is None:
                failed.append(i)
                full |= why in ("no_space", "quota")
                log.debug("offload of %r refused: %s", request, why)
            else:
                accepted.append((i, rec, ids))
        reply = lambda bad: m.TransferDone(  # noqa: E731
            len(parsed) - len(bad), 0, pack_ids(sorted(bad)), full)
        if not accepted:
            return reply(failed)
        pairs = [p for _, rec, ids in accepted for p in reg.layout.pairs_flat(rec.offsets, ids)]
        self.start_copy(Op("offload", client, reg, req_id, accepted, len(pairs) * reg.layout.engine_block_bytes,
                           extra=lambda bad: reply(failed + bad)), pairs, to_pool=True)
        return None

    def on_restore(self, identity, client, req_id, msg: m.Restore):
        reg = self.registration(client, msg.reg)
        ids = unpack_ids(msg.blocks)
        rec = self.swap.records.get((client.id, msg.request))
        if rec is None or rec.ns is not reg.ns:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"no swapped request {msg.request[:64]!r}")
        if len(ids) != rec.engine_blocks:
            raise DaemonError(ErrorCode.BAD_ARGUMENT,
                              f"request {msg.request[:64]!r} has {rec.engine_blocks} blocks, got {len(ids)} ids")
        why = reg.layout.check_ids(ids)
        if why:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, why)
        if self.swap.prepare_restore(client.id, msg.request) is None:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"request {msg.request[:64]!r} is not ready "
                              f"({rec.state}): wait for its offload first")
        n = len(ids)
        self.start_copy(Op("restore", client, reg, req_id, rec, n * reg.layout.engine_block_bytes,
                           extra=lambda bad: m.TransferDone(0 if bad else n, 0,
                                                            pack_ids(range(n) if bad else []))),
                        reg.layout.pairs_flat(rec.offsets, ids), to_pool=False)
        return None

    def on_discard(self, identity, client, req_id, msg: m.Discard):
        self.registration(client, msg.reg)
        if not self.swap.discard(client.id, msg.request):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"no swapped request {msg.request[:64]!r}")
        return m.Ok()

    def swap_requests(self, reg: Registration, requests: list) -> list[tuple[str, np.ndarray]]:
        if not 0 < len(requests) <= 4096:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "requests must hold 1..4096 entries")
        out, seen = [], set()
        for i, item in enumerate(requests):
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], bytes) or not 0 < len(item[0]) <= 256):
                raise DaemonError(ErrorCode.BAD_ARGUMENT,
                                  f"requests[{i}] must be [request_id (1..256 chars), block ids]")
            if item[0] in seen:
                raise DaemonError(ErrorCode.BAD_ARGUMENT, f"request {item[0][:64]!r} listed twice")
            seen.add(item[0])
            ids = unpack_ids(item[1])
            if not 0 < len(ids) <= MAX_BLOCKS_PER_OP:
                raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}] needs 1..{MAX_BLOCKS_PER_OP} blocks")
            why = reg.layout.check_ids(ids)
            if why:
                raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}]: {why}")
            out.append((item[0], ids))
        return out

    # ---- management ----------------------------------------------------------------
    def on_stats(self, identity, client, req_id, msg: m.Stats):
        stats = self.stats()
        if msg.check:
            try:
                self.index.check_integrity()
                self.swap.check_integrity()
                stats["integrity"] = "ok"
            except IntegrityError as exc:
                log.error("integrity check failed: %s", exc)
                stats["integrity"] = str(exc)
        return m.StatsReply(stats)

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
