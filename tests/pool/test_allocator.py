"""Slab allocator: size classes share one byte range; accounting is exact."""

from __future__ import annotations

import random

import pytest

from kvtier.pool import IntegrityError, SlabAllocator
from kvtier.pool.allocator import ALIGN

SLAB = 64 * 1024


def stride(block: int) -> int:
    return -(-block // ALIGN) * ALIGN


def expected_accounting(a: SlabAllocator, live: dict[int, int]) -> tuple[int, int, int]:
    """(used, waste, free) recomputed from the live offsets alone, not from counters.

    ``live`` maps offset -> block_bytes of every block the test holds.
    """
    nslabs = a.capacity // a.slab_bytes
    by_slab: dict[int, list[int]] = {}
    for off, block in live.items():
        by_slab.setdefault(off // a.slab_bytes, []).append(block)
    used = sum(live.values())
    waste = a.capacity - nslabs * a.slab_bytes  # the tail no slab covers
    free = (nslabs - len(by_slab)) * a.slab_bytes
    for blocks in by_slab.values():
        st = stride(blocks[0])
        per_slab = a.slab_bytes // st
        waste += a.slab_bytes - per_slab * st + len(blocks) * (st - blocks[0])
        free += (per_slab - len(blocks)) * st
    return used, waste, free


def assert_accounting(a: SlabAllocator, live: dict[int, int]) -> None:
    used, waste, free = expected_accounting(a, live)
    assert (a.used_bytes, a.waste_bytes, a.free_bytes) == (used, waste, free)
    assert used + waste + free == a.capacity
    a.check_integrity()


def assert_disjoint(live: dict[int, int], capacity: int) -> None:
    end = 0
    for off in sorted(live):
        assert off % ALIGN == 0 and off >= end, f"block at {off} overlaps the previous one"
        end = off + live[off]
    assert end <= capacity


def test_classes_alloc_free_disjoint():
    a = SlabAllocator(8 * SLAB, SLAB)
    sizes = [4096, 16384, 1000, SLAB]  # 1000 rounds up to a 1024-byte stride
    classes = [a.add_class(s) for s in sizes]
    assert a.add_class(4096) == classes[0]  # same size, same class
    live = {}
    for cls, size in zip(classes, sizes):
        for _ in range(3 if size < SLAB else 2):
            live[a.alloc(cls)] = size
    assert_disjoint(live, a.capacity)
    assert_accounting(a, live)
    for off in list(live)[::2]:
        a.free(off)
        del live[off]
    assert_accounting(a, live)


def test_empty_slab_returns_to_pool_for_another_class():
    a = SlabAllocator(2 * SLAB, SLAB)
    small, big = a.add_class(SLAB // 4), a.add_class(SLAB // 2)
    first = [a.alloc(small) for _ in range(4)]  # fills exactly one slab
    assert {a.slab_of(o) for o in first} == {a.slab_of(first[0])}
    assert a.counters()["free_slabs"] == 1
    for off in first:
        a.free(off)
    # The emptied slab is unassigned again: both slabs are free ...
    assert a.counters()["free_slabs"] == 2
    assert a.counters()["classes"][small]["slabs"] == 0
    # ... so the other class can take both, including the one 'small' used.
    big_offs = [a.alloc(big) for _ in range(4)]
    assert None not in big_offs
    assert a.slab_of(first[0]) in {a.slab_of(o) for o in big_offs}
    assert a.alloc(big) is None and a.alloc(small) is None
    assert_accounting(a, dict.fromkeys(big_offs, SLAB // 2))


def test_alloc_returns_none_when_full_and_changes_nothing():
    a = SlabAllocator(3 * SLAB, SLAB)
    cls = a.add_class(10_000)  # stride 10_240: 6 per slab, 4_096 bytes of slab tail
    live = {}
    for _ in range(18):
        live[a.alloc(cls)] = 10_000
    before = a.counters()
    assert a.alloc(cls) is None
    assert a.counters() == before and a.free_bytes == 0
    assert_accounting(a, live)
    # A freed slot is immediately reusable.
    off = next(iter(live))
    a.free(off)
    assert a.alloc(cls) == off


@pytest.mark.parametrize("capacity, blocks", [
    (4 * SLAB, [4096] * 5 + [8192] * 9),                    # mixed aligned sizes
    (4 * SLAB, [1] * 3 + [257] * 4 + [SLAB - 1]),           # odd sizes that round to ALIGN
    (5 * SLAB + 12_345, [3000] * 30 + [SLAB // 3] * 2),     # pool not a multiple of the slab
    (3 * SLAB + ALIGN, []),                                  # empty pool: tail is waste
])
def test_accounting_adds_up(capacity, blocks):
    a = SlabAllocator(capacity, SLAB)
    live = {}
    assert_accounting(a, live)
    for size in blocks:
        off = a.alloc(a.add_class(size))
        assert off is not None
        live[off] = size
        assert_accounting(a, live)
    assert_disjoint(live, capacity)
    for off in sorted(live, reverse=True):
        a.free(off)
        del live[off]
        assert_accounting(a, live)
    assert a.used_bytes == 0 and a.free_bytes == (capacity // SLAB) * SLAB


def test_bad_geometry_raises_value_error():
    a = SlabAllocator(2 * SLAB, SLAB)
    with pytest.raises(ValueError, match="exceeds the slab"):
        a.add_class(SLAB + 1)
    with pytest.raises(ValueError):
        a.add_class(0)
    with pytest.raises(ValueError):
        SlabAllocator(2 * SLAB, SLAB + 1)  # slab not a multiple of ALIGN
    with pytest.raises(ValueError):
        SlabAllocator(SLAB - 1, SLAB)      # pool smaller than a slab
    assert a.classes == []


def test_double_free_is_detected_while_slab_has_other_blocks():
    a = SlabAllocator(2 * SLAB, SLAB)
    cls = a.add_class(4096)
    x, y = a.alloc(cls), a.alloc(cls)
    a.free(x)
    with pytest.raises(IntegrityError):
        a.free(x)
    # The failed free must not have disturbed y's slab.
    a.check_integrity()
    assert a.used_bytes == 4096 and a.used_offsets(a.slab_of(y)) == [y]


def test_double_free_after_slab_returned():
    a = SlabAllocator(2 * SLAB, SLAB)
    x = a.alloc(a.add_class(4096))
    a.free(x)
    with pytest.raises(IntegrityError):
        a.free(x)
    a.check_integrity()


@pytest.mark.parametrize("bad", [100, 4096 + 1, -4096, 2 * SLAB, 10 * SLAB, SLAB + 4096])
def test_free_of_invalid_offset(bad):
    # Slab 0 holds two 4 KiB blocks; slab 1 was never assigned.
    a = SlabAllocator(2 * SLAB, SLAB)
    cls = a.add_class(4096)
    a.alloc(cls), a.alloc(cls)
    before = a.counters()
    with pytest.raises(IntegrityError):
        a.free(bad)
    assert a.counters() == before
    a.check_integrity()


def test_free_before_any_class_exists():
    a = SlabAllocator(2 * SLAB, SLAB)
    with pytest.raises(IntegrityError):
        a.free(0)


def test_long_random_sequence_stays_consistent():
    rng = random.Random(1234)
    a = SlabAllocator(16 * SLAB + 777, SLAB)
    sizes = [1, 300, 4096, 5000, 20_000, SLAB // 2, SLAB]
    classes = {s: a.add_class(s) for s in sizes}
    live: dict[int, int] = {}
    full = 0
    for step in range(4000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.choice(sizes)
            off = a.alloc(classes[size])
            if off is None:
                full += 1
                continue
            assert off not in live
            live[off] = size
        if step % 50 == 0:
            assert_disjoint(live, a.capacity)
        assert_accounting(a, live)
    assert full > 0, "the workload never filled the pool; it tests too little"


@pytest.mark.parametrize("corrupt", [
    lambda a: setattr(a.classes[0], "used", a.classes[0].used + 1),
    lambda a: setattr(a.classes[0], "slabs", 0),
    lambda a: a.free_slabs.append(a.free_slabs[0]),
    lambda a: a.slabs[a.free_slabs[0]].__setattr__("cls", 0),
    lambda a: a.classes[0].partial.clear(),
])
def test_integrity_check_catches_corruption(corrupt):
    a = SlabAllocator(4 * SLAB, SLAB)
    cls = a.add_class(4096)
    for _ in range(3):
        a.alloc(cls)
    a.check_integrity()
    corrupt(a)
    with pytest.raises(IntegrityError) as err:
        a.check_integrity()
    # The message carries the counters so a failure in the field is diagnosable.
    assert "counters=" in str(err.value) and "used_bytes" in str(err.value)
