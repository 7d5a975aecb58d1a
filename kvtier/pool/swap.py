"""Request swap: a preempted request's blocks, owned by one client.

Swap records are not content-addressed, never shared, never evicted while the
owner lives. Their slots come from the same slab pool as the prefix cache:
allocation evicts prefix blocks (never swap: swap slots are invisible to the
eviction policy and pin their slab). Each owner's cache (its registration,
``cache``) has a byte quota and all swap together is capped at a share of the pool. With per-tenant shares on, swap is
the tenant's like its prefix blocks: its slots are taken within its share
(``index.alloc_for``), so at its share an offload evicts the tenant's own
oldest blocks, never another tenant's.

Record life: prepare_offload -> WRITING -> complete_offload -> READY
-> prepare_restore -> RESTORING -> complete_restore(ok) frees it (or back to
READY on failure, so the engine may retry). ``discard`` and
``release_owner`` free READY records now and in-flight ones when their copy
ends.

Primitives: ``prepare_offload``, ``complete_offload``, ``prepare_restore``,
``complete_restore``, ``discard``, ``release_owner``, ``owner_bytes``, ``cache_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import BlockIndex, Bucket

WRITING, READY, RESTORING = "writing", "ready", "restoring"


@dataclass(eq=False)
class SwapRecord:
    owner: int
    request: str
    ns: Bucket
    engine_blocks: int
    offsets: list[int] = field(default_factory=list)
    state: str = WRITING
    doomed: bool = False      # discarded or owner gone while a copy ran
    cache: int = 0            # the owner's cache whose quota it counts against

    @property
    def nbytes(self) -> int:
        return len(self.offsets) * self.ns.block_bytes


class SwapTable:
    def __init__(self, index: BlockIndex, max_bytes: int):
        self.index = index
        self.max_bytes = max_bytes
        self.records: dict[tuple[int, str], SwapRecord] = {}
        self._owner_bytes: dict[int, int] = {}
        self._cache_bytes: dict[tuple[int, int], int] = {}  # (owner, cache) -> bytes, for quotas
        self.total_bytes = 0
        # Swap slots per slab. A slab holding one swap slot is pinned whole (no eviction
        # there), so the pool-wide cap counts slabs, not block bytes: eight one-block
        # swaps of eight block sizes once pinned eight slabs while "using" a few KiB.
        self._slab_slots: dict[int, int] = {}

    @property
    def pinned_slab_bytes(self) -> int:
        return len(self._slab_slots) * self.index.alloc_.slab_bytes

    def owner_bytes(self, owner: int) -> int:
        return self._owner_bytes.get(owner, 0)

    def owner_requests(self, owner: int) -> int:
        return sum(1 for o, _ in self.records if o == owner)

    # ---- offload ----------------------------------------------------------------
    def cache_bytes(self, owner: int, cache: int) -> int:
        return self._cache_bytes.get((owner, cache), 0)

    def prepare_offload(self, owner: int, quota: int | float, ns: Bucket, request: str,
                        engine_blocks: int, block_factor: int, cache: int = 0) -> tuple[SwapRecord | None, str]:
        """Reserve room for one request, all or nothing: ``quota`` bounds what
        the owner's ``cache`` holds. Returns (record, "") or (None, reason) with
        reason "exists", "quota" or "no_space"."""
        if (owner, request) in self.records:
            return None, "exists"
        slots = -(-engine_blocks // block_factor)
        need = slots * ns.block_bytes
        if self.cache_bytes(owner, cache) + need > quota:  # 0 is a quota too: no swap
            return None, "quota"
        if self.total_bytes + need > self.max_bytes:
            return None, "no_space"
        rec = SwapRecord(owner, request, ns, engine_blocks, self.index.alloc_for(ns, slots), cache=cache)
        if len(rec.offsets) < slots:
            for o in rec.offsets:
                self.index.free(o)
            return None, "no_space"
        slab_of = self.index.alloc_.slab_of
        new_slabs = {slab_of(o) for o in rec.offsets} - self._slab_slots.keys()
        if (len(self._slab_slots) + len(new_slabs)) * self.index.alloc_.slab_bytes > self.max_bytes:
            for o in rec.offsets:
                self.index.free(o)
            return None, "no_space"
        for o in rec.offsets:
            self._slab_slots[slab_of(o)] = self._slab_slots.get(slab_of(o), 0) + 1
        self.index.pinned_offsets.update(rec.offsets)
        self.records[(owner, request)] = rec
        self._account(rec, rec.nbytes)
        return rec, ""

    def complete_offload(self, rec: SwapRecord, ok: bool) -> None:
        if ok and not rec.doomed:
            rec.state = READY
        else:
            self._free(rec)

    # ---- restore ------------------------------------------------------------------
    def prepare_restore(self, owner: int, request: str) -> SwapRecord | None:
        rec = self.records.get((owner, request))
        if rec is None or rec.state != READY:
            return None
        rec.state = RESTORING
        return rec

    def complete_restore(self, rec: SwapRecord, ok: bool) -> None:
        if ok or rec.doomed:
            self._free(rec)
        else:
            rec.state = READY  # keep the data: the engine may retry or discard

    # ---- release --------------------------------------------------------------------
    def discard(self, owner: int, request: str) -> bool:
        rec = self.records.get((owner, request))
        if rec is None:
            return False
        self._doom(rec)
        return True

    def release_owner(self, owner: int) -> int:
        recs = [r for (o, _), r in self.records.items() if o == owner]
        for rec in recs:
            self._doom(rec)
        return len(recs)

    def _doom(self, rec: SwapRecord) -> None:
        if rec.state == READY:
            self._free(rec)
        else:
            rec.doomed = True  # freed when its copy completes

    def _free(self, rec: SwapRecord) -> None:
        if self.records.get((rec.owner, rec.request)) is not rec:
            return
        del self.records[(rec.owner, rec.request)]
        for off in rec.offsets:
            self.index.pinned_offsets.discard(off)
            self.index.free(off)
            s = self.index.alloc_.slab_of(off)
            self._slab_slots[s] -= 1
            if not self._slab_slots[s]:
                del self._slab_slots[s]
        self._account(rec, -rec.nbytes)

    def _account(self, rec: SwapRecord, delta: int) -> None:
        self.total_bytes += delta
        for table, key in ((self._owner_bytes, rec.owner), (self._cache_bytes, (rec.owner, rec.cache))):
            left = table.get(key, 0) + delta
            if left:
                table[key] = left
            else:
                table.pop(key, None)

    def counters(self) -> dict:
        return {"records": len(self.records), "bytes": self.total_bytes,
                "slots": sum(len(r.offsets) for r in self.records.values()),
                "owners": dict(self._owner_bytes)}

    def check_integrity(self) -> None:
        from .allocator import IntegrityError
        slots = {o for r in self.records.values() for o in r.offsets}
        total = sum(r.nbytes for r in self.records.values())
        if slots != self.index.pinned_offsets or total != self.total_bytes:
            raise IntegrityError(f"swap table disagrees with the pool: {self.counters()}, "
                                 f"held_outside={len(self.index.pinned_offsets)}")
