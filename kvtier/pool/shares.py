"""Per-tenant shares of the pool: one tenant cannot evict everyone.

Eviction is global LRU, so without a limit one tenant storing fast (a hostile
user, a runaway batch job) pushes every other tenant's prefix cache out. With
``share`` < 1 each tenant is held to ``share`` of everything it can make the
daemon hold or evict on its behalf. The accounting, all of it:

  * pool slabs. A tenant's size classes are its own (the allocator's class
    owner): a slab holds one tenant's blocks only, and the tenant is charged
    every slab its classes occupy, whole - READY blocks, blocks being
    written and swap alike (swap takes its slots through ``take`` too). At
    most ``limit_slabs`` = max(1, floor(slabs x share)). Charging slot bytes
    instead let one block in each of 16 sizes (35 KB "used") take all 16
    slabs of a pool.
  * journal records (warm restart, ``pool.journal``): at most ``share`` of the
    records and of the namespace slots per tenant; past it a block is served
    but not kept.
  * disk bytes (the disk tier, ``disk.shares``): at most ``share`` of
    ``disk_size``, its own oldest files dropped first.
  * work in flight, whatever ``share``: a user's copies and its loads waiting
    for disk reads or remote fetches count toward ``max_transfers_per_user``
    (``daemon.requests._admit``); a tenant holds at most
    ``max_probes_per_tenant`` of the remote tier's lookup probes, and the
    remote probe and fetch threads and both write backlogs serve tenants in
    turn (``remote.turns``, ``disk.schedule``).

A store or an offload that would pass its slabs first evicts that tenant's
own oldest blocks (of the class it needs, or whole slabs of its other
classes), never another's; what still does not fit is ``no_space``, a value,
as when the pool is full. Below its share it allocates as before: free slabs
first, then global LRU (whole slabs of other classes).

What that guarantees. Against any sequence of one other tenant's
operations, a tenant keeps every block it holds in at most (1 - share) of the
pool's slabs (its own share, when share <= 0.5): the other never holds more
than ``limit_slabs``, so it only takes free slabs or its own. The property
test in ``tests/pool/test_share_guarantee.py`` checks exactly this.

``share`` = 1 keeps the old behaviour and its cost: classes are shared by
every tenant, no per-tenant order runs, and ``usage`` sums the namespaces'
slot bytes (O(namespaces), for stats).

A namespace's owner is the tenant part of its key (``pool.keys.owner_of``); a
key without SEP belongs to tenant "" (tests, tools).

Primitives (no I/O but one rate-limited log line):
  TenantShares(allocator, share, policy)   .policy: the policy the index uses
  on                                        share < 1: own classes, the split order
  class_owner(owner) -> str                 the allocator class owner for a tenant's namespace
  take(index, ns, wanted) -> [offset]       a store's or an offload's allocation: room(), alloc
  room(index, ns, wanted) -> int            blocks this allocation may take
  usage(index) -> {tenant: bytes}, problems(index) -> [str]
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable, Hashable, Iterator

from . import reclaim
from .allocator import SlabAllocator
from .policy import EvictionPolicy, LRUPolicy

log = logging.getLogger(__name__)
LOG_EVERY_S = 60.0  # one "at its share" line per tenant per minute: a flood logs once


class SplitPolicy(EvictionPolicy):
    """The global eviction order plus one per tenant (same kind), kept together, so
    a tenant at its share finds its own oldest blocks without walking everyone's.
    Every chain the index passes is one namespace's, so one tenant's."""

    def __init__(self, make: Callable[[], object]):
        self.all = make()
        # An entry's own links belong to the global order: a tenant's order is of the kind
        # that orders any hashable item (an ordered dict for LRU), where the policy has one.
        keyed = vars(make).get("keyed") if isinstance(make, type) else None
        if keyed is None and isinstance(make, type) and issubclass(make, LRUPolicy):
            # Inheriting LRU's or FIFO's keyed kind would order its tenants by another order.
            raise TypeError(f"{make.__name__} keeps links in the entries: it must name its own `keyed` kind")
        self._make = keyed or make
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
        self.limit_slabs = max(1, int(len(allocator.slabs) * share))  # slabs one tenant's classes may hold
        self.limit = self.limit_slabs * allocator.slab_bytes if self.on else allocator.capacity
        self.at_share: Counter = Counter()  # tenant -> allocations that found it at its share
        self.own_evictions: Counter = Counter()
        self._logged: dict[str, float] = {}
        self.policy = SplitPolicy(type(policy)) if share < 1 else policy

    def class_owner(self, owner: str) -> str:
        """On, a tenant's namespaces get size classes of their own: their slabs are its alone."""
        return owner if self.on else ""

    def take(self, index, ns, wanted: int) -> list[int]:
        return index.alloc_many(ns.cls, self.room(index, ns, wanted))

    def fits(self, ns) -> int:
        """Blocks of ``ns``'s class its tenant may still allocate: free slots in the
        class's slabs plus whole slabs up to its limit."""
        c = self.alloc_.classes[ns.cls]
        spare = self.limit_slabs - self.alloc_.owner_slabs.get(c.owner, 0)
        return c.slabs * c.per_slab - c.used + max(0, spare) * c.per_slab

    def room(self, index, ns, wanted: int) -> int:
        """How many of ``wanted`` new blocks ``ns``'s tenant may allocate; at its
        share, evicts its own oldest first to make that many fit. The caller holds
        (pins) the blocks the store keeps, so they are not taken."""
        if self.share >= 1 or not wanted:
            return wanted
        owner = ns.owner
        fits = self.fits(ns)
        if wanted > fits:
            self.at_share[owner] += 1
            self._evict_own(index, ns, wanted - fits)
            fits = self.fits(ns)
            now = time.monotonic()
            if now - self._logged.get(owner, -LOG_EVERY_S) >= LOG_EVERY_S:
                self._logged[owner] = now
                log.warning("tenant %r is at its pool share (tenant_share %.3g, %d bytes): its stores "
                            "evict its own oldest blocks (%d so far)", owner or "-", self.share,
                            self.limit, self.at_share[owner])
        return max(0, min(wanted, fits))

    def _evict_own(self, index, ns, need: int) -> None:
        # The index's walk (reclaim.pick) over the tenant's own order only: a slab
        # of its other classes goes once every block in it was walked (past the
        # walk limit, whole as it comes up). Its slabs hold only its blocks.
        victims = reclaim.pick(self.policy.own(ns.owner), ns.cls, need, self.alloc_,
                               index._slab_victims, index.slab_walk_limit)
        self.own_evictions[ns.owner] += index.evict(victims)

    def usage(self, index) -> dict:
        """Bytes charged per tenant (tenants holding none left out). On: the slabs
        its classes occupy, whole (prefix blocks, stores in flight, swap). Off: its
        namespaces' slot bytes (swap not included)."""
        if self.on:
            slab = self.alloc_.slab_bytes
            return {t: n * slab for t, n in self.alloc_.owner_slabs.items()}
        truth: Counter = Counter()
        for n in index.namespaces.values():
            truth[n.owner] += n.held() * self.alloc_.classes[n.cls].stride
        return {t: b for t, b in truth.items() if b}

    def problems(self, index) -> list[str]:
        """Each namespace in a class of its tenant's (the allocator checks the slab
        counts), and the orders agree (the index's integrity check)."""
        out = []
        if any(self.alloc_.classes[n.cls].owner != self.class_owner(n.owner) for n in index.namespaces.values()):
            out.append("a namespace's size class belongs to another tenant")
        if self.policy is not index.policy:
            out.append("tenant policy is not the index's")
        elif isinstance(self.policy, SplitPolicy) and \
                sum(map(len, self.policy.by_owner.values())) != len(self.policy.all):
            out.append("per-tenant policies disagree with the global one")
        return out
