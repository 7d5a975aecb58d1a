"""The disk tier's sans-IO parts: the file header refuses anything that is not
exactly the block it claims to be, and the in-memory index never exceeds its
capacity, drops the oldest first and keeps the newer of two copies."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvtier.disk.format import (_FIXED, FORMAT_VERSION, HEADER_BYTES, MAGIC, block_name, decode_header,
                                encode_header, file_bytes, parse_name)
from kvtier.disk.index import DiskEntry, DiskIndex
from kvtier.pool import checksum
from kvtier.pool.keys import SEP, ns_key

KEY = bytes(range(16))
NS_KEY = ns_key("uid0", "model|fp16")


def test_a_header_round_trips_and_every_damage_is_named():
    h = encode_header(NS_KEY, KEY, 7, 1 << 20, 0xDEADBEEF)
    assert len(h) == HEADER_BYTES
    got = decode_header(h)
    assert (got.ns_key, got.key, got.seq, got.size, got.crc) == (NS_KEY, KEY, 7, 1 << 20, 0xDEADBEEF)
    assert decode_header(h[:100]) == "truncated header"
    assert decode_header(b"X" + h[1:]) == "not a kvtier block file"
    newer = bytearray(h)
    struct.pack_into("<H", newer, 8, FORMAT_VERSION + 1)
    assert "format version" in decode_header(bytes(newer))
    for at in (20, 40, 60, 70):  # any byte of the fields, the key or the namespace
        bad = bytearray(h)
        bad[at] ^= 1
        assert isinstance(decode_header(bytes(bad)), str), at


def test_a_format_1_header_is_read_with_its_crc32_tagged_and_a_crc32_is_never_written():
    fp = NS_KEY.encode()
    body = _FIXED.pack(MAGIC, 1, len(KEY), len(fp), 0, 7, 4096, 0xDEADBEEF) + KEY + fp
    body += struct.pack("<I", zlib.crc32(body))
    got = decode_header(body + bytes(HEADER_BYTES - len(body)))  # as a daemon of format 1 wrote it
    assert got.crc == checksum.legacy(0xDEADBEEF) and checksum.is_legacy(got.crc)
    assert not checksum.is_legacy(decode_header(encode_header(NS_KEY, KEY, 7, 4096, 0xDEADBEEF)).crc)
    with pytest.raises(ValueError):
        encode_header(NS_KEY, KEY, 7, 4096, got.crc)


def test_file_names_parse_back_and_others_are_refused():
    assert parse_name(block_name(KEY, 0x1234)) == (KEY, 0x1234)
    for name in ("x.kvb", KEY.hex() + ".kvb", KEY.hex() + "-12.kvb", KEY.hex().upper() + "-" + "0" * 16 + ".kvb",
                 block_name(KEY, 1) + ".tmp"):
        assert parse_name(name) is None, name


def entry(ns, k, seq, size=100):
    return DiskEntry(ns, bytes([k]) * 16, seq, size, 0, f"/{ns}/{k}-{seq}")


def test_the_oldest_go_first_and_the_newer_copy_of_a_block_stays():
    idx = DiskIndex(capacity=3 * file_bytes(100))
    for k in range(3):
        assert idx.add(entry("a", k, seq=k)) == []
    victims = idx.reserve(file_bytes(100))
    assert [v.key[0] for v in victims] == [0]  # the oldest
    idx.release(file_bytes(100))
    assert idx.add(entry("a", 3, seq=3)) == []
    older = entry("a", 3, seq=1)
    assert idx.add(older) == [older]  # a stale copy found by the scan loses
    idx.touch(idx.entries_of("a")[bytes([1]) * 16])  # read back: young again
    assert [v.key[0] for v in idx.reserve(2 * (file_bytes(100)))] == [2, 3]
    assert idx.reserve(10 * HEADER_BYTES) is None  # can never fit
    idx.check_integrity()


def test_the_scan_finding_a_file_the_index_already_holds_leaves_it_be():
    # The start-up scan lists directories while this daemon writes: a file written (and
    # indexed) before the scan reached it is found again, same name, same seq. It is the copy
    # the index holds, not a stale one to delete (it was returned for unlinking).
    idx = DiskIndex(capacity=3 * file_bytes(100))
    held = entry("a", 1, seq=5)
    assert idx.add(held) == []
    again = DiskEntry(held.ns_key, held.key, held.seq, held.size, held.crc, held.path)
    assert idx.add(again, found=True) == []
    assert idx.entries_of("a")[held.key] is held and len(idx) == 1
    idx.check_integrity()


def test_room_made_from_a_flushs_last_hidden_files_ends_that_flushs_part_at_once():
    # Making room may take a flush's hidden entries (they still take space). When it takes the
    # last of a namespace's, the flush holds nothing of it any more: ``hiding`` says so at once,
    # so the eviction's unlink may remove the namespace's directory (it used to wait for a drain
    # that then freed nothing and asked for no directory).
    idx = DiskIndex(capacity=2 * file_bytes(100))
    idx.add(entry("a", 1, seq=1))
    idx.add(entry("b", 2, seq=2))
    job = idx.hide(["a"])
    assert idx.hiding("a") and not job.done
    victims = idx.reserve(file_bytes(100))
    assert [v.ns_key for v in victims] == ["a"]
    assert not idx.hiding("a") and job.done and idx.hidden == 0
    assert idx.drain(10) == [] and not idx.flushes
    idx.release(file_bytes(100))
    idx.check_integrity()


def ident(entries) -> list:
    return [(e.ns_key, e.key, e.seq) for e in entries]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)),
                                                      min_size=1, max_size=6)), max_size=12),
       st.lists(st.integers(0, 40), max_size=5))
def test_a_write_job_added_at_once_leaves_the_index_one_add_per_file_leaves(jobs, found):
    """add_written (a write job's files, bookkept once) against add per file: the same copies
    dropped, then the same least recently used order, the same bytes. Found files first
    (the scan), so some of a job's blocks have another copy already, older or newer."""
    one, many = DiskIndex(capacity=10**9), DiskIndex(capacity=10**9)
    for k in found:
        for idx in (one, many):
            idx.add(entry("ns0", k % 10, seq=k), found=True)
    for ns, files in jobs:
        files = list({k: (k, seq) for k, seq in files}.values())  # one job names a block once
        dropped_one = [v for k, seq in files for v in one.add(entry(f"ns{ns}", k, 50 + seq), limit=0)]
        dropped_many = many.add_written(f"ns{ns}", [entry(f"ns{ns}", k, 50 + seq) for k, seq in files])
        assert sorted(ident(dropped_many)) == sorted(ident(dropped_one))
        one.check_integrity()
        many.check_integrity()
    assert (one.used, len(one), dict(one.ns_bytes)) == (many.used, len(many), dict(many.ns_bytes))
    assert one.ns_newest == many.ns_newest
    for idx in (one, many):
        idx.capacity = 0
    assert ident(one.shrink()) == ident(many.shrink())  # everything, least recently used first


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "reserve", "drop", "touch", "hide", "drain"]),
                          st.integers(0, 20), st.integers(0, 3)), max_size=80))
