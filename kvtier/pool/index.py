"""Prefix-cache index over the slab pool: namespaces, entries, two-phase ops.

An entry is keyed by (namespace, block hash). A namespace is the identity under
which blocks are shared (model, dtype, layout, block size, TP rank/size), given
by the client as a fingerprint string and keyed here by ``tenant SEP fingerprint``
(``keys.ns_key``). The index owns its buckets, entries, policy and allocator:
outer layers use the verbs below, never its dicts.

Entry life: prepare_store -> WRITING (invisible to lookups, not evictable) -> complete_store
-> READY (in the eviction policy) or freed on failure; pinned (being loaded): never evicted.

Primitives (scheduler-style, no I/O):
  BlockIndex(allocator, policy, share, events=, mirror=, journal=)  its listeners, given once
  attach_lower(tier)                       the disk tier (built over this index), the mirror's too
  lower_stored(ns_key, keys) / lower_removed(ns_key, keys)  what it holds changed: events, mirror
  namespace(key, block_bytes) -> Bucket    has_namespace(key), namespaces_matching(pred) -> [Bucket]
  lookup(ns, keys) -> int                  longest READY prefix, refreshes LRU
  prepare_store(ns, keys) -> StorePlan, complete_store(plan, failed=())   dedups; pool full is a value
  prepare_load(ns, keys) -> LoadPlan, complete_load(plan)                 pins what is READY
  pin(entries) / unpin(entries)            hold READY entries (no eviction) for a reader; PinLimit past PIN_MAX
  alloc_for(ns, n) -> [offset]             n slots for ns's tenant (its share, when on): swap too;
                                           alloc(cls) / free(offset)
  adopt(ns, [(key, offset)], enter) -> [Entry | None]  warm restart: READY entries at kept offsets
  enter_in_order(entries)                  adopted entries into the policy, oldest first
  is_ready(e), holds(key, block), ready_entry(ns, key), ready_entries(ns, keys), ready_keys(ns)
  forget_empty(keep) -> [Bucket]
  capacity() -> dict                       pool and per-class occupancy (status)
  pages_in(usable)                         a new pool faulting in: its slabs up to ``usable`` take blocks
  flush(ns=None) -> int                    all at once (tests, tools); the daemon spreads it:
  drains: Drains                           start(buckets) hides at once, step(n) frees (pool/drain.py)
  check_integrity()
  tenants: TenantShares                    slabs per tenant; with share < 1 a store at it evicts its own
  count(ns, **n)                           add to a namespace's counters (lookups a client's mirror answered)
  take_events() -> [(kind, namespace, hash)]  "stored" / "removed" (+ "disk_*": lower_*), if enabled
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

from . import integrity, reclaim
from .bucket import Bucket, LoadPlan, StorePlan
from .entry import OFFSET_MAX, READY, Entry, add_pins, is_ready
from .allocator import IntegrityError, SlabAllocator
from .drain import Drains
from .policy import EvictionPolicy, LRUPolicy
from .prefix import ready_prefix
from .keys import owner_of
from .shares import TenantShares
from .shardmap import get_many, grown
from .slots import SlotMap

MAX_NAMESPACES = 4096
NO_BATCH = nullcontext()  # evict() without a lookup mirror
STAT_KEYS = ("lookups", "hits", "disk_hits", "misses", "stored", "store_skipped", "store_failed",
             "loaded", "load_failed", "evicted", "mirror_lookups", "mirror_hits")


class PinLimit(MemoryError):
    """A request would hold a block more times at once than its entry counts (``entry.PIN_MAX``,
    2^19 - 1: the daemon refuses a hash twice in one request, so it takes that many transfers
    of it in flight, past ``max_transfers_per_user``'s default of 1,024): refused whole, nothing
    pinned; the daemon answers it as a resource it is out of (``ErrorCode.EXHAUSTED``)."""


class BlockIndex:
    def __init__(self, allocator: SlabAllocator, policy: EvictionPolicy | None = None, share: float = 1.0, *,
                 events: bool = False, mirror=None, journal=None):
        """``events``: keep block events for ``take_events``. ``mirror``: .stored(bucket, keys) /
        .removed(bucket, key) as READY changes (the lookup mirrors). ``journal``: .removed(entry)
        before a READY entry's slot is freed (warm restart)."""
        if OFFSET_MAX is not None and allocator.capacity > OFFSET_MAX + 1:
            raise ValueError(f"a pool of {allocator.capacity} bytes is past the compiled index's "
                             f"{OFFSET_MAX + 1} (16 TiB); KVTIER_PURE_PYTHON=1 runs the pure-Python one")
        self.alloc_ = allocator
        self.tenants = TenantShares(allocator, share, policy if policy is not None else LRUPolicy())
        self.policy = self.tenants.policy  # with share < 1 it also keeps each tenant's own order
        self.namespaces: dict[str, Bucket] = {}
        self._next_ns = 0
        self.slots = SlotMap(allocator)  # offset -> prefix entry (a list per slab), for slab eviction
        self.pinned_offsets: set[int] = set()  # offsets held outside the policy (swap)
        self.evictions = 0
        self.slab_walk_limit = reclaim.SLAB_WALK_LIMIT
        self.record_events, self.mirror, self.journal = events, mirror, journal
        self.lower = None  # the tier below, once attached: .extend(ns, keys, hits) -> hits, .flushed(ns | None)
        self._events: list[tuple[str, str, bytes]] = []
        self.drains = Drains(self)

    def attach_lower(self, tier) -> None:
        """The disk tier is built over this index (it pins, stores and reads entries), so it
        comes after it: lookups, flushes and the lookup mirror reach its blocks. Once, at start."""
        if self.lower is not None:
            raise IntegrityError("a lower tier is attached already")
        self.lower = tier
        if self.mirror is not None:
            self.mirror.attach_lower(tier)

    # ---- namespaces ----------------------------------------------------------
    def namespace(self, key: str, block_bytes: int) -> Bucket:
        """The bucket of namespace ``key`` (tenant SEP fingerprint), made at its first use."""
        ns = self.namespaces.get(key)
        if ns is None and len(self.namespaces) >= MAX_NAMESPACES:
            # Empty namespaces nobody uses are forgotten (forget_empty, by the daemon's reaper);
            # the cap keeps a client minting fingerprints from growing the daemon meanwhile.
            raise ValueError(f"too many namespaces ({MAX_NAMESPACES}); flush or restart the daemon")
        if ns is None:
            # Shares on: the tenant's own class, so its slabs hold its blocks only.
            cls = self.alloc_.add_class(block_bytes, self.tenants.class_owner(owner_of(key)))
            self._next_ns += 1  # never reused, even after an empty namespace is forgotten
            ns = Bucket(self._next_ns, key, block_bytes, cls, owner=owner_of(key))
            self.namespaces[key] = ns
        elif ns.block_bytes != block_bytes:
            raise ValueError(f"namespace {key!r} has {ns.block_bytes}-byte blocks, "
                             f"registration has {block_bytes}: fingerprint must include the layout")
        return ns

    def has_namespace(self, key: str) -> bool:
        return key in self.namespaces

    def namespaces_matching(self, pred: Callable[[str], bool] | None = None) -> list[Bucket]:
        """The buckets whose key ``pred`` accepts (None: all), in creation order."""
        return [ns for k, ns in self.namespaces.items() if pred is None or pred(k)]

    # ---- lookup / store / load -------------------------------------------------
    def lookup(self, ns: Bucket, keys: list[bytes]) -> int:
        found = ready_prefix(ns.ready_map, keys)
        self.policy.touch_chain(found)
        hits = len(found)
        stats = ns.stats
        if self.lower is not None and hits < len(keys):  # the disk tier: its blocks are hits too
            ram, hits = hits, self.lower.extend(ns, keys, hits)
            stats["disk_hits"] += hits - ram
        stats["lookups"] += 1
        stats["hits"] += hits
        stats["misses"] += len(keys) - hits
        return hits

    def prepare_store(self, ns: Bucket, keys: list[bytes]) -> StorePlan:
        plan = StorePlan(ns, [None] * len(keys), [], [])
        # Blocks this store skips because they are present are part of the same
        # chain: making room must not evict them (the new blocks would be unreachable).
        if ns.hidden:  # keys a flush hid are stored anew, not skipped
            self.drains.revive(ns, keys)
        writing = ns.writing
        # Each key's entry: READY (ready map) or, while a flush drains, in any of the maps.
        found = list(map(ns.entry, keys)) if ns.hidden else get_many(ns.ready_map, keys)
        held = [e for e in found if e is not None and e.state == READY]
        self.pin(held)
        try:
            todo = {}  # new key -> its first index (a key twice in one store is written once)
            for i, key in enumerate(keys):
                if found[i] is not None or key in writing or key in todo:
                    plan.skipped.append(i)
                else:
                    todo[key] = i
            offsets = self.alloc_for(ns, len(todo))
            slots = self.slots
            for (key, i), offset in zip(todo.items(), offsets):
                e = Entry(ns, key, offset)
                writing[key] = e
                slots.add(offset, e)
                plan.entries[i] = e
            # Once full, the rest of the chain cannot fit either.
            plan.no_space = list(todo.values())[len(offsets):]
        finally:
            self.unpin(held)
        ns.stats.update(store_skipped=len(plan.skipped), store_failed=len(plan.no_space))
        return plan

    def complete_store(self, plan: StorePlan, failed=()) -> int:
        """Commit written entries; failed indices (or all, if abandoned) are freed."""
        if plan.done:
            raise IntegrityError(f"store plan completed twice ({len(plan.entries)} keys)")
        plan.done = True
        failed = set(failed)
        committed = []
        writing = plan.ns.writing
        for i, e in enumerate(plan.entries):
            if e is None:
                continue
            if plan.abandoned or i in failed:
                self._drop(e)
            else:
                e.state = READY
                del writing[e.key]
                committed.append(e)
        plan.ns.ready += len(committed)
        plan.ns.ready_map.update((e.key, e) for e in committed)
        plan.ns.ready_map = grown(plan.ns.ready_map)  # in shards past SPLIT_AT: no rebuild of it all
        self.policy.insert_chain(committed)  # head of the chain ends most recent
        if self.record_events:
            self._events.extend(("stored", plan.ns.key, e.key) for e in committed)
        if self.mirror is not None and committed:
            self.mirror.stored(plan.ns, [e.key for e in committed])
        plan.ns.stats.update(stored=len(committed), store_failed=len(plan.entries) - len(committed)
                             - len(plan.skipped) - len(plan.no_space))
        return len(committed)

    def prepare_load(self, ns: Bucket, keys: list[bytes]) -> LoadPlan:
        entries = get_many(ns.ready_map, keys)
        found = [e for e in entries if e is not None]
        plan = LoadPlan(ns, entries, [i for i, e in enumerate(entries) if e is None] if len(found) < len(keys) else [])
        self.pin(found)
        self.policy.touch_chain(found)
        return plan

    def complete_load(self, plan: LoadPlan, failed=()) -> None:
        if plan.done:
            raise IntegrityError(f"double unpin: load plan completed twice ({len(plan.entries)} keys)")
        plan.done = True
        self.unpin(plan.entries)
        bad = len(set(plan.missing) | set(failed))
        plan.ns.stats.update(loaded=len(plan.entries) - bad, load_failed=bad)

    def pin(self, entries: list[Entry]) -> None:
        """Hold entries against eviction and flush (a reader outside a load, e.g. the
        remote tier writing them out); every pin needs one ``unpin``. None in ``entries`` is skipped."""
        if (bad := add_pins(entries, 1)) is not None:  # a compiled entry holds at most PIN_MAX; nothing changed
            raise PinLimit(f"block {entries[bad].key.hex()} has {entries[bad].pins} readers, the most one holds")

    def unpin(self, entries: list[Entry]) -> None:
        """One ``pin`` of each undone (None skipped); a double unpin changes nothing and raises."""
        if (bad := add_pins(entries, -1)) is not None:
            raise IntegrityError(f"double unpin of {entries[bad].key.hex()}")

    def adopt(self, ns: Bucket, blocks: list[tuple[bytes, int]], enter: bool = True) -> list:
        """READY entries for blocks a previous daemon committed at these offsets
        (oldest first: they enter the policy in that order). A key already
        present or an offset the allocator refuses gives None. ``enter=False``:
        the caller puts them in the policy itself with ``enter_in_order`` (warm
        restart adopts namespace by namespace, then orders every block at once)."""
        wanted, seen = [], set()
        for key, offset in blocks:  # a key present already, or twice: refused before any claim
            wanted.append(None if key in seen or ns.entry(key) is not None else (key, offset))
            seen.add(key)
        claimed = iter(self.alloc_.claim([(ns.cls, w[1]) for w in wanted if w is not None]))
        out = []
        for w in wanted:
            if w is None or not next(claimed):
                out.append(None)
                continue
            e = Entry(ns, *w)
            e.state = READY
            ns.ready_map[e.key] = e
            self.slots.add(e.offset, e)
            if enter:
                self.policy.insert(e)
            out.append(e)
        adopted = [e.key for e in out if e is not None]
        ns.ready += len(adopted)
        ns.ready_map = grown(ns.ready_map)
        if self.mirror is not None and adopted:
            self.mirror.stored(ns, adopted)
        return out

    def enter_in_order(self, entries: list[Entry]) -> None:
        """Put adopted entries (``adopt(..., enter=False)``) in the policy, oldest first."""
        for e in entries:
            self.policy.insert(e)

    is_ready = staticmethod(is_ready)

    def holds(self, key: str, block: bytes) -> bool:
        """The namespace keyed ``key`` has an entry (READY or being written) for ``block``."""
        ns = self.namespaces.get(key)
        return ns is not None and ns.entry(block) is not None

    def ready_entry(self, ns: Bucket, key: bytes) -> Entry | None:
        """The READY entry of ``key`` that lookups see (None: absent, being written, or hidden by a flush)."""
        return ns.ready_map.get(key)

    def ready_keys(self, ns: Bucket) -> list[bytes]:
        return list(ns.ready_map)

    def ready_entries(self, ns: Bucket, keys: list[bytes]) -> list[Entry]:
        """The READY entries among ``keys`` (in their order; missing ones left out)."""
        return [e for e in get_many(ns.ready_map, keys) if e is not None]

    def forget_empty(self, keep) -> list[Bucket]:
        """Forget namespaces with no entries that are not in ``keep`` (registrations,
        swap); returns them. Their ids are never reused; their counters go with them."""
        gone = [k for k, ns in self.namespaces.items() if not ns.held() and ns not in keep]
        return [self.namespaces.pop(k) for k in gone]

    def discard(self, e: Entry) -> None:
        """Drop one READY entry now if unpinned (e.g. its checksum failed)."""
        if e.state == READY and e.pins == 0 and e.ns.entry(e.key) is e:
            self._drop(e, removed=True)

    def flush(self, ns: Bucket | None = None) -> int:
        """Drop READY unpinned entries (of one namespace or all) in one call; returns how many.
        The daemon spreads a flush over loop turns instead (``start_flush``, ``drains.step``)."""
        job = self.start_flush([ns] if ns else list(self.namespaces.values()), ns is None)
        while not job.done:
            self.drains.step(1 << 30)
        return job.removed

    def start_flush(self, buckets: list[Bucket], everything: bool = False):
        """Hide every READY block of ``buckets`` at once (``drains.step`` frees them); the
        tier below forgets them now too (all of it when ``everything``). -> drain.Flush"""
        job = self.drains.start(buckets)
        if self.lower is not None:
            for ns in [None] if everything else buckets:
                self.lower.flushed(ns)
        return job

    # ---- space -----------------------------------------------------------------
    def alloc_for(self, ns: Bucket, n: int) -> list[int]:
        """Up to ``n`` slots of ``ns``'s class for its tenant: with shares on, within
        its share (a tenant at it makes room from its own blocks); stores and swap alike."""
        shares = self.tenants
        return shares.take(self, ns, n) if shares.on else self.alloc_many(ns.cls, n)

    def alloc(self, cls: int) -> int | None:
        got = self.alloc_many(cls, 1)
        return got[0] if got else None

    def alloc_many(self, cls: int, n: int) -> list[int]:
        """Up to ``n`` offsets of class ``cls`` (ascending within a slab), evicting
        in batches to make room; fewer when nothing more is evictable."""
        out = self.alloc_.alloc_many(cls, n)
        while len(out) < n and self._evict_for(cls, n - len(out)):
            out += self.alloc_.alloc_many(cls, n - len(out))
        return out

    def free(self, offset: int) -> None:
        self.alloc_.free(offset)

    def _evict_for(self, cls: int, need: int = 1) -> bool:
        """Evict, oldest first, entries of ``cls`` and whole slabs of other classes
        (once the walk passed all of a slab's blocks) until ``need`` blocks of
        ``cls`` fit, in one walk over the policy (``reclaim.pick``)."""
        victims = reclaim.pick(self.policy.candidates(), cls, need, self.alloc_, self._slab_victims,
                               self.slab_walk_limit)
        return self.evict(victims) > 0

    def evict(self, victims: list[Entry]) -> int:
        """Drop the entries a walk picked (after it: the policy's walk is lazy), counted as
        evictions; the lookup mirror writes each of its tables once for all of them."""
        with self.mirror.batch() if self.mirror is not None else NO_BATCH:
            for v in victims:
                self._drop(v, removed=True)
                v.ns.stats["evicted"] += 1
        self.evictions += len(victims)
        return len(victims)

    def _slab_victims(self, slab: int) -> list[Entry] | None:
        victims = []
        for off in self.alloc_.used_offsets(slab):
            e = self.slots.get(off)
            if e is None or e.state != READY or e.pins:
                return None  # slab holds swap, in-flight or pinned blocks
            victims.append(e)
        return victims

    def count(self, ns: Bucket, **n: int) -> None:
        ns.stats.update(n)

    # The tier below announces its blocks in the same event stream, and the lookup mirror holds them.
    def lower_stored(self, ns_key: str, keys: list[bytes]) -> None:
        """Blocks the tier below now holds: into the mirror, unless ready here (then they are
        in it already: a write-behind of blocks still in RAM costs the table nothing)."""
        if self.record_events:
            self._events.extend(("disk_stored", ns_key, k) for k in keys)
        if self.mirror is not None:
            self.mirror.disk_stored(ns_key, self._not_ready(ns_key, keys))

    def lower_removed(self, ns_key: str, keys: list[bytes]) -> None:
        """Blocks that left the tier below: out of the mirror too, unless ready here."""
        if self.record_events:
            self._events.extend(("disk_removed", ns_key, k) for k in keys)
        if self.mirror is not None:
            self.mirror.disk_removed(ns_key, self._not_ready(ns_key, keys))

    def _not_ready(self, ns_key: str, keys: list[bytes]) -> list[bytes]:
        """Those of ``keys`` the namespace does not hold READY (the mirror has those for RAM)."""
        ns = self.namespaces.get(ns_key)
        return keys if ns is None else [k for k in keys if k not in ns.ready_map]

    def lower_cleared(self, ns_key: str) -> None:  # a flush hid them below (RAM's too): the mirror empties
        if self.mirror is not None:
            self.mirror.disk_cleared(ns_key)

    def take_events(self) -> list[tuple[str, str, bytes]]:
        events, self._events = self._events, []
        return events

    def _drop(self, e: Entry, removed: bool = False) -> None:
        if removed and self.record_events:  # only READY blocks were ever announced
            self._events.append(("removed", e.ns.key, e.key))
        self.policy.remove(e)
        if e.state == READY:
            if self.journal is not None:  # its record goes before its slot can be written again
                self.journal.removed(e)
            e.ns.ready -= 1
            if e.ns.ready_map.pop(e.key, None) is None:
                self.drains.unhide(e)  # a flush hid it (and its mirror entry), or its drain took it
            elif self.mirror is not None:
                self.mirror.removed(e.ns, e.key)
        else:
            del e.ns.writing[e.key]
        self.slots.pop(e.offset)
        self.alloc_.free(e.offset)  # a slab it empties is no longer its tenant's (owner_slabs)

    def pages_in(self, usable: int) -> None:
        """A new pool's first ``usable`` bytes are faulted in: their slabs take blocks now."""
        self.alloc_.open_to(usable)

    def capacity(self) -> dict:
        """The pool's occupancy, as status shows it. ``capacity_bytes`` is what blocks can
        occupy (whole slabs: used + free + waste + faulting), ``pool_bytes`` the mapping,
        ``tail_bytes`` the difference; ``faulting_bytes`` the slabs whose pages are not in yet
        (a pool serving while it faults in); ``sizes`` the blocks each registered size holds
        and can hold."""
        a = self.alloc_
        return {"capacity_bytes": a.capacity - a.tail_bytes, "pool_bytes": a.capacity, "tail_bytes": a.tail_bytes,
                "used_bytes": a.used_bytes, "free_bytes": a.free_bytes, "waste_bytes": a.waste_bytes - a.tail_bytes,
                "faulting_bytes": a.faulting_bytes,
                "slab_bytes": a.slab_bytes, "slabs": len(a.slabs), "free_slabs": len(a.free_slabs),
                "sizes": a.size_capacity()}

    # ---- integrity (kvtier/pool/integrity.py) -------------------------------------
    def counters(self) -> dict:
        return integrity.counters(self)

    def check_integrity(self) -> None:
        integrity.check(self)
