"""The tier below (the disk) talks to the index through its verbs: what it
holds changed (``lower_stored`` / ``lower_removed``) reaches the event stream
and the lookup mirror, and the hits it adds to a lookup are counted by the
index, which owns every counter (``count``)."""

from __future__ import annotations

import pytest

from kvtier.daemon.lookup_index import LookupIndexes
from kvtier.pool import BlockIndex, SlabAllocator
from kvtier.pool.shm_index import ShmIndexReader, seqlock_safe

from .kit import BLOCK_A, SLAB, chain, make_index, stored


class ShelfBelow:
    """The lower tier's side of the contract (``extend``, ``flushed``, ``keys_of``,
    ``on_disk``) over a set of keys, as the disk tier answers it from its index."""

    def __init__(self, ns_key: str, keys: list[bytes]):
        self.ns_key, self.keys = ns_key, set(keys)

    def extend(self, ns, keys, hits):
        while hits < len(keys) and keys[hits] in self.keys:
            hits += 1
        return hits

    def flushed(self, ns):
        self.keys.clear()

    def keys_of(self, ns_key):
        return list(self.keys) if ns_key == self.ns_key else []

    def on_disk(self, ns_key, key):
        return ns_key == self.ns_key and key in self.keys


@pytest.mark.skipif(not seqlock_safe(), reason="no lookup mirrors on this CPU")
def test_blocks_the_tier_below_drops_stay_in_the_mirror_while_ram_holds_them():
    mirror = LookupIndexes(pool_bytes=1 << 20, budget=8 << 20)
    idx = BlockIndex(SlabAllocator(4 * SLAB, SLAB), events=True, mirror=mirror)
    ns = idx.namespace("tenant-a", BLOCK_A)
    ram, disk_only = chain("ram", 3), chain("ram", 3, start=3)
    below = ShelfBelow(ns.key, [])
    idx.attach_lower(below)  # the mirror learns of the tier below through the index
    reader = ShmIndexReader(mirror.segment_for(ns, lambda: idx.ready_keys(ns)))
    try:
        assert stored(idx, ns, ram) == 3
        below.keys.update(ram + disk_only)
        idx.lower_stored(ns.key, ram + disk_only)
        assert reader.ready_prefix(ram + disk_only) == 6
        idx.lower_removed(ns.key, ram + disk_only)  # the disk dropped all six files
        assert reader.ready_prefix(ram + disk_only) == 3  # RAM still holds its three
        kinds = [(kind, k) for kind, _, k in idx.take_events()]
        assert kinds == ([("stored", k) for k in ram] + [("disk_stored", k) for k in ram + disk_only]
                         + [("disk_removed", k) for k in ram + disk_only])
    finally:
        reader.close()
        mirror.close()


def test_the_index_counts_the_hits_below_and_what_a_client_reports():
    idx = make_index()
    ns = idx.namespace("tenant-a", BLOCK_A)
    keys = chain("c", 6)
    assert stored(idx, ns, keys[:2]) == 2
    idx.attach_lower(ShelfBelow(ns.key, keys[2:4]))
    assert idx.lookup(ns, keys) == 4
    assert (ns.stats["hits"], ns.stats["disk_hits"], ns.stats["misses"]) == (4, 2, 2)
    idx.count(ns, lookups=3, hits=5, mirror_lookups=3)
    assert (ns.stats["lookups"], ns.stats["hits"], ns.stats["mirror_lookups"]) == (4, 9, 3)
