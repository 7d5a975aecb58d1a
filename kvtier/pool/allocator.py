"""Slab allocator: one byte range serves blocks of many sizes.

Engines of different models have different block sizes. The pool is cut into
equal slabs; a slab is assigned to one size class on first use and returned
to the free list when its last block is freed. Within a slab, slots of the
class's stride are handed out lowest first (a heap), and a class keeps filling
the slab it used last: blocks allocated together sit at ascending adjacent
offsets even after frees, so the copy routine moves them as one run (LIFO
slots came back in descending order after frees and never merged).

A size class may belong to one owner (``add_class(block_bytes, owner)``, the
index does so when per-tenant shares are on): its slabs then hold that
owner's blocks only, and ``owner_slabs`` counts the slabs each owner's classes
occupy - what its blocks really take of the pool, however few and small.

Waste reported = unassigned tail of the pool + per assigned slab the space
that does not fit a whole slot + per used slot the stride rounding.

Blocks live in whole slabs only: a pool that is not a multiple of the slab
has a tail no block ever uses (``tail_bytes``; ``fit_warning`` says so at
start), and how many blocks of a size fit is slabs x slots per slab, not the
pool's size over the block's (``size_capacity``).

Primitives: ``SlabAllocator(capacity, slab_bytes, usable=None)`` (``usable``: the bytes whose
pages are in; ``open_to(usable)`` as more come in, ``faulting_bytes`` what is still out),
``add_class(block_bytes, owner="") -> cls``, ``alloc(cls) -> offset | None``,
``alloc_many(cls, n) -> [offset]`` (ascending runs, fewer when full), ``free(offset)``, ``slab_of(offset)``, ``used_offsets(slab)``,
``claim([(cls, offset)]) -> [bool]`` (warm restart: take exactly these slots), ``owner_slabs``,
``tail_bytes``, ``size_capacity() -> [dict]``, ``fit_warning(pool, slab) -> str | None``, ``check_integrity()``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

ALIGN = 256  # slot alignment: keeps every dtype view aligned, DMA-friendly


class IntegrityError(RuntimeError):
    """Counters disagree; the message carries every counter."""


@dataclass
class SizeClass:
    block_bytes: int
    stride: int
    per_slab: int
    partial: set[int] = field(default_factory=set)  # slabs with free slots
    current: int = -1        # the slab allocated from last: filled before another is picked
    slabs: int = 0
    used: int = 0
    owner: str = ""          # whose blocks its slabs hold ("" = anyone's: shares off)


@dataclass
class Slab:
    cls: int = -1
    free: list[int] = field(default_factory=list)  # free slot indices, a min-heap
    used: int = 0
    taken: bytearray = field(default_factory=bytearray)  # 1 per slot in use: catches double frees


def fit_warning(pool_bytes: int, slab_bytes: int) -> str | None:
    """Why a pool of this size holds fewer blocks than its size suggests, or None."""
    slabs, tail = divmod(pool_bytes, slab_bytes)
    if not slabs:
        return f"pool_size {pool_bytes} is smaller than one slab ({slab_bytes} bytes): it holds no blocks"
    if tail:
        return (f"pool_size {pool_bytes} is not a multiple of slab_size {slab_bytes}: blocks live in whole "
                f"slabs, so {slabs} slab(s) hold blocks and the last {tail} bytes never do "
                f"(pool_size {slabs * slab_bytes} or {(slabs + 1) * slab_bytes} wastes nothing)")
    return None


class SlabAllocator:
    def __init__(self, capacity: int, slab_bytes: int, usable: int | None = None):
        """``usable``: bytes from the pool's start whose pages are in (None: all of it); the
        slabs past it are handed out once ``open_to`` says they are in too."""
        if slab_bytes <= 0 or slab_bytes % ALIGN:
            raise ValueError(f"slab_bytes must be a positive multiple of {ALIGN}")
        if capacity < slab_bytes:
            raise ValueError(f"pool of {capacity} bytes is smaller than one slab ({slab_bytes})")
        self.capacity = capacity
        self.slab_bytes = slab_bytes
        self.slabs = [Slab() for _ in range(capacity // slab_bytes)]
        # Slabs [0, opened) are the allocator's; the others wait for their pages (a pool that
        # serves while it faults in: no block may live where a copy could still fault).
        self.opened = len(self.slabs) if usable is None else min(len(self.slabs), usable // slab_bytes)
        self.free_slabs = list(range(self.opened - 1, -1, -1))
        self.classes: list[SizeClass] = []
        self._by_size: dict[tuple[int, str], int] = {}
        self.owner_slabs: dict[str, int] = {}  # owner -> slabs its classes hold (updated per slab)

    def open_to(self, usable: int) -> int:
        """The pool's first ``usable`` bytes are in now: their whole slabs join the free list
        (after the free ones: slabs in use are filled first). Returns how many joined."""
        n = min(len(self.slabs), usable // self.slab_bytes)
        if n <= self.opened:
            return 0
        self.free_slabs[:0] = range(n - 1, self.opened - 1, -1)
        added, self.opened = n - self.opened, n
        return added

    @property
    def faulting_bytes(self) -> int:
        """Bytes of slabs not handed out yet because their pages are not in."""
        return (len(self.slabs) - self.opened) * self.slab_bytes

    def add_class(self, block_bytes: int, owner: str = "") -> int:
        if block_bytes <= 0:
            raise ValueError("block size must be positive")
        if block_bytes > self.slab_bytes:
            raise ValueError(f"block of {block_bytes} bytes exceeds the slab size "
                             f"({self.slab_bytes}); raise slab_bytes")
        got = self._by_size.get((block_bytes, owner))
        if got is not None:
            return got
        stride = -(-block_bytes // ALIGN) * ALIGN
        self.classes.append(SizeClass(block_bytes, stride, self.slab_bytes // stride, owner=owner))
        self._by_size[(block_bytes, owner)] = len(self.classes) - 1
        return len(self.classes) - 1

    def _slab_owned(self, c: SizeClass, delta: int) -> None:
        left = self.owner_slabs.get(c.owner, 0) + delta
        if left:
            self.owner_slabs[c.owner] = left
        else:
            del self.owner_slabs[c.owner]

    def alloc(self, cls: int) -> int | None:
        got = self.alloc_many(cls, 1)
        return got[0] if got else None

    def alloc_many(self, cls: int, n: int) -> list[int]:
        """Up to ``n`` blocks of class ``cls``: lowest free slots of the current
        slab first, so a batch is a few ascending runs."""
        c, out = self.classes[cls], []
        while len(out) < n:
            s = c.current if c.current in c.partial else (min(c.partial) if c.partial else -1)
            if s < 0:
                if not self.free_slabs:
                    break
                s = self.free_slabs.pop()
                slab = self.slabs[s]
                slab.cls, slab.free, slab.used = cls, list(range(c.per_slab)), 0  # sorted: a heap
                slab.taken = bytearray(c.per_slab)
                c.slabs += 1
                self._slab_owned(c, 1)
                c.partial.add(s)
            c.current = s
            slab = self.slabs[s]
            take = min(n - len(out), len(slab.free))
            if take == len(slab.free):
                slots, slab.free = sorted(slab.free), []
            else:
                slots = [heapq.heappop(slab.free) for _ in range(take)]
            for slot in slots:
                slab.taken[slot] = 1
            slab.used += take
            c.used += take
            if not slab.free:
                c.partial.discard(s)
            base, stride = s * self.slab_bytes, c.stride
            out += [base + slot * stride for slot in slots]
        return out

    def free(self, offset: int) -> None:
        s, rem = divmod(offset, self.slab_bytes)
        if not 0 <= s < len(self.slabs) or self.slabs[s].cls < 0:
            raise IntegrityError(f"free of invalid offset {offset}: not in an assigned slab")
        slab = self.slabs[s]
        c = self.classes[slab.cls]
        slot, bad = divmod(rem, c.stride)
        if bad or slot >= c.per_slab or not slab.taken[slot]:
            raise IntegrityError(f"free of invalid offset {offset}: not an allocated block "
                                 f"(double free?)")
        slab.taken[slot] = 0
        heapq.heappush(slab.free, slot)
        slab.used -= 1
        c.used -= 1
        c.partial.add(s)
        if slab.used == 0:  # whole slab back to the pool for any class
            c.partial.discard(s)
            c.slabs -= 1
            self._slab_owned(c, -1)
            slab.cls, slab.free, slab.taken = -1, [], bytearray()
            self.free_slabs.append(s)

    def claim(self, wanted: list[tuple[int, int]]) -> list[bool]:
        """Take exactly the slots at ``wanted`` (class, offset) pairs, on an allocator
        nothing was taken from yet (a warm restart rebuilding a kept pool). A pair
        that is misaligned, out of range, in a slab of another class or already
        taken is refused (False): the caller rejects that block."""
        out, touched = [], set()
        free_slabs = set(self.free_slabs)
        for cls, offset in wanted:
            c = self.classes[cls]
            s, rem = divmod(offset, self.slab_bytes)
            slot, bad = divmod(rem, c.stride)
            ok = 0 <= s < len(self.slabs) and not bad and slot < c.per_slab
            slab = self.slabs[s] if ok else None
            if ok and slab.cls < 0:  # first block seen in this slab: it becomes this class's
                free_slabs.discard(s)
                slab.cls, slab.used, slab.taken = cls, 0, bytearray(c.per_slab)
                c.slabs += 1
                self._slab_owned(c, 1)
            ok = ok and slab.cls == cls and not slab.taken[slot]
            if ok:
                slab.taken[slot] = 1
                slab.used += 1
                c.used += 1
                touched.add(s)
            out.append(ok)
        for s in touched:  # free heaps rebuilt once, not one removal per slot
            slab, c = self.slabs[s], self.classes[self.slabs[s].cls]
            slab.free = [i for i in range(c.per_slab) if not slab.taken[i]]
            c.partial.discard(s)
            if slab.free:
                c.partial.add(s)
        self.free_slabs = [s for s in self.free_slabs if s in free_slabs]
        return out

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    def used_offsets(self, s: int) -> list[int]:
        slab = self.slabs[s]
        if slab.cls < 0:
            return []
        c = self.classes[slab.cls]
        free = set(slab.free)
        return [s * self.slab_bytes + i * c.stride for i in range(c.per_slab) if i not in free]

    # ---- accounting ----------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(c.used * c.block_bytes for c in self.classes)

    @property
    def waste_bytes(self) -> int:
        tail = self.capacity - len(self.slabs) * self.slab_bytes
        per_slab = sum(c.slabs * (self.slab_bytes - c.per_slab * c.stride) for c in self.classes)
        rounding = sum(c.used * (c.stride - c.block_bytes) for c in self.classes)
        return tail + per_slab + rounding

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes - self.waste_bytes - self.faulting_bytes

    @property
    def tail_bytes(self) -> int:
        """The end of the pool no slab covers: no block ever lives there."""
        return self.capacity - len(self.slabs) * self.slab_bytes

    def size_capacity(self) -> list[dict]:
        """Per registered block size (ascending): blocks held; ``max_blocks``, what the pool
        holds of that size alone (every slab its, slots of ``stride`` bytes); ``free_blocks``,
        how many more fit now without evicting (free slabs, and free slots of that size's
        partial slabs, whoever's class they belong to when shares are on)."""
        rows: dict[int, dict] = {}
        for c in self.classes:
            row = rows.setdefault(c.block_bytes, {
                "block_bytes": c.block_bytes, "stride": c.stride, "per_slab": c.per_slab, "blocks": 0,
                "max_blocks": len(self.slabs) * c.per_slab, "free_blocks": len(self.free_slabs) * c.per_slab})
            row["blocks"] += c.used
            row["free_blocks"] += sum(len(self.slabs[s].free) for s in c.partial)
        return [rows[b] for b in sorted(rows)]

    def counters(self) -> dict:
        return {
            "capacity": self.capacity, "slab_bytes": self.slab_bytes, "slabs": len(self.slabs),
            "free_slabs": len(self.free_slabs), "opened_slabs": self.opened, "used_bytes": self.used_bytes,
            "waste_bytes": self.waste_bytes,
            "classes": [{"block_bytes": c.block_bytes, "slabs": c.slabs, "used": c.used,
                         "partial": len(c.partial)} for c in self.classes],
        }

    def check_integrity(self) -> None:
        problems = []
        if len(set(self.free_slabs)) != len(self.free_slabs):
            problems.append("duplicate free slab")
        free = set(self.free_slabs)
        for s, slab in enumerate(self.slabs):
            if s >= self.opened and (slab.cls >= 0 or s in free):
                problems.append(f"slab {s} is used or free before its pages are in (opened {self.opened})")
            elif s < self.opened and (slab.cls < 0) != (s in free):
                problems.append(f"slab {s} cls={slab.cls} vs free list")
            if slab.cls >= 0:
                c = self.classes[slab.cls]
                if slab.used + len(slab.free) != c.per_slab or slab.used <= 0:
                    problems.append(f"slab {s}: used {slab.used} + free {len(slab.free)} != {c.per_slab}")
                if sum(slab.taken) != slab.used or any(slab.taken[i] for i in slab.free):
                    problems.append(f"slab {s}: taken slots disagree with used/free")
                if (s in c.partial) != bool(slab.free):
                    problems.append(f"slab {s}: partial set disagrees")
        for i, c in enumerate(self.classes):
            owned = [s for s, sl in enumerate(self.slabs) if sl.cls == i]
            if len(owned) != c.slabs or sum(self.slabs[s].used for s in owned) != c.used:
                problems.append(f"class {i}: slabs/used counters disagree")
        owners: dict[str, int] = {}
        for c in self.classes:
            if c.slabs:
                owners[c.owner] = owners.get(c.owner, 0) + c.slabs
        if owners != self.owner_slabs:
            problems.append(f"slabs per owner {self.owner_slabs} != classes {owners}")
        if problems:
            raise IntegrityError(f"{problems}; counters={self.counters()}")
