"""An eviction pass writes each lookup table once: the removals of a batch wait
for its end, an add inside it still wins over an earlier removal of the same
block, and readers see every change once the batch ends."""

from __future__ import annotations

from kvtier.daemon.lookup_index import LookupIndexes
from kvtier.pool.bucket import Bucket
from kvtier.pool.shm_index import ShmIndexReader


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(1, n + 1)]


def mirror_of_eight():
    mirrors = LookupIndexes(pool_bytes=1 << 20, budget=8 << 20)
    ns = Bucket(id=1, key="tenant\x1ffp", block_bytes=4096, cls=0)
    reader = ShmIndexReader(mirrors.segment_for(ns, lambda: keys(8)))
    return mirrors, ns, reader


def test_removals_in_a_batch_reach_the_table_at_its_end_and_a_later_add_wins():
    mirrors, ns, reader = mirror_of_eight()
    k = keys(8)
    try:
        assert reader.ready_prefix(k) == 8
        with mirrors.batch():
            for key in k[4:]:
                mirrors.removed(ns, key)
            assert reader.ready_prefix(k) == 8  # not yet: one write at the end
            mirrors.removed(ns, k[1])
            mirrors.stored(ns, [k[1]])  # evicted, then stored again in the same pass
        assert reader.ready_prefix(k) == 4  # k[4:] gone, k[1] kept
        with mirrors.batch():
            with mirrors.batch():  # nested: joins the outer batch
                mirrors.removed(ns, k[0])
            assert reader.ready_prefix(k) == 4
        assert reader.ready_prefix(k) == 0
    finally:
        reader.close()
        mirrors.close()


def test_outside_a_batch_a_removal_is_written_at_once():
    mirrors, ns, reader = mirror_of_eight()
    try:
        mirrors.removed(ns, keys(8)[2])
        assert reader.ready_prefix(keys(8)) == 2
    finally:
        reader.close()
        mirrors.close()
