"""The shared-memory ready index: a client answers lookups from the daemon's
table without a round trip, exactly, consistently under concurrent writes,
and only for the namespace whose segment it was given."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pool.segment import SegmentError
from kvtier.pool.shm_index import MAX_LOAD, ShmIndexReader, ShmIndexWriter, segment_name

from .kit import chain


@pytest.fixture
def table():
    w = ShmIndexWriter(segment_name(), 2000)
    r = ShmIndexReader(w.name)
    yield w, r
    r.close()
    w.close()


def linear_prefix(ready: set, keys: list) -> int:
    n = 0
    while n < len(keys) and keys[n] in ready:
        n += 1
    return n


def test_reader_answers_the_longest_ready_prefix_through_any_history(table):
    """Random adds and removals (tombstones, re-adds, rehashes): every answer
    equals the linear walk over the writer's ready set."""
    w, r = table
    rng = random.Random(3)
    pool = [chain(f"t{i}", 40) for i in range(30)]
    ready: set = set()
    for _ in range(400):
        c = rng.choice(pool)
        if rng.random() < 0.6:
            part = c[: rng.randint(1, 40)]
            if len(ready | set(part)) <= 1500:
                w.add(part)
                ready |= set(part)
        else:
            part = c[rng.randint(0, 39):]
            w.remove(part)
            ready -= set(part)
        probe = rng.choice(pool)[: rng.randint(0, 40)]
        assert r.ready_prefix(probe) == linear_prefix(ready, probe)
        assert r.ready_prefix(b"".join(probe)) == linear_prefix(ready, probe)  # packed form too
    assert not w.overflowed


def test_an_overflowed_table_sends_readers_to_the_daemon(table):
    w, r = table
    w.add(chain("a", 10))
    assert r.ready_prefix(chain("a", 10)) == 10
    w.add(chain("big", int(MAX_LOAD * w.t.capacity)))  # more than the table may hold
    assert w.overflowed and r.ready_prefix(chain("a", 10)) is None
    w.clear()  # the daemon rebuilds (bigger, in practice) and serves again
    assert r.ready_prefix(chain("a", 10)) == 0


def test_the_reader_cannot_write_the_table(table):
    w, r = table
    w.add(chain("a", 4))
    with pytest.raises(ValueError):
        r.t.state[:] = 0
    assert r.ready_prefix(chain("a", 4)) == 4


def test_a_segment_opens_only_by_its_exact_unguessable_name(table):
    w, _ = table
    assert len(w.name) > 30  # a 128-bit token
    with pytest.raises(SegmentError):
        ShmIndexReader(w.name[:-1] + ("0" if w.name[-1] != "0" else "1"))


def _flip(name: str, rounds: int, out) -> None:
    """Writer: the chain is alternately 80 and 20 blocks ready; the removals
    leave tombstones, so every few rounds an add rebuilds the whole table
    (each change is one write section: readers may only see 20 or 80)."""
    w_keys = chain("flip", 80)
    # Reopen the writer's table in this process: the test process owns the segment.
    from kvtier.pool.shm_index import _Table
    from kvtier.pool.segment import ShmSegment
    seg = ShmSegment(name)
    t = _Table(seg.buffer, seg.size, name)
    writer = ShmIndexWriter.__new__(ShmIndexWriter)
    writer.t, writer.segment, writer.name, writer.small = t, seg, name, 64
    writer._bind()
    for i in range(rounds):
        writer.remove(w_keys[20:])
        writer.add(w_keys[20:])
    out.put(writer.t.header.tolist())
    writer._unbind()
    t.close()
    del writer
    seg.release(unlink=False)


def test_readers_never_see_a_torn_table_while_the_writer_changes_it():
    """Under a writer process flipping the chain between two states (with
    rebuilds that empty and refill the table inside one change), every answer
    a reader gets is one of the two states: the seqlock turns torn reads into
    retries."""
    w = ShmIndexWriter(segment_name(), 100)  # small: tombstones force rebuilds often
    w.add(chain("flip", 80))
    r = ShmIndexReader(w.name)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_flip, args=(w.name, 3000, out))
    p.start()
    try:
        seen, gave_up = set(), 0
        keys = chain("flip", 80)
        while out.empty() and p.is_alive():  # a writer that died ends the test, not hangs it
            n = r.ready_prefix(keys)
            if n is None:
                gave_up += 1
            else:
                seen.add(n)
        header = out.get(timeout=60)
        assert seen <= {20, 80}, f"torn reads: {sorted(seen)}"
        assert seen, "the reader never got an answer"
        assert header[2] >= 2 * 2 * 3000  # seq: every change was one odd/even write section
    finally:
        p.join(60)
        r.close()
        w.close()
    assert p.exitcode == 0


