"""The index's values: one namespace's entries (``Bucket``) and the plans its
two-phase verbs hand out (``StorePlan``, ``LoadPlan``).

They live here so the index module holds the verbs only; callers read a
plan's ``entries`` (what they asked for, in order) and a bucket's ``key``,
``id``, ``block_bytes`` and ``stats``. Everything else in a bucket is the
index's state: outer layers ask the index (``ready_entry``, ``ready_keys``,
``holds``...) instead of reading it.

Primitives: ``Bucket`` (``ready_blocks()``, ``writing_blocks()``; the index's: ``entry(key)``,
``held()``, ``all_entries()``), ``StorePlan``, ``LoadPlan``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .entry import new_map


@dataclass(eq=False)
class Bucket:
    """The index's entries for one namespace key (tenant SEP fingerprint, one block size).
    Not to be confused with ``kvtier.client.Namespace``, which describes an
    engine's identity and produces the fingerprint."""
    id: int
    key: str                 # keys.ns_key(tenant, fingerprint)
    block_bytes: int
    cls: int
    # Every entry is in exactly one of three places, so a block costs one dict slot, not two:
    ready_map: dict = field(default_factory=new_map)  # key -> Entry, READY entries lookups see (a ShardedMap
    #                                                past shardmap.SPLIT_AT: the index swaps it in)
    writing: dict = field(default_factory=new_map) # key -> Entry, being written (not READY yet)
    hidden: list = field(default_factory=list)  # ready maps a flush detached, still draining (drain.py)
    stats: Counter = field(default_factory=Counter)
    ready: int = 0           # READY entries, kept by the index (stats read it every 0.5 s)
    owner: str = ""          # tenant whose share its blocks count against (keys.owner_of)

    def entry(self, key: bytes):
        """The entry of ``key`` in any state (READY, being written, hidden by a flush), or None."""
        e = self.ready_map.get(key) or self.writing.get(key)
        for h in self.hidden if e is None else ():
            e = h.get(key)
            if e is not None:
                break
        return e

    def held(self) -> int:
        """Entries of this namespace in any state: the slots its blocks occupy."""
        return len(self.ready_map) + len(self.writing) + sum(map(len, self.hidden))

    def all_entries(self) -> dict:
        """key -> Entry for every entry (O(entries): checks, tests and tools only)."""
        out = dict(self.writing)
        for h in self.hidden:
            out.update(h)
        out.update(self.ready_map)
        return out

    def ready_blocks(self) -> int:
        return self.ready

    def writing_blocks(self) -> int:
        """Entries being written (a store or a lower tier's read in flight); hidden ones are READY."""
        return len(self.writing)


@dataclass(eq=False)
class StorePlan:
    ns: Bucket
    entries: list            # Entry to write, or None (skipped / no space), per key
    skipped: list[int]       # indices already present or being written
    no_space: list[int]      # indices that found no room
    abandoned: bool = False  # owner died: commit nothing
    done: bool = False       # completed: a second completion is a caller bug


@dataclass(eq=False)
class LoadPlan:
    ns: Bucket
    entries: list            # pinned Entry per key, or None when missing
    missing: list[int]
    done: bool = False       # completed: a second completion would steal others' pins
