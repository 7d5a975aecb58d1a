"""Per-tenant shares of the prefix-cache pool: one tenant cannot evict everyone.

Eviction is global LRU, so without a limit one tenant storing fast (a hostile
user, a runaway batch job) pushes every other tenant's prefix cache out. With
``share`` < 1, a tenant's READY + in-flight blocks may hold at most ``share``
of the pool's bytes: a store that would pass it first evicts that tenant's own
oldest blocks (of the class it needs, or whole slabs holding only its own
evictable blocks), never another's; what still does not fit is ``no_space``,
a value, as when the pool is full. Below its share a store evicts by global
LRU as before. ``share`` = 1 keeps the old behaviour and its cost: no
counter runs, and ``usage`` sums the namespaces (O(namespaces), for stats).

A namespace's owner is the tenant part of its key (``pool.keys.owner_of``); a
key without SEP belongs to tenant "" (tests, tools).

Primitives (no I/O but one rate-limited log line):
  TenantShares(allocator, share, policy)   .policy: the policy the index uses
  on                                        share < 1: counters and the split order run
  take(index, ns, wanted) -> [offset]       a store's allocation: room(), alloc, charge
  charge(ns, blocks)                        O(1) per store batch / dropped block (when on)
  room(index, ns, wanted) -> int            blocks this store may allocate
  usage(index) -> {tenant: bytes}, problems(index) -> [str]
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Hashable, Iterator

from . import reclaim
from .allocator import SlabAllocator

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0  # one "at its share" line per tenant per minute: a flood logs once


class SplitPolicy:
    """The global eviction order plus one per tenant (same kind), kept together, so
    a tenant at its share finds its own oldest blocks without walking everyone's.
    Every chain the index passes is one namespace's, so one tenant's."""

    def __init__(self, make: Callable[[], object]):
        self.all = make()
        self._make = make
        self.by_owner: dict[str, object] = {}

    def _of(self, owner: str):
        p = self.by_owner.get(owner)
        if p is None:
            p = self.by_owner[owner] = self._make()
        return p

    def insert(self, e) -> None:
        self.all.insert(e)
        self._of(e.ns.owner).insert(e)

    def touch(self, e) -> None:
        self.all.touch(e)
        self._of(e.ns.owner).touch(e)

    def touch_chain(self, entries: list) -> None:
        if entries:
            self.all.touch_chain(entries)
            self._of(entries[0].ns.owner).touch_chain(entries)

    def insert_chain(self, entries: list) -> None:
        if entries:
            self.all.insert_chain(entries)
            self._of(entries[0].ns.owner).insert_chain(entries)

    def remove(self, e) -> None:
        self.all.remove(e)
        p = self.by_owner.get(e.ns.owner)
        if p is not None:
            p.remove(e)
            if not len(p):
                del self.by_owner[e.ns.owner]

    def candidates(self) -> Iterator[Hashable]:
        return self.all.candidates()

    def own(self, owner: str) -> Iterator[Hashable]:
        p = self.by_owner.get(owner)
        return p.candidates() if p is not None else iter(())

    def __len__(self) -> int:
        return len(self.all)


class TenantShares:
    def __init__(self, allocator: SlabAllocator, share: float, policy):
        if not 0 < share <= 1:
            raise ValueError("tenant share must be in (0, 1]")
        self.alloc_ = allocator
        self.share = share
        self.on = share < 1
        self.limit = int(allocator.capacity * share)  # bytes of slots one tenant may hold
        self.used: Counter = Counter()     # tenant -> bytes of its READY + WRITING slots
        self.at_share: Counter = Counter()  # tenant -> stores that found it at its share
        self.own_evictions: Counter = Counter()
        self._logged: dict[str, float] = {}
        self.policy = SplitPolicy(type(policy)) if share < 1 else policy

    def stride(self, ns) -> int:
        return self.alloc_.classes[ns.cls].stride

    def charge(self, ns, blocks: int) -> None:
        """``blocks`` (negative: freed) of ``ns``'s class now held by its tenant."""
        if self.on:
            self.used[ns.owner] += blocks * self.stride(ns)

    def take(self, index, ns, wanted: int) -> list[int]:
        offsets = index.alloc_many(ns.cls, self.room(index, ns, wanted))
        self.charge(ns, len(offsets))
        return offsets

    def room(self, index, ns, wanted: int) -> int:
        """How many of ``wanted`` new blocks ``ns``'s tenant may allocate; at its
        share, evicts its own oldest first to make that many fit. The caller holds
        (pins) the blocks the store keeps, so they are not taken."""
        if self.share >= 1 or not wanted:
            return wanted
        stride, owner = self.stride(ns), ns.owner
        over = self.used[owner] + wanted * stride - self.limit
        if over > 0:
            self.at_share[owner] += 1
            self._evict_own(index, ns, over)
            now = time.monotonic()
            if now - self._logged.get(owner, -LOG_EVERY_S) >= LOG_EVERY_S:
                self._logged[owner] = now
                log.warning("tenant %r is at its pool share (tenant_share %.3g, %d bytes): its stores "
                            "evict its own oldest blocks (%d stores so far)", owner or "-", self.share,
                            self.limit, self.at_share[owner])
        return max(0, min(wanted, (self.limit - self.used[owner]) // stride))

    def _evict_own(self, index, ns, over: int) -> None:
        # The index's walk (reclaim.pick) over the tenant's own order only, so a
        # slab of another class completes only when every block in it is the
        # tenant's; past the walk limit, the same: another tenant's block refuses it.
        owner = ns.owner

        def own_slab(slab: int):
            whole = index._slab_victims(slab)
            return whole if whole and all(v.ns.owner == owner for v in whole) else None
        victims = reclaim.pick(self.policy.own(owner), ns.cls, -(-over // self.stride(ns)), self.alloc_,
                               own_slab, index.slab_walk_limit)
        self.own_evictions[owner] += index.evict(victims)

    def usage(self, index) -> dict:
        """Bytes per tenant of its READY + WRITING blocks (tenants holding none left out)."""
        return {t: b for t, b in (self.used if self.on else self._count(index)).items() if b}

    def _count(self, index) -> Counter:
        truth: Counter = Counter()
        for n in index.namespaces.values():
            truth[n.owner] += len(n.entries) * self.stride(n)
        return truth

    def problems(self, index) -> list[str]:
        """The counters recomputed from the entries (the index's integrity check)."""
        truth = self._count(index) if self.on else Counter()
        out = []
        if +truth != +self.used or any(b < 0 for b in self.used.values()):
            out.append(f"tenant bytes {dict(self.used)} != entries {dict(truth)}")
        if self.policy is not index.policy:
            out.append("tenant policy is not the index's")
        elif isinstance(self.policy, SplitPolicy) and \
                sum(map(len, self.policy.by_owner.values())) != len(self.policy.all):
            out.append("per-tenant policies disagree with the global one")
        return out