def colliding(n: int, buckets: int, home: int = 3) -> list[bytes]:
    """``n`` digests whose first 8 bytes all pick bucket ``home`` of ``buckets``."""
    return [((home + buckets * (i + 1)).to_bytes(8, "little") + (i + 1).to_bytes(8, "little")) for i in range(n)]


def test_a_key_the_writer_keeps_is_one_a_reader_finds_and_the_writer_removes():
    """Hostile keys that all share one home bucket: the ninth bucket's worth
    used to land one bucket past the probe window (never found, never
    removed). Now every key either is found and can be removed, or the table
    overflows and readers ask the daemon."""
    w = ShmIndexWriter(segment_name(), 64)  # 256 slots in 32 buckets of 8
    r = ShmIndexReader(w.name)
    try:
        buckets = w.t.capacity // 8
        keys = colliding(8 * 8, buckets)  # exactly the probe window: all found
        w.add(keys)
        assert not w.overflowed
        assert all(r.ready_prefix([k]) == 1 for k in keys)
        w.remove(keys[:8])
        assert all(r.ready_prefix([k]) == 0 for k in keys[:8])
        w.add(keys[:8])
        extra = colliding(8 * 8 + 1, buckets)[-1]  # one more: its place would be past the window
        w.add([extra])
        assert w.overflowed and r.ready_prefix([extra]) is None
    finally:
        r.close()
        w.close()


def assert_tombstones_only_in_full_buckets(w) -> None:
    """What lets a removal skip its tombstone: one lives only in a bucket with no empty slot
    (probes stop at a bucket with one), and the header counts every one of them."""
    rows = w.t.state_rows
    tombs = (rows == 2).any(1)  # TOMB
    assert not (tombs & (rows == 0).any(1)).any()  # EMPTY
    assert int(w.t.header[4]) == int((rows == 2).sum())  # TOMB_W