def test_random_operations_keep_the_index_within_capacity(ops):
    """Flushes in progress included: hidden entries are seen by no reader, still count
    for space until drained, and making room may take them first."""
    idx = DiskIndex(capacity=6 * file_bytes(100))
    seq, held, hidden, freed = 0, 0, set(), set()
    for op, k, ns in ops:
        seq += 1
        if op == "add":
            freed |= set(idx.add(entry(f"ns{ns}", k, seq)))  # room made (a hidden entry, maybe)
        elif op == "reserve":
            victims = idx.reserve(file_bytes(100))
            if victims is not None:
                held += file_bytes(100)
                freed |= set(victims)
        elif op == "drop":
            visible = set(idx.entries_of(f"ns{ns}").values()) if idx.entries_of(f"ns{ns}") else set()
            assert set(idx.drop([f"ns{ns}"])) == visible  # that namespace's, at once
            freed |= visible
        elif op == "touch" and idx.entries_of(f"ns{ns}"):
            idx.touch(next(iter(idx.entries_of(f"ns{ns}").values())))
        elif op == "hide":
            job = idx.hide([f"ns{ns}"])
            hidden |= {e for _, h in job.parts for e in h.values()}
            assert idx.entries_of(f"ns{ns}") is None and not idx.has_namespace(f"ns{ns}")
        elif op == "drain":
            out = idx.drain(k % 5 + 1)
            assert len(out) <= k % 5 + 1 and {e for _, e in out} <= hidden - freed
            freed |= {e for _, e in out}
        visible = {e for v in idx.namespaces.values() for e in v.values()}
        assert not visible & hidden and len(idx) == len(visible)
        idx.check_integrity()
    while idx.flushes:  # every hidden entry is freed exactly once, by a drain or for room
        freed |= {e for _, e in idx.drain(3)}
    assert hidden <= freed and idx.hidden == 0
    idx.release(held)
    idx.check_integrity()


