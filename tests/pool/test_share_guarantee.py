"""What a tenant's share guarantees, as a property: no sequence of one tenant's
operations takes another tenant's blocks while that tenant holds no more than
the pool the first one's share leaves it.

The accounting (``kvtier/pool/shares.py`` writes it down) is run here as the
daemon runs it, without sockets: a ``BlockIndex`` with ``tenant_share``, its
``SwapTable``, and the warm-restart journal fed by ``WarmPool``'s own hooks
over a journal in plain memory. Pool: 16 slabs of 256 KiB (4 MiB), so the
journal's 4,096 records are fewer than an attacker's share of 256 B blocks
(8 slabs of 1,024): the record cap, not the slab cap, is what binds there.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import WarmPool
from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.journal import Journal, journal_bytes
from kvtier.pool.keys import SEP
from kvtier.pool.swap import SwapTable

from .kit import chain, present

SLAB, SLABS = 256 * 1024, 16
POOL = SLAB * SLABS
VICTIM_BLOCK = 16 * 1024  # 16 a slab
# The attacker's sizes: tiny (1,024 a slab), one page, 40 KiB (6 a slab, a tail
# left over), a slab's half plus 256 B (one a slab), the victim's own size.
SIZES = [256, 4096, 40 * 1024, SLAB // 2 + 256, VICTIM_BLOCK]


class Tenants:
    """The pool, its swap and its journal, with one victim already holding its guarantee."""

    def __init__(self, share: float):
        self.warm = WarmPool(DaemonConfig())
        self.warm.journal = Journal.create(memoryview(bytearray(journal_bytes(POOL))), POOL, SLAB)
        self.warm.journal.cap_tenants(share)
        self.index = BlockIndex(SlabAllocator(POOL, SLAB), share=share, journal=self.warm)
        self.swap = SwapTable(self.index, POOL // 2)
        limit = self.index.tenants.limit_slabs
        self.guaranteed = min(limit, SLABS - limit) * (SLAB // VICTIM_BLOCK)
        self.victim = self.index.namespace(f"victim{SEP}m", VICTIM_BLOCK)
        self.victim_keys = chain("victim", self.guaranteed)
        assert self.store(self.victim, self.victim_keys) == self.guaranteed

    def store(self, ns, keys, failed=()) -> int:
        plan = self.index.prepare_store(ns, keys)
        return self.commit(plan, failed)

    def commit(self, plan, failed=()) -> int:
        n = self.index.complete_store(plan, failed)
        self.warm.committed(plan, [(e.offset, 0) for e in plan.entries if e is not None])
        return n

    def victim_kept(self) -> int:
        """The victim's blocks a restart would adopt (the journal's own scan)."""
        kept, _ = self.warm.journal.scan()
        return sum(k.ns_key == self.victim.key for k in kept)


OPS = st.lists(st.tuples(st.sampled_from(["store", "store", "hold", "finish", "offload", "restore",
                                          "discard", "lookup", "flush"]),
                         st.integers(0, len(SIZES) - 1), st.integers(1, 2500)), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([0.5, 0.25]), OPS)
def test_no_sequence_of_one_tenants_operations_takes_anothers_guaranteed_blocks(share, ops):
    """The attacker stores in five sizes (some blocks failing, some left being
    written), swaps out and back, refreshes and flushes, in any order. The
    victim's blocks all stay READY and all keep their journal record; the
    attacker's classes never hold more slabs than its share, swap included."""
    t = Tenants(share)
    index, swap = t.index, t.swap
    spaces = [index.namespace(f"attacker{SEP}size{i}", b) for i, b in enumerate(SIZES)]
    held, swapped = [], []
    for n, (op, size, count) in enumerate(ops):
        ns, keys = spaces[size], chain(f"a{n}", count)
        if op == "store":
            t.store(ns, keys, failed=[0] if count % 7 == 0 else ())
        elif op == "hold":  # a store whose copy has not finished: its slots are taken
            held.append(index.prepare_store(ns, keys))
        elif op == "finish" and held:
            t.commit(held.pop(0))
        elif op == "offload":
            rec, _ = swap.prepare_offload(7, float("inf"), ns, f"req{n}", count, 1)
            if rec is not None:
                swap.complete_offload(rec, True)
                swapped.append(rec)
        elif op == "restore" and swapped:
            rec = swapped.pop(0)
            swap.complete_restore(swap.prepare_restore(rec.owner, rec.request), True)
        elif op == "discard" and swapped:
            rec = swapped.pop(0)
            swap.discard(rec.owner, rec.request)
        elif op == "lookup":
            index.lookup(ns, [e.key for e in list(ns.ready_map.values())[:64]])
        elif op == "flush":
            index.flush(ns)
        index.check_integrity()
        swap.check_integrity()
        assert present(t.victim, t.victim_keys) == [True] * t.guaranteed, f"after {op} #{n}"
        assert index.alloc_.owner_slabs.get("attacker", 0) <= index.tenants.limit_slabs
    assert t.victim_kept() == t.guaranteed


def test_the_journal_holds_a_tenant_to_its_share_of_the_records():
    """Issue 30 row 3 without sockets: 4,096 tiny blocks used to take every record,
    so the victim's blocks, stored after them, were served but never kept."""
    t = Tenants(0.5)
    t.index.flush(t.victim)  # the victim stores after the flood
    tiny = t.index.namespace(f"attacker{SEP}tiny", 256)
    assert t.store(tiny, chain("tiny", 4096)) == 4096  # one slab's worth of RAM: within its share
    assert t.warm.journal.kept == 2048 and t.warm.journal.full == 2048
    assert t.store(t.victim, t.victim_keys) == t.guaranteed
    assert t.victim_kept() == t.guaranteed


def test_the_journal_holds_a_tenant_to_its_share_of_the_namespace_slots():
    """1,024 namespace slots serve every tenant: a tenant with many namespaces
    gets half of them, and the victim's namespace still gets one."""
    t = Tenants(0.5)
    t.index.flush(t.victim)
    for i in range(600):
        t.store(t.index.namespace(f"attacker{SEP}ns{i}", 256), chain(f"ns{i}", 1))
    assert t.warm.journal.kept == 512
    assert t.store(t.victim, t.victim_keys) == t.guaranteed
    assert t.victim_kept() == t.guaranteed


def test_the_accounting_is_untouched_with_the_share_off():
    """Share 1: classes are shared by every tenant, no slab is anyone's, and the
    journal is one table as before (the first 4,096 blocks are kept)."""
    t = Tenants(1.0)  # the victim is guaranteed nothing: it holds no blocks yet
    t.store(t.victim, chain("victim", 16))
    assert set(t.index.alloc_.owner_slabs) == {""}
    assert t.index.tenants.usage(t.index) == {"victim": 16 * VICTIM_BLOCK}
    t.store(t.index.namespace(f"attacker{SEP}tiny", 256), chain("tiny", 5000))
    assert t.warm.journal.kept == 4096
