"""The prefix index's self-check: every structure agrees with every other.

Run by tests after each step and by the daemon on ``stats(check=True)``; a
disagreement is an ``IntegrityError`` naming what disagrees. Kept apart from
``index.py`` so the index holds only what its operations need.

Primitives: ``counters(index) -> dict``, ``check(index)``.
"""

from __future__ import annotations

from .allocator import IntegrityError
from .entry import READY, WRITING


def counters(index) -> dict:
    entries = [e for n in index.namespaces.values() for e in n.entries.values()]
    return {
        "entries": len(entries), "ready": sum(e.state == READY for e in entries),
        "writing": sum(e.state == WRITING for e in entries),
        "pinned": sum(e.pins > 0 for e in entries), "pins": sum(e.pins for e in entries),
        "policy": len(index.policy), "by_offset": len(index.by_offset),
        "held_outside": len(index.pinned_offsets), "evictions": index.evictions,
        "allocator": index.alloc_.counters(),
    }


def check(index) -> None:
    index.alloc_.check_integrity()
    c = index.counters()
    problems = []
    if c["ready"] != c["policy"]:
        problems.append("ready entries != policy size")
    if c["entries"] != c["by_offset"]:
        problems.append("entries != offset map")
    used = sum(k.used for k in index.alloc_.classes)
    if used != c["entries"] + c["held_outside"]:
        problems.append(f"allocator used {used} != entries + held outside")
    if any(e.pins < 0 for n in index.namespaces.values() for e in n.entries.values()):
        problems.append("negative pin count")
    for n in index.namespaces.values():
        if any(e.ns is not n or e.offset not in index.by_offset for e in n.entries.values()):
            problems.append(f"namespace {n.key}: entry links broken")
        if n.ready != sum(e.state == READY for e in n.entries.values()):
            problems.append(f"namespace {n.key}: ready count {n.ready} is wrong")
        visible = dict(n.ready_map)  # with the maps a flush hid: every READY entry exactly once
        for hidden in n.hidden:
            visible.update(hidden)
        if visible != {k: e for k, e in n.entries.items() if e.state == READY} or \
                len(visible) != len(n.ready_map) + sum(map(len, n.hidden)):
            problems.append(f"namespace {n.key}: ready map disagrees with the entries")
    problems += index.tenants.problems(index)
    if problems:
        raise IntegrityError(f"{problems}; counters={c}")
