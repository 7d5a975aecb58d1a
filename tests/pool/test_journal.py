"""The warm-restart journal (pool/journal.py) over plain memory: a writer
stopped after any byte of any update leaves records a reader adopts exactly
as committed or refuses, and never one naming another namespace."""

from __future__ import annotations

import os

import pytest

from kvtier.pool import checksum
from kvtier.pool import journal as jn
from kvtier.pool.allocator import SlabAllocator
from kvtier.pool.index import BlockIndex
from kvtier.pool.journal import Journal, journal_bytes
from kvtier.pool.keys import ns_key

POOL, SLAB = 64 * 2**20, 4 * 2**20
A, B = ns_key("uid0", "model-a"), ns_key("uid1000", "model-a")  # same fingerprint, two tenants
Z = ns_key("uid5", "model-z")


def fresh():
    buf = memoryview(bytearray(journal_bytes(POOL)))
    return buf, Journal.create(buf, POOL, SLAB)


def reopen(buf):
    j, why = Journal.open(buf, POOL, SLAB)
    assert j is not None, why
    return j.scan()


def test_what_is_committed_is_found_with_its_namespace_and_checksum():
    buf, j = fresh()
    keys = [os.urandom(16) for _ in range(10)]
    for i, k in enumerate(keys):
        assert j.commit(A if i % 2 else B, 16384, k, i * 16384, 1000 + i)
    j.remove(0, B)
    kept, rejected = reopen(buf)
    assert rejected == 0
    assert [(k.ns_key, k.key, k.offset, k.crc) for k in kept] == [
        (A if i % 2 else B, keys[i], i * 16384, 1000 + i) for i in range(1, 10)]


def test_a_record_keeps_which_algorithm_its_checksum_is_of_and_an_unknown_one_is_refused():
    buf, j = fresh()
    old, new = checksum.legacy(0xCAFE), checksum.of(b"block")  # an adopted CRC-32, a CRC-32C
    assert j.commit(A, 16384, bytes(16), 0, old) and j.commit(A, 16384, bytes(range(16)), 16384, new)
    assert [k.crc for k in reopen(buf)[0]] == [old, new]
    pos = jn.HEADER_BYTES + jn.NS_SLOTS * jn.NS_SLOT_BYTES  # the first record: algorithm byte 7,
    fields = list(jn._REC.unpack(buf[pos:pos + jn.RECORD_BYTES]))  # its record crc made to match
    fields[8] = 7
    body = jn._REC.pack(0, *fields[1:])[4:]
    buf[pos + 4:pos + jn.RECORD_BYTES] = body
    buf[pos:pos + 4] = jn._crc(body).to_bytes(4, "little")
    kept, rejected = reopen(buf)
    assert [k.crc for k in kept] == [new] and rejected == 1


class Torn(Exception):
    pass


class TornBuffer:
    """A memoryview that dies after ``budget`` bytes were written (a SIGKILL mid-update)."""

    def __init__(self, buf, budget):
        self.buf, self.budget = buf, budget

    def __len__(self):
        return len(self.buf)

    def __getitem__(self, i):
        return self.buf[i]

    def __setitem__(self, i, value):
        value = bytes(value)
        if len(value) > self.budget:
            self.buf[i.start:i.start + self.budget] = value[:self.budget]
            raise Torn
        self.budget -= len(value)
        self.buf[i] = value


def write_cut(update, budget):
    """Run ``update(journal)`` on a journal whose writes stop after ``budget`` bytes."""
    buf, j = fresh()
    j.commit(A, 16384, b"k" * 16, 0, 7)          # a committed block that must survive
    j.commit(B, 16384, b"old-block-B-0000", 16384, 8)
    whole = bytearray(buf)
    real = j.buf
    j.buf = TornBuffer(real, budget)
    _patch_pack(j)
    try:
        update(j)
        finished = True
    except Torn:
        finished = False
    return buf, whole, finished


def _patch_pack(j):
    # struct.pack_into writes straight into the buffer: route it through the torn one.
    import struct

    def pack_into(fmt, buf, pos, *vals):
        data = struct.pack(fmt, *vals)
        buf[pos:pos + len(data)] = data
    jn.struct.pack_into = pack_into


@pytest.fixture(autouse=True)
def _restore_pack():
    import struct
    real = struct.pack_into
    yield
    jn.struct.pack_into = real


