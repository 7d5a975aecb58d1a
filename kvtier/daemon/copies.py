"""Copies: start them (on the loop thread when small, else the copy worker),
complete them (commit or drop the plan, answer the requester).

Primitives (mixed into the Daemon): ``start_copy(op, pairs, to_pool)``,
``finish_op(op, error)``, ``complete_plan(op, error)``.
"""

from __future__ import annotations

import logging
import time
import zlib

from ..protocol import messages as m
from ..protocol.errors import ErrorCode
from .state import Op

log = logging.getLogger("kvtier.daemon")


class Copies:
    def start_copy(self, op: Op, pairs, to_pool: bool) -> None:
        op.reg.inflight += 1
        op.client.ops.add(op)
        layout, pool, engine = op.reg.layout, self.pool, op.reg.copier
        if engine is not None:  # CUDA: fenced copy on the registration's stream
            def gpu_copy():
                op.done_event = engine.copy(pool, pairs, to_pool, op.event)
            self.worker.submit(op, gpu_copy)
            return
        delay = self.config.copy_delay_s
        size, crcs, buf = op.reg.ns.block_bytes, self.crcs, None
        if self.config.checksums:  # only then does the copy need a view of the pool's bytes
            op.slots = self._slots(op)
            buf = self.segment.buffer

        def copy():
            if delay:
                time.sleep(delay)
            if op.slots and not to_pool:  # verify before the bytes reach the engine
                op.bad = sorted({i for i, off in op.slots if _crc(buf, off, size) != crcs.get(off)})
            layout.copy(pool, pairs, to_pool)
            if op.slots and to_pool:
                op.crcs = [(off, _crc(buf, off, size)) for _, off in op.slots]

        if op.nbytes <= self.config.inline_copy_bytes and not delay:
            # Small copy: doing it here (tens of microseconds) beats the hand-off
            # to the copy thread and back through its pipe (~0.2 ms per call).
            error = None
            try:
                copy()
            except Exception as exc:  # reported as failed blocks, like a worker copy
                error = exc
            self._complete(op, error)
            return
        self.worker.submit(op, copy)

    def _finish_copies(self) -> None:
        for op, error in self.worker.completed():
            self._complete(op, error)

    def _complete(self, op: Op, error: BaseException | None) -> None:
        try:
            self.finish_op(op, error)
        except Exception as exc:  # a bug: the requester gets an error, the loop lives on
            log.exception("internal error completing a %s for client %d", op.kind, op.client.id)
            self.errors[ErrorCode.INTERNAL.name] += 1
            self._send(op.client.identity, op.request_id,
                       m.Error(int(ErrorCode.INTERNAL), f"{type(exc).__name__}: {exc}", "daemon"))

    @staticmethod
    def _slots(op: Op) -> list[tuple[int, int]]:
        if op.kind in ("store", "load"):
            return [(i, e.offset) for i, e in enumerate(op.plan.entries) if e is not None]
        if op.kind == "offload":
            return [(i, off) for i, rec, _ in op.plan for off in rec.offsets]
        return [(0, off) for off in op.plan.offsets]

    def finish_op(self, op: Op, error: BaseException | None) -> None:
        self.observe_op(op)
        op.client.ops.discard(op)
        op.reg.inflight -= 1
        try:
            if error is not None:
                log.error("copy for client %d (%s) failed: %s", op.client.id, op.kind, error)
                self.errors["COPY_FAILED"] += 1
            self.crcs.update(op.crcs)
            if op.bad:
                log.error("checksum mismatch on %d blocks loaded by client %d: dropping them",
                          len(op.bad), op.client.id)
                self.errors["CHECKSUM"] += len(op.bad)
            failed = self.complete_plan(op, error is not None)
            if op.kind == "store" and self.remote is not None:  # remote tier hook: write-behind
                self.remote.committed(op.plan)
            self.counters[op.kind + "_bytes"] += 0 if error else op.nbytes
            self.counters[op.kind + "s"] += 1
            if op.client.identity in self.clients and op.client is self.clients[op.client.identity]:
                self._send(op.client.identity, op.request_id, op.extra(failed))
        finally:  # even after a bug above: a closed registration's mappings must go
            op.extra = None  # the reply builder may refer back to the op
            if op.reg.closing and op.reg.inflight == 0:
                self._release(op.reg)

    def complete_plan(self, op: Op, error: bool) -> list[int]:
        plan = op.plan
        if op.kind == "offload":
            for _, rec, _ in plan:
                self.swap.complete_offload(rec, not error)
            return [i for i, _, _ in plan] if error else []
        if op.kind == "restore":  # corrupt data is freed too: the engine recomputes
            self.swap.complete_restore(plan, not error or bool(op.bad))
            return [0] if error or op.bad else []
        written = [i for i, e in enumerate(plan.entries) if e is not None]
        if op.kind == "store":
            self.index.complete_store(plan, failed=written if error else ())
            return plan.no_space + (written if error else [])
        self.index.complete_load(plan, failed=written if error else op.bad)
        for i in op.bad:
            self.index.discard(plan.entries[i])
        return sorted(set(plan.missing + (written if error else op.bad)))


def _crc(buf, offset: int, size: int) -> int:
    return zlib.crc32(memoryview(buf)[offset:offset + size])
