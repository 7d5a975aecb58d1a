"""Running transfers: start each op's copy, stop it when cancelled, end it once.

A copy runs on the loop thread when it is small (cheaper than the hand-off),
else on the copy worker's threads; a fenced CUDA copy first waits at the
``FenceGate`` (its own thread) until the worker's event fired. It moves ``copy_chunk_bytes`` of engine blocks
at a time, one chunk per worker turn (other clients' chunks run in between:
a big load does not hold a small one behind it), and checks the op's cancel
flag before each chunk, so a cancelled op stops touching engine memory within
one chunk (milliseconds).

The finality rule (README, "Transfers end once"): an op is answered exactly
once, by ``_complete``, after its copy has returned - never while the copy
may still run. A cancelled op (client cancel after its timeout, reap, drain
deadline) is finished as failed: a store commits nothing, a load unpins and
reports every block failed. Its reply is ``CANCELLED``; the client keeps the
blocks held until that reply (or until the daemon process is gone).

Bounds: one Unix user (all its connections together) has at most
``max_transfers_per_user`` transfers (copies, and loads waiting for disk
reads: the caller passes those to ``admit``) and ``max_pieces_in_flight_per_user``
copy pieces in flight; more are refused with ``OVER_LIMIT`` before their
copy is queued (what a queued op holds - its pairs, pins, reserved slots -
is what used to grow the daemon without bound).

Primitives: ``CopyRunner.admit(client, waiting)``, ``.over_limit(op)``, ``.start(op)``,
``.cancel_all(why)`` (one op: ``op.cancel(why)``), ``.finish_completed()``,
``.pending``, ``.user_load(uid)``, ``.drain(timeout)``, ``.close()``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Iterator, Sequence

import torch

from ..pool import checksum
from ..protocol import messages as m
from ..protocol.errors import ErrorCode
from ..transfer.copy import Cancelled
from ..transfer.fences import FenceGate, while_alive
from ..transfer.worker import CopyWorker
from .config import DaemonConfig
from .latency import LatencyHistograms
from .ops import CopyOp, StoreOp
from .state import ClientState, DaemonError

log = logging.getLogger("kvtier.daemon")


class CopyRunner:
    def __init__(self, pool: torch.Tensor, pool_buffer, config: Callable[[], DaemonConfig],
                 send: Callable[[bytes, int, object], None], on_idle: Callable[[object], None],
                 counters: Counter, errors: Counter, latency: LatencyHistograms, *, crcs: dict | None = None,
                 journal=None, on_commit: Sequence[Callable[[object], None]] = ()):
        """``crcs``: pool offset -> checksum (pool/checksum.py) of its last committed bytes (the
        daemon's table, shared with the tiers). ``journal``: warm restart (daemon/warm.py): stores' crcs are recorded at
        commit, adopted blocks verified at their first load. ``on_commit``: the lower tiers'
        write-behind, each given a store's plan once committed."""
        self.pool, self.pool_buffer = pool, pool_buffer
        self.config, self.send, self.on_idle = config, send, on_idle
        self.counters, self.errors, self.latency = counters, errors, latency
        self.worker = CopyWorker(config().copy_threads)
        self.crcs: dict[int, int] = {} if crcs is None else crcs
        self.inflight: set[CopyOp] = set()
        self._by_user: dict[int | None, list[int]] = {}  # uid (None: TCP) -> [transfers, pieces] in flight
        self.on_commit = tuple(on_commit)
        self.gate: FenceGate | None = None  # CUDA copies waiting for their worker's event
        self.journal = journal
        self._checking: dict[CopyOp, list] = {}  # load in flight -> (index, offset, crc) being checked

    @property
    def wakeup_fd(self) -> int:
        return self.worker.wakeup_fd

    @property
    def pending(self) -> int:
        return len(self.inflight)

    def user_load(self, uid: int | None) -> tuple[int, int]:
        """(transfers, copy pieces) in flight for ``uid``."""
        return tuple(self._by_user.get(uid, (0, 0)))

    # ---- admission ---------------------------------------------------------------------
    def admit(self, client: ClientState, waiting: int = 0) -> None:
        """Refuse a new transfer before anything is reserved for it when the
        client's user has ``max_transfers_per_user`` in flight (``waiting``: its
        transfers held elsewhere, loads waiting for a lower tier's reads)."""
        cap = self.config().max_transfers_per_user
        if self.user_load(client.uid)[0] + waiting >= cap:
            raise DaemonError(ErrorCode.OVER_LIMIT, f"{cap} transfers of this user are in flight "
                              "(max_transfers_per_user); wait for some to finish")

    def over_limit(self, op: CopyOp) -> str:
        """Why a prepared ``op`` may not start now ("" if it may)."""
        cap = self.config().max_pieces_in_flight_per_user
        transfers, pieces = self.user_load(op.client.uid)
        if transfers and pieces + op.pieces > cap:  # alone, any transfer fits (max_copy_pieces bounds it)
            return (f"{pieces} copy pieces of this user are in flight, this transfer adds {op.pieces} "
                    f"(max_pieces_in_flight_per_user {cap}); wait for some to finish")
        return ""

    # ---- start -----------------------------------------------------------------------
    def start(self, op: CopyOp) -> None:
        load = self._by_user.setdefault(op.client.uid, [0, 0])
        load[0] += 1
        load[1] += op.pieces
        op.reg.inflight += 1
        op.client.ops[op.request_id] = op
        self.inflight.add(op)
        config = self.config()
        check = self.journal.to_verify(op) if self.journal is not None and not op.to_pool else []
        if check:
            self._checking[op] = check
        if op.reg.cuda_engine is not None:  # CUDA: fenced copy on the registration's stream
            engine, pool, buf, size = op.reg.cuda_engine, self.pool, self.pool_buffer, op.reg.ns.block_bytes

            def gpu_copy():
                if check:  # before the bytes reach the engine, like the CPU path
                    op.bad = sorted(i for i, off, crc in check if not _matches(buf, off, size, crc))
                op.done_event = engine.copy(pool, op.pairs, op.to_pool, cancelled=op.cancelled)
            if not op.fence:
                self.worker.submit(op, gpu_copy, op.client.id)
                return
            # The worker's event is awaited at the gate, not on a copy thread: a worker
            # that hangs or dies with it unfired holds no copy thread from other clients.
            fence = op.fence
            fired = while_alive(lambda: engine.fence_fired(fence), op.client.process_alive, op.cancel)
            self._fences().hold(op, op.client.id, fired, op.cancelled, gpu_copy)
            return
        steps = self._cpu_copy(op, config, check)
        if op.nbytes <= config.inline_copy_bytes and not config.copy_delay_s:
            # Small copy: doing it here (tens of microseconds) beats the hand-off
            # to the copy thread and back through its pipe (~0.2 ms per call).
            error = None
            try:
                for _ in steps:
                    pass
            except Exception as exc:  # reported as failed blocks, like a worker copy
                error = exc
            self._complete(op, error)
            return
        # One chunk per turn: the worker interleaves them with other clients' copies.
        self.worker.submit_steps(op, steps, op.client.id)

    def _cpu_copy(self, op: CopyOp, config: DaemonConfig, check: list) -> Iterator[None]:
        """The op's copy as steps of ``copy_chunk_bytes``: each step one chunk (the
        last also the stores' crcs), so the worker can run other clients' chunks
        in between and a cancel stops it within one chunk."""
        layout, pool, delay = op.reg.layout, self.pool, config.copy_delay_s
        per_chunk = max(1, config.copy_chunk_bytes // layout.engine_block_bytes)
        chunks = [op.pairs[i:i + per_chunk] for i in range(0, len(op.pairs), per_chunk)]
        slots, size, buf, crcs = [], op.reg.ns.block_bytes, self.pool_buffer, self.crcs
        if config.checksums or (self.journal is not None and isinstance(op, StoreOp)):
            slots = op.slots()

        def copy():
            if (slots or check) and not op.to_pool:  # verify before the bytes reach the engine
                op.bad = sorted({i for i, off in slots if not _matches(buf, off, size, crcs.get(off))} |
                                {i for i, off, crc in check if not _matches(buf, off, size, crc)})
            for n, chunk in enumerate(chunks):
                if n:
                    yield  # a turn ends: other clients' chunks may run before the next
                if delay:  # fault injection: a slow copy, still cancellable
                    op.cancelled.wait(delay)
                if op.cancelled.is_set():
                    raise Cancelled(op.cancel_reason)
                layout.copy(pool, chunk, op.to_pool)
            if slots and op.to_pool:
                op.crcs = [(off, _crc(buf, off, size)) for _, off in slots]
        return copy()

    # ---- cancel ----------------------------------------------------------------------
    def cancel_all(self, why: str) -> int:
        for op in self.inflight:
            op.cancel(why)
        return len(self.inflight)

    # ---- complete --------------------------------------------------------------------
    def finish_completed(self) -> None:
        for op, error in self.worker.completed():
            self._complete(op, error)

    def _complete(self, op: CopyOp, error: BaseException | None) -> None:
        """The one place an op ends: its copy has returned, nothing touches its blocks now."""
        self.inflight.discard(op)
        load = self._by_user[op.client.uid]
        load[0] -= 1
        load[1] -= op.pieces
        if not load[0]:
            del self._by_user[op.client.uid]
        op.client.ops.pop(op.request_id, None)
        op.reg.inflight -= 1
        self.latency.observe(op.label, time.monotonic() - op.started)
        failed = error is not None or op.cancelled.is_set()
        commit = False
        try:
            if error is not None and not isinstance(error, Cancelled):
                log.error("copy for client %d (%s) failed: %s", op.client.id, op.label, error)
                self.errors["COPY_FAILED"] += 1
            if not failed and self.config().checksums:  # warm restart's crcs go to its journal
                self.crcs.update(op.crcs)
            if op.bad:
                log.error("checksum mismatch on %d blocks read by client %d: dropping them",
                          len(op.bad), op.client.id)
                self.errors["CHECKSUM"] += len(op.bad)
            check = self._checking.pop(op, None)
            if check and not failed:
                self.journal.verified(check, op.bad)
            reply = op.finish(failed)
            commit = not failed and isinstance(op, StoreOp)
            if commit and self.journal is not None:
                self.journal.committed(op.plan, op.crcs)  # bytes in the pool, entries READY: now kept
            if op.cancelled.is_set():
                self.counters["cancelled"] += 1
                log.info("%s for client %d cancelled (%s): nothing committed", op.label, op.client.id,
                         op.cancel_reason)
                reply = m.Error(int(ErrorCode.CANCELLED), f"{op.label} cancelled ({op.cancel_reason}); "
                                "nothing was committed and its blocks are free", "daemon")
            else:
                self.counters[op.label + "_bytes"] += 0 if failed else op.nbytes
                self.counters[op.label + "s"] += 1
        except Exception as exc:  # a bug: the requester gets an error, the loop lives on
            log.exception("internal error completing a %s for client %d", op.label, op.client.id)
            self.errors[ErrorCode.INTERNAL.name] += 1
            reply = m.Error(int(ErrorCode.INTERNAL), f"{type(exc).__name__}: {exc}", "daemon")
        finally:  # even after a bug above: a closed registration's mappings must go
            op.pairs = []
            if op.reg.inflight == 0:
                self.on_idle(op.reg)
        # Always answered, even to a reaped client: a client that is still there waits
        # for exactly this reply before it reuses the blocks.
        self.send(op.client.identity, op.request_id, reply)
        if commit:
            self._write_behind(op)

    def _write_behind(self, op) -> None:
        """The lower tiers take the committed blocks after the reply: their bookkeeping (a disk
        backlog's turn, pins, a remote job) is no part of the store's latency, and nothing else
        runs in between (one loop thread), so they see the index as the store left it."""
        for committed in self.on_commit:
            try:
                committed(op.plan)
            except Exception:  # a bug: the blocks stay in RAM, unwritten; the loop lives on
                log.exception("internal error handing a store of client %d to a lower tier", op.client.id)
                self.errors[ErrorCode.INTERNAL.name] += 1

    # ---- shutdown --------------------------------------------------------------------
    def drain(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        if self.gate is not None and not self.gate.wait_empty(timeout):
            return False
        return self.worker.drain(max(0.0, end - time.monotonic()))

    def _fences(self) -> FenceGate:
        if self.gate is None:  # only daemons with CUDA registrations run the thread
            self.gate = FenceGate(self.worker.submit)
        return self.gate

    def close(self) -> None:
        if self.gate is not None:
            self.gate.close()  # what it still holds goes to the worker as cancelled
        self.worker.close()


def _crc(buf, offset: int, size: int) -> int:
    return checksum.of(memoryview(buf)[offset:offset + size])


def _matches(buf, offset: int, size: int, crc: int | None) -> bool:
    return checksum.matches(memoryview(buf)[offset:offset + size], crc)
