"""A prefix-cache entry, its states and the table of them (the index's; here so its parts share them).

Entry life: WRITING (invisible to lookups, not evictable) -> READY (in the
eviction policy) or freed. ``is_ready(e)``: still the READY entry of its key.

Two builds of the same thing. ``kvtier/pool/_native.c`` (compiled at install
where a C compiler is found): an entry is one 64-byte object with its 16-byte
key and its offset inside, and a ``KeyMap`` is a table of entry pointers keyed
by the entry's own key, ~100 B per block in all where the pure-Python classes
below take ~300 (docs/SCALE.md). Without it, or with ``KVTIER_PURE_PYTHON=1``
in the environment (a baseline for benchmarks, and the fallback's tests), an
entry is a Python object and a map a dict. ``NATIVE`` says which runs.

Primitives: ``Entry``, ``WRITING``, ``READY``, ``is_ready``, ``new_map()`` (key -> Entry),
``add_pins(entries, delta)`` (one call for many: a
load pins and unpins its chain), ``NATIVE`` (``PURE_PYTHON_ASKED``: the variable said so), ``PIN_MAX`` and ``OFFSET_MAX`` (native: the most pins an entry holds, its
last offset; None: unbounded).
"""

from __future__ import annotations

import os

PURE_PYTHON_ASKED = os.environ.get("KVTIER_PURE_PYTHON", "") not in ("", "0")
_native = None
if not PURE_PYTHON_ASKED:
    try:
        from . import _native
    except ImportError:  # built without a C compiler: the pure-Python index below
        pass

NATIVE = _native is not None

if _native is not None:
    _native.seed(os.urandom(16))  # the tables' SipHash key: a tenant cannot aim keys at one probe run
    Entry, WRITING, READY, new_map = _native.Entry, _native.WRITING, _native.READY, _native.KeyMap
    PIN_MAX = _native.PIN_MAX  # readers one block can have at once (19 bits of its word; more: OverflowError)
    OFFSET_MAX = _native.OFFSET_MAX  # the last pool offset an entry holds (44 bits: a 16 TiB pool)
    add_pins = _native.add_pins
else:
    PIN_MAX = OFFSET_MAX = None

    def add_pins(entries, delta: int):  # type: ignore[misc]
        """Pin every entry (None skipped; one named twice, twice) ``delta`` more; None, or
        the index of the first whose pins would go below 0, and then none is changed."""
        if delta >= 0:
            for e in entries:
                if e is not None:
                    e.pins += delta
            return None
        for i, e in enumerate(entries):  # in turn (an entry may be named twice), undone at the first below 0
            if e is not None:
                if e.pins + delta < 0:
                    for u in entries[:i]:
                        if u is not None:
                            u.pins -= delta
                    return i
                e.pins += delta
        return None
    WRITING, READY = "writing", "ready"

    class Entry:  # type: ignore[no-redef]
        # lp, ln: its neighbours in the eviction order (policy.LRUPolicy links entries; None: in none)
        __slots__ = ("ns", "key", "offset", "state", "pins", "lp", "ln")

        def __init__(self, ns, key: bytes, offset: int):  # ns: its index.Bucket
            self.ns, self.key, self.offset, self.state, self.pins = ns, key, offset, WRITING, 0
            self.lp = self.ln = None

    new_map = dict


def is_ready(e: Entry) -> bool:
    """``e`` is still the READY entry of its key (not dropped, replaced or hidden by a flush since)."""
    return e.ns.ready_map.get(e.key) is e  # the ready map holds READY entries only
