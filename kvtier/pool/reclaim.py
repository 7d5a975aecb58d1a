"""Which blocks to evict so one size class gets room: one walk over the policy.

The walk goes oldest first. A block of the class that asks for room goes as it
comes up. A slab of another class goes once the walk has passed every block in
it, i.e. when its newest block is the oldest left: taking the slab when its
oldest block came up threw away blocks of any age with it, chain heads among
them, and a chain without its head is unreachable yet keeps its room (half of
a full two-class pool, 36-39% re-read hits instead of 63-65%:
scripts/bench_size_classes.py, BENCHMARKS.md). Swap slots and blocks being
written are not in the policy and pinned blocks are skipped, so a slab holding
any of them never completes.

If every slab of the other classes holds one recent block, no slab completes
before the walk's end (a walk to the end of a 2M-block pool cost seconds of
Python per store): past ``limit`` other-class blocks the walk takes, as
before, the slab of each next oldest block whole if all of it may go (each
slab read once).

Primitive: ``pick(candidates, cls, need, alloc, slab_victims, limit) -> [entry]``
(entries: ``.pins``, ``.offset``, ``.ns.cls``; ``slab_victims(slab)``: all of a
slab's blocks, or None when one of them may not go).
"""

from __future__ import annotations

from typing import Callable, Iterable

from .allocator import SlabAllocator

SLAB_WALK_LIMIT = 16384  # other-class blocks passed before settling (~1 us of Python each)


def pick(candidates: Iterable, cls: int, need: int, alloc: SlabAllocator,
         slab_victims: Callable[[int], list | None], limit: int = SLAB_WALK_LIMIT) -> list:
    """Blocks to evict, oldest first, until ``need`` blocks of ``cls`` fit (or the walk ends)."""
    victims: list = []
    seen: dict[int, list] = {}  # other classes' slab -> its unpinned blocks walked so far
    tried: set[int] = set()     # past the limit: slabs read (taken or refused), not read again
    slabs, per_slab = alloc.slabs, alloc.classes[cls].per_slab
    passed = 0
    for e in candidates:  # lazy: nothing is removed until the walk is over
        if need <= 0:
            break
        if e.pins:
            continue
        if e.ns.cls == cls:
            victims.append(e)
            need -= 1
            continue
        s = alloc.slab_of(e.offset)
        if passed < limit:
            walked = seen.setdefault(s, [])
            walked.append(e)
            if len(walked) == slabs[s].used:
                victims += seen.pop(s)
                need -= per_slab
            else:
                passed += 1
        elif s not in tried:  # the rule before: the slab of the oldest block left, if it may go
            tried.add(s)
            whole = slab_victims(s)
            if whole:
                victims += whole
                need -= per_slab
    return victims