@pytest.mark.parametrize("small", [0, 10**6], ids=["vectorized", "key-by-key"])
def test_a_removal_leaves_a_tombstone_only_where_a_probe_may_have_passed(small):
    """Eight keys fill their home bucket and four spill into the next. Removing a spilled
    one (its bucket has empty slots: no probe ever went past it) leaves an empty slot;
    removing one of the full bucket leaves a tombstone, which the spilled keys' lookups
    still probe past, and which the next add of that bucket takes. Under churn at a
    steady ready set tombstones stay rare, so the table is seldom rehashed."""
    w = ShmIndexWriter(segment_name(), 64)  # 256 slots in 32 buckets of 8
    w.small = small
    r = ShmIndexReader(w.name)
    try:
        keys = colliding(12, w.t.capacity // 8)
        w.add(keys)
        w.remove([keys[9]])  # spilled into bucket 4, which has empty slots
        assert int(w.t.header[4]) == 0 and int(w.t.header[3]) == 11
        w.remove([keys[2]])  # from the full home bucket
        assert int(w.t.header[4]) == 1
        assert_tombstones_only_in_full_buckets(w)
        assert [r.ready_prefix([k]) for k in keys] == [0 if i in (2, 9) else 1 for i in range(12)]
        w.add([keys[2]])  # back into its tombstone
        assert int(w.t.header[4]) == 0 and all(r.ready_prefix([k]) == 1 for k in keys if k != keys[9])

        rehashes = 0
        rehash = w._rehash
        def counted():
            nonlocal rehashes
            rehashes += 1
            rehash()
        w._rehash = counted
        rng, live = random.Random(5), list(keys)
        live.remove(keys[9])
        for i in range(3000):  # ~100 ready keys of 256 slots, one in, one out
            new = i.to_bytes(8, "little") + b"churn..."
            w.add([new])
            live.append(new)
            w.remove([live.pop(rng.randrange(len(live)))])
            assert_tombstones_only_in_full_buckets(w)
        assert all(r.ready_prefix([k]) == 1 for k in live) and int(w.t.header[3]) == len(live)
        assert rehashes <= 3  # with a tombstone per removal: one every ~90 removals, ~33
    finally:
        r.close()
        w.close()


def test_a_reader_on_a_cpu_without_x86_ordering_refuses_to_map_the_table(table):
    """The seqlock has no fences: only x86's store and load ordering makes it
    safe. Elsewhere the reader refuses (the client then asks the daemon)."""
    w, _ = table
    from kvtier.pool.shm_index import seqlock_safe
    for machine in ("aarch64", "ppc64le", "riscv64"):
        assert not seqlock_safe(machine)
        with pytest.raises(SegmentError, match="x86"):
            ShmIndexReader(w.name, machine=machine)
    assert seqlock_safe("x86_64") and seqlock_safe("AMD64")


def test_hashes_sharing_their_first_eight_bytes_are_all_found():
    """Synthetic digests alike in their first 8 bytes land in one bucket and spill over;
    each is still found (all 16 bytes compared), and the ready prefix is whole."""
    from kvtier.pool.shm_index import ShmIndexReader, ShmIndexWriter, segment_name
    w = ShmIndexWriter(segment_name(), 256)
    try:
        same = [bytes(8) + bytes([k]) * 8 for k in range(32)]
        w.add(same)
        w.add(same[:3])  # already there: not added twice
        r = ShmIndexReader(w.name)
        assert r.ready_prefix(b"".join(same)) == 32
        assert r.ready_prefix(b"".join(same[:8] + [bytes(8) + b"\xee" * 8])) == 8
        w.remove(same[5:6])
        assert r.ready_prefix(b"".join(same)) == 5
        r.close()
    finally:
        w.close()


def test_a_table_that_asks_on_a_miss_answers_whole_hits_only():
    """With a remote tier below (not mirrored), a partial prefix is the daemon's to answer."""
    from kvtier.pool.shm_index import ShmIndexReader, ShmIndexWriter, segment_name
    w = ShmIndexWriter(segment_name(), 256, ask_on_miss=True)
    try:
        hs = [bytes([k]) * 16 for k in range(1, 9)]
        w.add(hs[:4])
        r = ShmIndexReader(w.name)
        assert r.ready_prefix(b"".join(hs[:4])) == 4
        assert r.ready_prefix(b"".join(hs)) is None  # ask the daemon
        w.clear()  # a flush keeps the flag
        assert r.ready_prefix(b"".join(hs[:1])) is None
        r.close()
    finally:
        w.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 29), st.integers(0, 39), st.integers(1, 40)),
                max_size=120))
def test_small_writes_key_by_key_and_large_vectorized_ones_keep_the_same_table(ops):
    """A store's commit or an eviction pass changes a few keys: those go key by key in
    plain Python (``SMALL_WRITE``), a table's first fill vectorized. Either way, through
    tombstones, re-adds and rehashes, a reader's answers and the counts are the same as
    the ready set's, and readers of both tables agree."""
    pool = [chain(f"p{i}", 80) for i in range(30)]
    ws = [ShmIndexWriter(segment_name(), 600) for _ in range(2)]
    ws[0].small, ws[1].small = 0, 10**6  # always vectorized / always key by key
    rs = [ShmIndexReader(w.name) for w in ws]
    ready: set = set()
    try:
        for add, c, at, n in ops:
            part = pool[c][at:at + n]
            if add and len(ready | set(part)) > 1000:
                continue
            for w in ws:
                (w.add if add else w.remove)(part)
            ready = ready | set(part) if add else ready - set(part)
            probe = pool[(c * 7) % 30][: (at + n) % 80]
            want = linear_prefix(ready, probe)
            assert [r.ready_prefix(probe) for r in rs] == [want, want]
            assert [int(w.t.header[3]) for w in ws] == [len(ready)] * 2  # COUNT_W
            for w in ws:
                assert_tombstones_only_in_full_buckets(w)
        assert all(r.ready_prefix(k) == 1 for k in ready for r in rs)
    finally:
        for x in rs + ws:
            x.close()
