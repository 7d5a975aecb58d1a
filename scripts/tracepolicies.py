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
  s3fifo        S3-FIFO (Yang et al., SOSP'23): a small FIFO of 10% of the capacity takes
                new blocks; one referenced again while there moves to the main FIFO (90%),
                the rest leave and are remembered in a ghost FIFO (as many ids as the main
                part holds); a ghost referenced again enters the main part directly; the
                main part reinserts a block referenced since its last pass (a 2-bit count,
                one less per pass) and evicts the others
  slru          segmented LRU: new blocks enter a probation LRU; a block referenced
                there moves to a protected LRU of 80% of the capacity, whose overflow goes
                back to probation's recent end; eviction takes probation's oldest first
The constants are the published defaults (W-TinyLFU's 1% window and 10x sample,
S3-FIFO's 10% small queue and move-on-one-reference as in libCacheSim, SLRU's 80%
protected as in Caffeine), or one capacity, not fitted to the trace.
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


class S3FIFO:
    def __init__(self, capacity: int):
        self.scap = max(1, capacity // 10)
        self.mcap = max(1, capacity - self.scap)
        self.small, self.main, self.ghost = OrderedDict(), OrderedDict(), OrderedDict()
        self.freq: dict[int, int] = {}  # references since insertion (or the last pass), at most 3

    def __contains__(self, b) -> bool:
        return b in self.small or b in self.main

    def request(self, ids: list[int]) -> None:
        for b in reversed(ids):  # tail first, as tracesim's other policies
            if b in self:
                self.freq[b] = min(3, self.freq[b] + 1)
                continue
            self.freq[b] = 0
            if b in self.ghost:  # left the small queue unreferenced, and came back
                del self.ghost[b]
                self.main[b] = None
                self._shrink_main()
            else:
                self.small[b] = None
                self._shrink_small()

    def _shrink_small(self) -> None:
        while len(self.small) > self.scap:
            b = self.small.popitem(last=False)[0]
            if self.freq[b] >= 1:  # referenced while on probation: keep it
                self.freq[b] = 0
                self.main[b] = None
                self._shrink_main()
            else:
                del self.freq[b]
                self.ghost[b] = None
                while len(self.ghost) > self.mcap:
                    self.ghost.popitem(last=False)

    def _shrink_main(self) -> None:
        while len(self.main) > self.mcap:
            b = self.main.popitem(last=False)[0]
            if self.freq[b] > 0:  # a second chance per reference, as a 2-bit clock
                self.freq[b] -= 1
                self.main[b] = None
            else:
                del self.freq[b]


class SLRU:
    def __init__(self, capacity: int, protected_share: float = 0.8):
        self.capacity = capacity
        self.pcap = int(capacity * protected_share)
        self.probation, self.protected = OrderedDict(), OrderedDict()

    def __contains__(self, b) -> bool:
        return b in self.probation or b in self.protected

    def request(self, ids: list[int]) -> None:
        for b in reversed(ids):  # tail first, as tracesim's other policies
            if b in self.protected:
                self.protected.move_to_end(b)
            elif b in self.probation:
                del self.probation[b]
                self.protected[b] = None
                while len(self.protected) > self.pcap:
                    self.probation[self.protected.popitem(last=False)[0]] = None
            else:
                self.probation[b] = None
        while len(self.probation) + len(self.protected) > self.capacity:
            part = self.probation if self.probation else self.protected
            part.popitem(last=False)


POLICIES = {"children": children, "leaf-first": leaf_first, "wtinylfu": WTinyLFU,
            "wtinylfu-tail": lambda capacity: WTinyLFU(capacity, per_request=True),
            "s3fifo": S3FIFO, "slru": SLRU}
