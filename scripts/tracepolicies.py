#!/usr/bin/env python3
# Feeds docs/EVICTION.md (the ideas tried after the first study); run through tracesim.py.
"""Eviction ideas that use a prefix trace's chain structure or gate admission.

Each is a cache with ``__contains__`` and ``request(ids)`` (tracesim's
interface); ``tracesim.py --policies`` names them like its own:
  children      LRU, but a block that several chains branch from (distinct next blocks
                seen) outlives a leaf: its key is its last use plus one capacity of
                block references per doubling of its children
  leaf-first    a leaf (no next block seen) that was referenced once goes before any
                other block; LRU among each class
  wtinylfu      W-TinyLFU: a window LRU of 1% of the capacity in front of the main LRU;
                a block leaving the window enters the main part only if a count-min
                sketch (4 rows, 4-bit counters halved every 10 capacities of references,
                a doorkeeper set in front) counts it more often than the main part's victim
  wtinylfu-tail the same admission, decided once per request for its new tail (the
                blocks it stored): the tail enters as a whole if its head is counted
                more often than the victim, else none of it (a tail without its head
                can never hit)
The constants are the published defaults (W-TinyLFU's 1% window and 10x sample),
or one capacity, not fitted to the trace.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict

from tracesim import KeyPolicy


def children(capacity: int) -> KeyPolicy:
    kids: dict[int, set] = defaultdict(set)

    def before(ids):
        for a, b in zip(ids, ids[1:]):
            kids[a].add(b)
    return KeyPolicy(capacity, lambda t, d, h, b: (t + capacity * math.log2(1 + len(kids[b])), -d), before=before)


def leaf_first(capacity: int) -> KeyPolicy:
    kids: dict[int, int] = defaultdict(int)
    seen: dict[int, int] = defaultdict(int)
    last: dict[int, int] = {}

    def before(ids):
        for a, b in zip(ids, ids[1:]):
            if last.get(a) != b:  # a distinct next block (counted when it changes: cheap, close)
                kids[a] += 1
                last[a] = b
        for b in ids:
            seen[b] += 1
    return KeyPolicy(capacity, lambda t, d, h, b: (int(kids[b] > 0 or seen[b] > 1), t, -d), before=before)


class _Sketch:
    """Count-min sketch, 4 rows of 4-bit counters, halved every ``sample`` additions;
    a doorkeeper set takes a block's first sighting since the last halving."""
    SALTS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)

    def __init__(self, capacity: int):
        self.width = 1 << max(4, (4 * capacity - 1).bit_length())
        self.rows = [bytearray(self.width) for _ in self.SALTS]
        self.door: set = set()
        self.sample, self.added = 10 * capacity, 0

    def _cells(self, b):
        return [((b * s) >> 17) & (self.width - 1) for s in self.SALTS]

    def add(self, b) -> None:
        self.added += 1
        if self.added >= self.sample:
            self.added = 0
            self.door.clear()
            self.rows = [bytearray(c >> 1 for c in row) for row in self.rows]
        if b not in self.door:
            self.door.add(b)
            return
        for row, i in zip(self.rows, self._cells(b)):
            if row[i] < 15:
                row[i] += 1

    def count(self, b) -> int:
        return min(row[i] for row, i in zip(self.rows, self._cells(b))) + (b in self.door)


class WTinyLFU:
    def __init__(self, capacity: int, per_request: bool = False):
        self.wcap = max(1, capacity // 100)
        self.mcap = max(1, capacity - self.wcap)
        self.window, self.main, self.sketch = OrderedDict(), OrderedDict(), _Sketch(capacity)
        self.per_request = per_request

    def __contains__(self, b) -> bool:
        return b in self.window or b in self.main

    def request(self, ids: list[int]) -> None:
        new = [b for b in ids if b not in self]
        for b in reversed(ids):  # tail first, as tracesim's other policies
            self.sketch.add(b)
            for part in (self.window, self.main):
                if b in part:
                    part.move_to_end(b)
                    break
            else:
                self.window[b] = None
        if self.per_request and new:
            self._admit_tail(new)
        while len(self.window) > self.wcap:
            self._admit(self.window.popitem(last=False)[0])

    def _admit(self, cand) -> None:
        if len(self.main) < self.mcap:
            self.main[cand] = None
            return
        victim = next(iter(self.main))
        if self.sketch.count(cand) > self.sketch.count(victim):
            del self.main[victim]
            self.main[cand] = None

    def _admit_tail(self, new: list) -> None:
        """The request's new blocks leave the window together: all in, or all dropped."""
        if self.main and len(self.main) + len(new) > self.mcap:
            victim = next(iter(self.main))
            if self.sketch.count(new[0]) <= self.sketch.count(victim):
                for b in new:
                    self.window.pop(b, None)
                return
        for b in reversed(new):
            self.window.pop(b, None)
            self.main[b] = None
        while len(self.main) > self.mcap:
            self.main.popitem(last=False)


POLICIES = {"children": children, "leaf-first": leaf_first, "wtinylfu": WTinyLFU,
            "wtinylfu-tail": lambda capacity: WTinyLFU(capacity, per_request=True)}
