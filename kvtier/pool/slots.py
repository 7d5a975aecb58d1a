"""Which prefix entry lives at a pool offset: a list per slab, not a dict per block.

Slab eviction (``index._slab_victims``) asks which entry holds each used slot
of a slab. A dict from offset to entry cost 40-80 B per block (its slot in a
table that doubles, plus rehashing all of it at each doubling: a 2M-entry dict
copies ~80 MB in one call); a list of ``per_slab`` references per slab costs
8 B per slot and never grows. A row is made when a prefix entry first lands in
its slab and kept after the slab empties (it is all None then): at most one
reference per slot of the pool (a pool of 2M 4 KiB slots: 16 MB), made anew
only when the slab comes back in a class with another slot count.

Swap blocks share the slabs but are not entered here (they are never slab-evicted).

Primitives: ``SlotMap(allocator)``: ``add(offset, e)``, ``get(offset)``, ``pop(offset)``, ``len()``,
``count()`` (the rows' entries counted, for the integrity check).
"""

from __future__ import annotations


class SlotMap:
    def __init__(self, allocator) -> None:
        self.alloc_ = allocator
        self._rows: list[list | None] = [None] * len(allocator.slabs)
        self._n = 0

    def _at(self, offset: int) -> tuple[int, int, int] | None:
        """(slab, slot, slots per slab) of ``offset`` in its slab's current class; None in a free slab."""
        a = self.alloc_
        s, rem = divmod(offset, a.slab_bytes)
        cls = a.slabs[s].cls
        if cls < 0:  # (classes[-1] would answer for another class)
            return None
        c = a.classes[cls]
        return s, rem // c.stride, c.per_slab

    def _placed(self, offset: int) -> tuple[int, int, int]:
        at = self._at(offset)
        if at is None:
            raise KeyError(f"offset {offset} is in a free slab")
        return at

    def add(self, offset: int, e) -> None:
        """``e`` now lives at ``offset`` (a slot the allocator gave out)."""
        s, i, per = self._placed(offset)
        row = self._rows[s]
        if row is None or len(row) != per:  # first entry here, or the slab came back in another class
            row = self._rows[s] = [None] * per
        if row[i] is not None:
            raise KeyError(f"offset {offset} holds an entry already")
        row[i] = e
        self._n += 1

    def get(self, offset: int):
        """The entry at ``offset`` (a used slot of an assigned slab), or None."""
        at = self._at(offset)
        row = self._rows[at[0]] if at is not None else None
        return row[at[1]] if row is not None and at[1] < len(row) else None

    def pop(self, offset: int):
        """Forget the entry at ``offset`` (before its slot is freed); KeyError if none."""
        s, i, _ = self._placed(offset)
        e = self.get(offset)
        if e is None:
            raise KeyError(offset)
        self._rows[s][i] = None
        self._n -= 1
        return e

    def __len__(self) -> int:
        return self._n

    def count(self) -> int:
        """Entries actually in the rows (O(slots)): the integrity check compares it with ``len``."""
        return sum(len(r) - r.count(None) for r in self._rows if r is not None)
