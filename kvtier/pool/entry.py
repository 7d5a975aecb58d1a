"""A prefix-cache entry and its states (the index's; here so its parts share them).

Entry life: WRITING (invisible to lookups, not evictable) -> READY (in the
eviction policy) or freed. ``is_ready(e)``: still the READY entry of its key.

Primitives: ``Entry``, ``WRITING``, ``READY``, ``is_ready``.
"""

from __future__ import annotations

WRITING, READY = "writing", "ready"


class Entry:
    # lp, ln: its neighbours in the eviction order (policy.LRUPolicy links entries; None: in none)
    __slots__ = ("ns", "key", "offset", "state", "pins", "lp", "ln")

    def __init__(self, ns, key: bytes, offset: int):  # ns: its index.Bucket
        self.ns, self.key, self.offset, self.state, self.pins = ns, key, offset, WRITING, 0
        self.lp = self.ln = None


def is_ready(e: Entry) -> bool:
    """``e`` is still the READY entry of its key (not dropped, replaced or hidden by a flush since)."""
    return e.ns.ready_map.get(e.key) is e  # the ready map holds READY entries only