@given(st.permutations(list(range(12))))
def test_files_found_in_any_order_are_dropped_oldest_first(seqs):
    """The scan finds files in directory order; what exceeds the capacity goes by write order."""
    idx = DiskIndex(capacity=5 * file_bytes(100))
    for s in seqs:
        assert idx.add(entry("a", s, seq=s), found=True) == []
    idx.check_integrity(fitted=False)
    assert [v.seq for v in idx.shrink()] == list(range(7))
    idx.check_integrity()


def test_a_large_excess_is_dropped_in_slices_oldest_first_and_never_more_than_asked():
    """The loop drops at most ``limit`` entries per turn; ``over`` says another slice is due."""
    idx = DiskIndex(capacity=5 * file_bytes(100))
    for s in range(12):
        idx.add(entry("a", s, seq=s), found=True)
    slices = []
    while idx.over:
        slices.append([v.seq for v in idx.shrink(3)])
    assert slices == [[0, 1, 2], [3, 4, 5], [6]]
    idx.check_integrity()
    assert idx.reserve(file_bytes(100), limit=0) == [] and idx.over  # room made by a later slice
    assert [v.seq for v in idx.shrink(3)] == [7] and not idx.over


def test_a_use_keeps_a_file_and_the_least_recently_used_goes_first():
    """Written a, b, c; then a is used (a load or a lookup hit): room for one more drops b."""
    idx = DiskIndex(capacity=3 * file_bytes(100))
    a, b, c = (entry("n", k, seq=k) for k in range(3))
    for e in (a, b, c):
        idx.add(e)
    idx.touch(a)
    assert idx.reserve(file_bytes(100)) == [b]
    idx.release(file_bytes(100))
    idx.add(entry("n", 3, seq=3))
    idx.touch(c)
    assert idx.reserve(file_bytes(100)) == [a]  # used before d was written and c used
    idx.check_integrity(fitted=True)


def test_under_fifo_the_disk_drops_files_in_write_order_whatever_was_used():
    """The disk follows the pool's ``policy``: with ``fifo`` a load or a lookup hit
    does not make a file young again, so the first written goes first."""
    idx = DiskIndex(capacity=3 * file_bytes(100), policy="fifo")
    a, b, c = (entry("n", k, seq=k) for k in range(3))
    for e in (a, b, c):
        idx.add(e)
    idx.touch(a)
    assert idx.reserve(file_bytes(100)) == [a]
    idx.release(file_bytes(100))
    idx.add(entry("n", 3, seq=3))
    idx.touch(b)
    assert idx.reserve(file_bytes(100)) == [b]
    idx.check_integrity(fitted=True)


