"""Transfer operations: one class per kind, owning both phases and the reply.

Each kind validates its request and reserves what it needs in ``prepare``
(pool slots, pins, swap records), hands the copy runner its ``pairs`` (pool
byte offset, engine block id), and in ``finish`` commits or drops what it
reserved and builds the reply. ``prepare`` returns the reply itself when
there is nothing to copy (every block skipped, nothing fits).

  StoreOp    engine -> pool, prefix cache: commit on success, drop on failure
  LoadOp     pool -> engine, prefix cache: unpin; corrupt blocks are dropped
  OffloadOp  engine -> pool, request swap: whole requests or nothing
  RestoreOp  pool -> engine, request swap: frees the swap on success

``finish(failed=True)`` is the only way a transfer ends badly (copy error,
cancel, reap, drain): nothing it wrote to the pool becomes visible.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np

from ..pool.index import BlockIndex, LoadPlan, StorePlan
from ..pool.swap import SwapRecord, SwapTable
from ..protocol import messages as m
from ..protocol.arrays import HASH_BYTES, pack_ids, unpack_hashes, unpack_ids
from ..protocol.errors import ErrorCode
from .state import ClientState, DaemonError, Registration

MAX_BLOCKS_PER_OP = 1 << 16
MAX_SWAP_REQUESTS = 4096


class CopyOp:
    """A transfer in flight: what to copy, which way, and how to end it."""

    label: ClassVar[str]
    to_pool: ClassVar[bool]

    def __init__(self, client: ClientState, reg: Registration, request_id: int, pairs: list, fence: bytes = b""):
        self.client, self.reg, self.request_id = client, reg, request_id
        self.pairs = pairs
        self.nbytes = len(pairs) * reg.layout.engine_block_bytes
        self.pieces = len(pairs) * len(reg.layout.moved)  # copy calls: what the in-flight cap counts
        self.started = time.monotonic()
        self.fence = fence              # CUDA: the worker's event to wait on before copying
        self.done_event = b""           # CUDA: this op's "copy finished" event (IPC handle)
        self.cancelled = threading.Event()  # set by cancel/reap/drain; the copy checks it per chunk
        self.cancel_reason = ""
        self.crcs: list[tuple[int, int]] = []  # (pool offset, crc) computed after a store
        self.bad: list[int] = []               # indices whose checksum did not match (loads)

    def cancel(self, why: str) -> None:
        if not self.cancelled.is_set():
            self.cancel_reason = why
            self.cancelled.set()

    def slots(self) -> list[tuple[int, int]]:
        """(index in the request, pool offset) of every kvtier block written or read."""
        raise NotImplementedError

    def finish(self, failed: bool):
        """Commit (``failed=False``) or drop everything reserved; the reply."""
        raise NotImplementedError


class StoreOp(CopyOp):
    label, to_pool = "store", True

    def __init__(self, index: BlockIndex, plan: StorePlan, count: int, *args, **kw):
        super().__init__(*args, **kw)
        self.index, self.plan, self.count = index, plan, count

    @classmethod
    def prepare(cls, index: BlockIndex, client: ClientState, reg: Registration, request_id: int, msg: m.Store):
        fence = check_fence(reg, msg.event)
        keys = check_unique_keys(check_keys(msg.hashes))
        ids = check_ids(reg, msg.blocks, len(keys) * reg.layout.block_factor)
        plan = index.prepare_store(reg.ns, keys)
        pairs = reg.layout.pairs([e.offset if e is not None else None for e in plan.entries], ids)
        op = cls(index, plan, len(keys), client, reg, request_id, pairs, fence)
        return op if pairs else op.finish(False)

    def slots(self):
        return [(i, e.offset) for i, e in enumerate(self.plan.entries) if e is not None]

    def finish(self, failed: bool) -> m.TransferDone:
        written = [i for i, e in enumerate(self.plan.entries) if e is not None] if failed else []
        self.index.complete_store(self.plan, failed=written)
        bad = self.plan.no_space + written
        skipped = len(self.plan.skipped)
        return m.TransferDone(self.count - skipped - len(bad), skipped, pack_ids(sorted(bad)),
                              bool(self.plan.no_space))


class LoadOp(CopyOp):
    label, to_pool = "load", False

    def __init__(self, index: BlockIndex, plan: LoadPlan, count: int, *args, **kw):
        super().__init__(*args, **kw)
        self.index, self.plan, self.count = index, plan, count

    @staticmethod
    def check(reg: Registration, msg: m.Load, keys: list[bytes]):
        """(fence, engine ids) of a valid load request; DaemonError otherwise."""
        fence = check_fence(reg, msg.event)
        k = reg.layout.block_factor
        if not 0 <= msg.skip < k:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"skip must be in [0, {k})")
        if msg.skip and not keys:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "skip needs at least one hash")
        check_unique_keys(keys)
        return fence, check_ids(reg, msg.blocks, len(keys) * k - msg.skip, writes=True)

    @classmethod
    def prepare(cls, index: BlockIndex, client: ClientState, reg: Registration, request_id: int, msg: m.Load,
                keys: list[bytes], checked: tuple):
        """``keys`` and ``checked`` (``check``'s result) come from the dispatch point: a load a lower
        tier held is not checked again when it resumes here."""
        fence, ids = checked
        if msg.prefix:  # lookup-and-load: only the ready prefix, the rest is no failure
            hits = index.lookup(reg.ns, keys)
            keys = keys[:hits]
            ids = ids[:max(0, hits * reg.layout.block_factor - msg.skip)]
        plan = index.prepare_load(reg.ns, keys)
        pairs = reg.layout.pairs([e.offset if e is not None else None for e in plan.entries], ids, msg.skip)
        op = cls(index, plan, len(keys), client, reg, request_id, pairs, fence)
        return op if pairs else op.finish(False)

    def slots(self):
        return [(i, e.offset) for i, e in enumerate(self.plan.entries) if e is not None]

    def finish(self, failed: bool) -> m.TransferDone:
        read = [i for i, e in enumerate(self.plan.entries) if e is not None]
        bad = read if failed else self.bad
        self.index.complete_load(self.plan, failed=bad)
        for i in self.bad:  # corrupt in the pool: nobody may load it again
            self.index.discard(self.plan.entries[i])
        missing = sorted(set(self.plan.missing) | set(bad))
        # The event (CUDA only) tells the worker's stream when the bytes landed.
        return m.TransferDone(self.count - len(missing), 0, pack_ids(missing), event=self.done_event)


class OffloadOp(CopyOp):
    label, to_pool = "offload", True

    def __init__(self, swap: SwapTable, accepted: list, refused: list[int], count: int, full: bool,
                 *args, **kw):
        super().__init__(*args, **kw)
        self.swap, self.accepted, self.refused = swap, accepted, refused
        self.count, self.full = count, full

    @classmethod
    def prepare(cls, swap: SwapTable, client: ClientState, reg: Registration, request_id: int, msg: m.Offload):
        parsed = swap_requests(reg, msg.requests)
        accepted, refused, full = [], [], False
        for i, (request, ids) in enumerate(parsed):
            rec, why = swap.prepare_offload(client.id, reg.swap_quota, reg.ns, request, len(ids),
                                            reg.layout.block_factor, cache=reg.id)
            if rec is None:
                refused.append(i)
                full |= why in ("no_space", "quota")
            else:
                accepted.append((i, rec, ids))
        pairs = [p for _, rec, ids in accepted for p in reg.layout.pairs_flat(rec.offsets, ids)]
        op = cls(swap, accepted, refused, len(parsed), full, client, reg, request_id, pairs)
        return op if accepted else op.finish(False)

    def slots(self):
        return [(i, off) for i, rec, _ in self.accepted for off in rec.offsets]

    def finish(self, failed: bool) -> m.TransferDone:
        for _, rec, _ in self.accepted:
            self.swap.complete_offload(rec, not failed)
        bad = self.refused + ([i for i, _, _ in self.accepted] if failed else [])
        return m.TransferDone(self.count - len(bad), 0, pack_ids(sorted(bad)), self.full)


class RestoreOp(CopyOp):
    label, to_pool = "restore", False

    def __init__(self, swap: SwapTable, rec: SwapRecord, *args, **kw):
        super().__init__(*args, **kw)
        self.swap, self.rec = swap, rec

    @classmethod
    def prepare(cls, swap: SwapTable, client: ClientState, reg: Registration, request_id: int, msg: m.Restore):
        if len(msg.blocks) > 4 * MAX_BLOCKS_PER_OP:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "too many block ids")
        ids = unpack_ids(msg.blocks)
        check_pieces(reg, len(ids))
        check_unique_ids(ids)
        rec = swap.records.get((client.id, msg.request))
        if rec is None or rec.ns is not reg.ns:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"no swapped request {msg.request[:64]!r}")
        if len(ids) != rec.engine_blocks:
            raise DaemonError(ErrorCode.BAD_ARGUMENT,
                              f"request {msg.request[:64]!r} has {rec.engine_blocks} blocks, got {len(ids)} ids")
        why = reg.layout.check_ids(ids)
        if why:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, why)
        if swap.prepare_restore(client.id, msg.request) is None:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"request {msg.request[:64]!r} is not ready "
                              f"({rec.state}): wait for its offload first")
        return cls(swap, rec, client, reg, request_id, reg.layout.pairs_flat(rec.offsets, ids))

    def slots(self):
        return [(0, off) for off in self.rec.offsets]

    def finish(self, failed: bool) -> m.TransferDone:
        # A failed copy keeps the swap for a retry; corrupt data is freed (the engine recomputes).
        bad = failed or bool(self.bad)
        self.swap.complete_restore(self.rec, not failed or bool(self.bad))
        n = len(self.pairs)
        return m.TransferDone(0 if bad else n, 0, pack_ids(range(n) if bad else []))


# ---- validation at the boundary -------------------------------------------------------
def check_fence(reg: Registration, event: bytes) -> bytes:
    """A worker event to fence on: only meaningful for CUDA registrations."""
    if not event:
        return b""
    if reg.cuda_engine is None:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "event given for a cache that is not on a GPU")
    if len(event) > 4096:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "event handle too long")
    return event


def check_keys(hashes: bytes) -> list[bytes]:
    # Checked on the packed length: a 1M-hash lookup is refused before it becomes 1M objects.
    if len(hashes) > MAX_BLOCKS_PER_OP * HASH_BYTES:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, f"at most {MAX_BLOCKS_PER_OP} blocks per call")
    return unpack_hashes(hashes)


def check_unique_keys(keys: list[bytes]) -> list[bytes]:
    """One hash twice in one store or load is never meaningful (a chain's
    hashes differ by construction) but pins one block once per copy: refused."""
    if len(set(keys)) != len(keys):
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "a hash appears twice in one request")
    return keys


def check_unique_ids(ids: np.ndarray) -> None:
    """One engine block written twice by one load or restore: refused (a store
    may read one block for several hashes; reading costs the engine nothing)."""
    if len(ids) > 1 and len(np.unique(ids)) != len(ids):
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "an engine block id appears twice in one request")


def check_pieces(reg: Registration, engine_blocks: int) -> None:
    """The copy thread's cost is per piece (one copy call per tensor per engine
    block), not per byte: 4,096 aliased 1-byte tensors cost 4,096 calls a block."""
    pieces = engine_blocks * len(reg.layout.moved)
    if pieces > reg.max_copy_pieces:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, f"this transfer costs {pieces} separate copies "
                          f"(max {reg.max_copy_pieces}); send fewer blocks per call")


def check_ids(reg: Registration, blocks: bytes, expected: int, writes: bool = False) -> np.ndarray:
    """``writes``: the transfer writes these engine blocks (a load), so each may appear once."""
    if len(blocks) > 4 * MAX_BLOCKS_PER_OP * reg.layout.block_factor:  # before unpacking anything
        raise DaemonError(ErrorCode.BAD_ARGUMENT, "too many block ids")
    ids = unpack_ids(blocks)
    check_pieces(reg, len(ids))
    if len(ids) != expected:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, f"expected {expected} block ids, got {len(ids)}")
    if writes:
        check_unique_ids(ids)
    why = reg.layout.check_ids(ids)
    if why:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, why)
    return ids


def swap_requests(reg: Registration, requests: list) -> list[tuple[str, np.ndarray]]:
    if not 0 < len(requests) <= MAX_SWAP_REQUESTS:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests must hold 1..{MAX_SWAP_REQUESTS} entries")
    out, seen, total = [], set(), 0
    for i, item in enumerate(requests):
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], bytes) or not 0 < len(item[0]) <= 256):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}] must be [request_id (1..256 chars), block ids]")
        if item[0] in seen:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"request {item[0][:64]!r} listed twice")
        seen.add(item[0])
        if not 0 < len(item[1]) <= 4 * MAX_BLOCKS_PER_OP:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}] needs 1..{MAX_BLOCKS_PER_OP} blocks")
        ids = unpack_ids(item[1])
        if not 0 < len(ids) <= MAX_BLOCKS_PER_OP:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}] needs 1..{MAX_BLOCKS_PER_OP} blocks")
        why = reg.layout.check_ids(ids)
        if why:
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"requests[{i}]: {why}")
        total += len(ids)
        out.append((item[0], ids))
    check_pieces(reg, total)
    return out