@pytest.mark.parametrize("update", ["commit", "commit-new-namespace", "remove", "remove-last-of-namespace"])
def test_a_kill_after_any_byte_of_an_update_leaves_old_or_new_never_torn(update):
    ops = {
        "commit": lambda j: j.commit(A, 16384, b"n" * 16, 32768, 9),
        "commit-new-namespace": lambda j: j.commit(Z, 16384, b"z" * 16, 32768, 9),
        "remove": lambda j: j.remove(0, A),
        "remove-last-of-namespace": lambda j: j.remove(16384, B),
    }
    before = {(A, b"k" * 16, 0, 7), (B, b"old-block-B-0000", 16384, 8)}
    after = {"commit": before | {(A, b"n" * 16, 32768, 9)},
             "commit-new-namespace": before | {(Z, b"z" * 16, 32768, 9)},
             "remove": before - {(A, b"k" * 16, 0, 7)},
             "remove-last-of-namespace": before - {(B, b"old-block-B-0000", 16384, 8)}}[update]
    seen = set()
    for budget in range(0, 4200):
        buf, _, finished = write_cut(ops[update], budget)
        kept, _ = reopen(buf)
        got = {(k.ns_key, k.key, k.offset, k.crc) for k in kept}
        assert got in (before, after), f"cut after {budget} bytes: {got}"
        seen.add(frozenset(got))
        if finished:
            break
    assert finished and len(seen) == 2  # both outcomes occur: the cut points were really hit


def test_a_forged_record_naming_a_rewritten_namespace_slot_is_refused():
    buf, j = fresh()
    base = jn.HEADER_BYTES + jn.NS_SLOTS * jn.NS_SLOT_BYTES
    j.commit(A, 16384, b"a" * 16, 0, 1)
    old_record = bytes(buf[base:base + jn.RECORD_BYTES])
    j.remove(0, A)                      # A's namespace slot is free now
    j.commit(B, 16384, b"b" * 16, 0, 2)  # B takes it, with a new tag
    # A's old record comes back in another slot (a stale copy): it names slot 0, now B's.
    buf[base + 5 * jn.RECORD_BYTES:base + 6 * jn.RECORD_BYTES] = old_record
    kept, rejected = reopen(buf)
    assert [(k.ns_key, k.key) for k in kept] == [(B, b"b" * 16)] and rejected == 1


def test_adoption_rebuilds_the_index_and_refuses_overlapping_or_misaligned_blocks():
    buf, j = fresh()
    j.commit(A, 16384, b"1" * 16, 0, 1)
    j.commit(A, 16384, b"2" * 16, 16384, 2)
    j.commit(A, 16384, b"3" * 16, 16384 + 256, 3)   # misaligned for its class
    j.commit(B, 32768, b"4" * 16, 16384 * 2, 4)      # another class inside A's slab
    index = BlockIndex(SlabAllocator(POOL, SLAB))
    kept, _ = reopen(buf)
    taken = 0
    for ns_key in (A, B):
        mine = [k for k in kept if k.ns_key == ns_key]
        ns = index.namespace(ns_key, mine[0].block_bytes)
        taken += sum(e is not None for e in index.adopt(ns, [(k.key, k.offset) for k in mine]))
    assert taken == 2
    index.check_integrity()
    ns = index.namespaces[A]
    assert index.lookup(ns, [b"1" * 16, b"2" * 16]) == 2
    assert index.prepare_store(ns, [b"x" * 16]).entries[0].offset == 2 * 16384  # next free slot


@pytest.mark.parametrize("field, value, why", [(0, b"NOTKVTIR", "no kvtier header"),
                                               (8, (2).to_bytes(4, "little"), "format v2"),
                                               (20, b"\x01", "header is damaged")])
def test_a_foreign_newer_or_damaged_header_is_never_read(field, value, why):
    buf, _ = fresh()
    buf[field:field + len(value)] = value
    j, reason = Journal.open(buf, POOL, SLAB)
    assert j is None and why in reason


def test_a_pool_of_4_kib_blocks_is_kept_whole_and_an_earlier_journal_still_opens(monkeypatch):
    """One record per 4 KiB of pool: every block of a full pool of 4 KiB blocks gets one
    (at 16 KiB a warm restart kept a quarter of them). Freed records are reused first and
    the never-used ones stay untouched. A journal an earlier daemon made with one record
    per 16 KiB is read with the count its header gives, so an upgrade restarts warm."""
    buf, j = fresh()
    n = POOL // 4096
    assert j.records == n
    keys = [i.to_bytes(16, "little") for i in range(n)]
    assert all(j.commit(A, 4096, k, i * 4096, i) for i, k in enumerate(keys))
    assert not j.commit(A, 4096, os.urandom(16), POOL, 0) and j.full == 1  # no record left
    j.remove(5 * 4096, A)
    assert j.commit(A, 4096, os.urandom(16), 5 * 4096, 7)  # the freed record again
    kept, rejected = reopen(buf)
    assert (len(kept), rejected) == (n, 0)

    monkeypatch.setattr(jn, "BYTES_PER_RECORD", 16 * 1024)  # the earlier daemon's geometry
    old = memoryview(bytearray(journal_bytes(POOL)))
    j = Journal.create(old, POOL, SLAB)
    assert j.commit(B, 16384, keys[0], 0, 1)
    monkeypatch.undo()
    again, why = Journal.open(old, POOL, SLAB)
    assert why == "" and again.records == POOL // 16384
    kept, _ = again.scan()
    again.keep(kept)
    assert [k.key for k in kept] == [keys[0]] and again.commit(B, 16384, keys[1], 16384, 2)
    assert Journal.open(old[:-64], POOL, SLAB)[1] == "the journal's geometry does not match this daemon's"