@pytest.mark.parametrize("policy", ["lfu", "", "LRU", None])
def test_a_policy_the_disk_cannot_follow_is_refused_when_the_index_is_built(policy):
    with pytest.raises(ValueError, match="disk order follows policy"):
        DiskIndex(capacity=file_bytes(100), policy=policy)


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "write", "touch", "hide", "drain", "tidy", "tidy"]),
                          st.integers(0, 30), st.integers(0, 3)), min_size=30, max_size=150),
       st.sampled_from([1.0, 0.5]), st.sampled_from([0, 4096]))
def test_a_heap_rebuilt_a_slice_at_a_time_drops_what_an_unrebuilt_one_drops(ops, share, direct_max):
    """The age heap is rebuilt a few items per call (``tidy``) while files are written,
    used, flushed and dropped for room, by two tenants with or without shares: every
    victim, and its order, is the one an index that never rebuilt its heap picks."""
    sliced, whole = (DiskIndex(capacity=8 * file_bytes(100), share=share) for _ in range(2))
    sliced.slack = 0  # rebuilds due at a few stale items, not 64: often, on a small index
    sliced.direct_max = direct_max  # 0: every rebuild goes through the old heap in slices
    rebuilds = 0
    seq = 0
    for op, k, ns in ops:
        seq += 1
        tenant, name = ("alice", "bob")[ns % 2], f"{('alice', 'bob')[ns % 2]}{SEP}m{ns}"
        picked = []
        for idx in (sliced, whole):
            if op == "write":
                victims = idx.reserve(file_bytes(100), None, tenant)
                if victims is not None:
                    victims += idx.add(entry(name, k, seq))
                    idx.release(file_bytes(100), tenant)
                picked.append(None if victims is None else ident(victims))
            elif op == "touch" and idx.entries_of(name):
                idx.touch(idx.entries_of(name)[sorted(idx.entries_of(name))[k % len(idx.entries_of(name))]])
            elif op == "hide":
                idx.hide([name])
            elif op == "drain":
                picked.append(ident(e for _, e in idx.drain(k % 7 + 1)))
            elif op == "tidy" and idx is sliced:
                rebuilds += not idx._old and not idx._dead and idx.tidying
                idx.tidy(k % 5 + 1)
            idx.check_integrity()
        assert picked[:1] == picked[1:]
    assert sorted(ident(e for v in sliced.namespaces.values() for e in v.values())) == \
        sorted(ident(e for v in whole.namespaces.values() for e in v.values()))
    event(f"rebuilds begun: {min(rebuilds, 3)}+")


@pytest.mark.parametrize("kept", [1, 6000])  # few live entries (a heap of them made at once), or many
def test_the_stale_items_a_flush_leaves_go_a_bounded_slice_per_call(kept):
    """A flush of 20,000 files leaves their items in the age heap, stale: the rebuild
    after it goes a bounded number of items per call, never the whole heap in one
    (10^6 items took ~0.5 s so), and the heap ends holding the live entries only,
    which still go oldest first."""
    idx = DiskIndex(capacity=10**6 * file_bytes(100))
    n = 20_000
    for k in range(n):
        idx.add(DiskEntry("a", k.to_bytes(16, "little"), k, 100, 0, f"/a/{k}"))
    for k in range(kept):
        idx.add(DiskEntry("b", k.to_bytes(16, "little"), n + k, 100, 0, f"/b/{k}"))
    idx.hide(["a"])
    assert not idx.tidying  # nothing to rebuild while the flush holds its entries
    while idx.flushes:
        idx.drain(4096)
    assert idx.tidying and idx.heap_items == n + kept

    def held():  # heap items, stale or not, and those of replaced heaps not freed yet
        return idx.heap_items + sum(map(len, idx._dead))
    calls = 0
    while idx.tidying:
        before = held()
        idx.tidy(256)
        assert before - held() <= 256
        calls += 1
        idx.check_integrity()
    assert calls >= n // 256 and held() == idx.heap_items == kept
    drop = min(3, kept)
    idx.capacity = (kept - drop) * file_bytes(100)
    assert ident(idx.shrink()) == ident(DiskEntry("b", k.to_bytes(16, "little"), n + k, 100, 0, "")
                                        for k in range(drop))
