"""The prefix index's self-check: every structure agrees with every other.

Run by tests after each step and by the daemon on ``stats(check=True)``; a
disagreement is an ``IntegrityError`` naming what disagrees. Kept apart from
``index.py`` so the index holds only what its operations need.

Primitives: ``counters(index) -> dict``, ``check(index)``.
"""

from __future__ import annotations

from .allocator import IntegrityError
from .entry import READY, WRITING
from .policy import LRUPolicy


def counters(index) -> dict:
    entries = [e for n in index.namespaces.values() for e in n.all_entries().values()]
    return {
        "entries": len(entries), "ready": sum(e.state == READY for e in entries),
        "writing": sum(e.state == WRITING for e in entries),
        "pinned": sum(e.pins > 0 for e in entries), "pins": sum(e.pins for e in entries),
        "policy": len(index.policy), "slots": len(index.slots), "in_slots": index.slots.count(),
        "held_outside": len(index.pinned_offsets), "evictions": index.evictions,
        "allocator": index.alloc_.counters(),
    }


def check(index) -> None:
    index.alloc_.check_integrity()
    c = index.counters()
    problems = []
    if c["ready"] != c["policy"]:
        problems.append("ready entries != policy size")
    if not c["entries"] == c["slots"] == c["in_slots"]:
        problems.append("entries != offset map")
    used = sum(k.used for k in index.alloc_.classes)
    if used != c["entries"] + c["held_outside"]:
        problems.append(f"allocator used {used} != entries + held outside")
    order = getattr(index.policy, "all", index.policy)  # the split's global order, or the policy
    linked = isinstance(order, LRUPolicy)  # READY entries, and only they, are linked into it
    for n in index.namespaces.values():
        every = n.all_entries()
        if any(e.pins < 0 for e in every.values()):
            problems.append(f"namespace {n.key}: negative pin count")
        if any(e.ns is not n or e.key != k or index.slots.get(e.offset) is not e for k, e in every.items()):
            problems.append(f"namespace {n.key}: entry links broken")
        if n.ready != sum(e.state == READY for e in every.values()):
            problems.append(f"namespace {n.key}: ready count {n.ready} is wrong")
        # Each entry in exactly one place: READY ones in the ready map or a map a flush hid,
        # the others in the writing map.
        if len(every) != n.held() or any(e.state != WRITING for e in n.writing.values()) or \
                any(e.state != READY for m in [n.ready_map, *n.hidden] for e in m.values()):
            problems.append(f"namespace {n.key}: ready map disagrees with the entries")
        if linked and any((e.lp is None) != (e.state != READY) for e in every.values()):
            problems.append(f"namespace {n.key}: an entry's LRU links disagree with its state")
    problems += index.tenants.problems(index)
    if problems:
        raise IntegrityError(f"{problems}; counters={c}")
