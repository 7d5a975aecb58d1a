"""The warm-restart journal: a record per committed block, in shared memory.

The pool segment outlives the daemon when ``warm_restart`` is on; this
journal (a second segment beside it) says which of its bytes are committed
blocks, of which namespace, so the next daemon can adopt them. It is written
by the daemon's loop only, with no fsync (it is shared memory: it survives
the process, not the node).

Crash safety. A SIGKILL can stop the writer between any two stores, so every
record is self-validating and written in an order that makes every
intermediate state either invalid or complete:
  * a slot is claimed only when its record's first word (crc) is zero;
  * commit: the body (namespace slot + tag, generation, offset, size, data
    checksum and its algorithm, block hash) is written, then the crc over
    the body - last;
  * remove: the crc word is zeroed first (the record is dead from then on),
    then the body.
A reader accepts a record only when its crc matches, its generation is
non-zero, its namespace slot is valid with the same tag and block size, and
the block lies inside the pool. A block's record is written only after its
bytes are in the pool (the store's copy has returned), and removed before
its slot is freed, so a store in flight at death has no record.

Namespace slots hold the full namespace key (tenant SEP fingerprint) and a
random tag that each block record repeats: a slot rewritten for another
namespace never adopts the old namespace's records.

Per-tenant cap. The records and namespace slots are one table for every
tenant: one tenant storing many small blocks (16,384 of 256 B fill a 64 MiB
pool's journal) left nothing for the others' blocks. With ``cap_tenants(share)``
a tenant (the owner in the namespace key) holds at most ``share`` of the
records and of the namespace slots; past that its blocks are served but not
kept (counted in ``full``, like a full journal).

Layout (little-endian): a 4 KiB header (magic, format version, header crc,
pool size, slab size, record count, namespace slots, creation time), then
``NS_SLOTS`` namespace slots of ``NS_SLOT_BYTES``, then 64-byte records.

Primitives: ``journal_bytes(pool_size)``, ``Journal.create(buf, pool_size, slab_size)``,
``Journal.open(buf, pool_size, slab_size) -> (Journal | None, why)``, ``.scan() -> ([Kept], rejected)``,
``.keep(kept)``, ``.cap_tenants(share)``, ``.commit(ns_key, block_bytes, key, offset, crc) -> bool``,
``.remove(offset, ns_key)``.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np

from . import checksum
from .keys import owner_of

MAGIC = b"KVTWARM\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
NS_SLOTS = 1024
NS_SLOT_BYTES = 2048
RECORD_BYTES = 64
# One record per 4 KiB of pool, so a pool of 4 KiB blocks is kept whole (at 16 KiB a warm restart
# kept 524,288 of 2,097,152 such blocks: docs/SCALE.md): 1.6% of the pool in /dev/shm. Blocks
# under 4 KiB may find it full (served, not kept: ``full``). A journal made by an earlier daemon
# is read with the record count its header gives.
BYTES_PER_RECORD = 4 * 2**10
MIN_RECORDS = 4096

_HEAD = struct.Struct("<8sII")                # magic, version, crc of the fields below
_FIELDS = struct.Struct("<QQQQd")             # pool size, slab size, records, ns slots, created
_NS = struct.Struct("<IIQI")                  # crc, key length, tag, block bytes; key bytes follow
# crc, ns slot, generation, offset, size, data checksum, hash, ns tag, its algorithm: 1 CRC-32C, 0 a CRC-32
# (a record of an earlier daemon: the byte was padding, so zero; pool/checksum.py keeps it tagged)
_REC = struct.Struct("<IIQQII16sQB7x")
MAX_NS_KEY = NS_SLOT_BYTES - _NS.size
assert _REC.size == RECORD_BYTES


def record_count(pool_size: int) -> int:
    return max(MIN_RECORDS, pool_size // BYTES_PER_RECORD)


def journal_bytes(pool_size: int) -> int:
    return _bytes_for(record_count(pool_size))


def _bytes_for(records: int) -> int:
    return HEADER_BYTES + NS_SLOTS * NS_SLOT_BYTES + records * RECORD_BYTES


@dataclass
class Kept:
    """A valid record found by ``scan``: a block the last daemon committed."""
    rec: int
    ns_key: str
    block_bytes: int
    key: bytes
    offset: int
    crc: int       # the block's checksum as pool/checksum.py keeps it
    gen: int


class Journal:
    def __init__(self, buf: memoryview, pool_size: int, slab_size: int, created: float,
                 records: int | None = None):
        self.buf, self.pool_size, self.slab_size, self.created = buf, pool_size, slab_size, created
        self.records = records if records is not None else record_count(pool_size)
        self._rec_base = HEADER_BYTES + NS_SLOTS * NS_SLOT_BYTES
        # Free record slots: every one from ``_fresh`` on was never used, the rest freed ones
        # (a list of all 2M slots of an 8 GiB pool took ~70 MB of daemon heap).
        self._fresh, self._reuse = 0, []
        self._rec_of: dict[int, int] = {}                   # pool offset -> record slot
        self._ns: dict[str, list] = {}                      # ns key -> [slot, tag, block bytes, records]
        self._free_ns = list(range(NS_SLOTS - 1, -1, -1))
        self._gen = 1
        self.full = 0  # commits that found no free record (the block is served, not kept)
        self.tenant_records, self.tenant_slots = self.records, NS_SLOTS  # cap_tenants lowers them
        self._owner_records: dict[str, int] = {}  # tenant -> records it holds
        self._owner_slots: dict[str, int] = {}    # tenant -> namespace slots it holds

    # ---- open ----------------------------------------------------------------------
    @classmethod
    def create(cls, buf: memoryview, pool_size: int, slab_size: int) -> "Journal":
        """A fresh journal over zeroed memory (a new segment)."""
        if len(buf) < journal_bytes(pool_size):
            raise ValueError("journal buffer too small")
        created = time.time()
        fields = _FIELDS.pack(pool_size, slab_size, record_count(pool_size), NS_SLOTS, created)
        buf[_HEAD.size:_HEAD.size + len(fields)] = fields
        _HEAD.pack_into(buf, 0, MAGIC, FORMAT_VERSION, zlib.crc32(fields))  # last: a torn header is refused
        return cls(buf, pool_size, slab_size, created)

    @classmethod
    def open(cls, buf: memoryview, pool_size: int, slab_size: int) -> tuple["Journal | None", str]:
        """The journal in ``buf`` if it describes a pool of these settings, else (None, why)."""
        if len(buf) < HEADER_BYTES:
            return None, "the journal is truncated"
        magic, version, crc = _HEAD.unpack_from(buf, 0)
        if magic != MAGIC:
            return None, "the journal has no kvtier header"
        if version != FORMAT_VERSION:
            # Versions a later daemon knows how to read are converted here; others start cold.
            return None, f"the journal is format v{version}, this daemon reads v{FORMAT_VERSION}"
        fields = bytes(buf[_HEAD.size:_HEAD.size + _FIELDS.size])
        if zlib.crc32(fields) != crc:
            return None, "the journal header is damaged"
        k_pool, k_slab, records, slots, created = _FIELDS.unpack(fields)
        if k_pool != pool_size:
            return None, f"pool_size changed ({k_pool} -> {pool_size} bytes)"
        if k_slab != slab_size:
            return None, f"slab_size changed ({k_slab} -> {slab_size} bytes)"
        if records < MIN_RECORDS or slots != NS_SLOTS or len(buf) != _bytes_for(records):
            return None, "the journal's geometry does not match this daemon's"
        return cls(buf, pool_size, slab_size, created, records), ""

    # ---- adoption ------------------------------------------------------------------
    def scan(self) -> tuple[list[Kept], int]:
        """Every valid record (oldest generation first) and how many non-empty
        records were refused (torn, misattributed, out of range)."""
        spaces, kept, rejected = {}, [], 0
        for slot in range(NS_SLOTS):
            got = self._read_ns(slot)
            if got is not None:
                spaces[slot] = got
        for rec in self._used_records():
            pos = self._rec_base + rec * RECORD_BYTES
            raw = self.buf[pos:pos + RECORD_BYTES]
            crc, slot, gen, offset, size, dcrc, key, tag, algo = _REC.unpack(raw)
            ns = spaces.get(slot)
            if (crc != _crc(raw[4:]) or gen == 0 or algo > 1 or ns is None or ns[1] != tag or ns[2] != size
                    or size <= 0 or offset < 0 or offset + size > self.pool_size):
                rejected += 1
                continue
            kept.append(Kept(rec, ns[0], size, key, offset, dcrc if algo else checksum.legacy(dcrc), gen))
        kept.sort(key=lambda k: k.gen)
        return kept, rejected

    def keep(self, kept: list[Kept]) -> None:
        """Adopt ``kept`` (the records whose blocks the index took) and wipe every other
        record and unused namespace slot, so nothing refused can come back later."""
        live = {k.rec for k in kept}
        for rec in self._used_records():
            if rec not in live:
                self._clear(rec)
        self._fresh = max(live) + 1 if live else 0
        self._reuse = [r for r in range(self._fresh - 1, -1, -1) if r not in live]  # lowest on top
        slots = {}
        for slot in range(NS_SLOTS):
            got = self._read_ns(slot)
            if got is not None:
                slots[got[0]] = [slot, got[1], got[2], 0]
        for k in kept:
            self._rec_of[k.offset] = k.rec
            slots[k.ns_key][3] += 1
            self._gen = max(self._gen, k.gen + 1)
        self._ns = {key: v for key, v in slots.items() if v[3]}
        self._owner_records, self._owner_slots = {}, {}
        for key, v in self._ns.items():
            _add(self._owner_records, owner_of(key), v[3])
            _add(self._owner_slots, owner_of(key), 1)
        used = {v[0] for v in self._ns.values()}
        for slot in range(NS_SLOTS):
            if slot not in used:
                self._clear_ns(slot)
        self._free_ns = [s for s in range(NS_SLOTS - 1, -1, -1) if s not in used]

    def cap_tenants(self, share: float) -> None:
        """Hold each tenant to ``share`` of the records and namespace slots (tenant_share);
        what it holds already stays (a lowered share only stops new records)."""
        self.tenant_records = max(1, int(self.records * share)) if share < 1 else self.records
        self.tenant_slots = max(1, int(NS_SLOTS * share)) if share < 1 else NS_SLOTS

    # ---- updates (the daemon's loop) -----------------------------------------------
    def commit(self, ns_key: str, block_bytes: int, key: bytes, offset: int, crc: int) -> bool:
        """Record a committed block; False when it cannot be kept (journal full, its
        tenant at its share, namespace key too long or no namespace slot left)."""
        if offset in self._rec_of or len(key) != 16:
            return False
        owner = owner_of(ns_key)
        ns = None
        if (self._reuse or self._fresh < self.records) and self._owner_records.get(owner, 0) < self.tenant_records:
            ns = self._ns.get(ns_key)  # a new slot only for a record that will be written
            if ns is None and self._owner_slots.get(owner, 0) < self.tenant_slots:
                ns = self._new_ns(ns_key, block_bytes)
        if ns is None or ns[2] != block_bytes:
            self.full += 1
            return False
        if self._reuse:
            rec = self._reuse.pop()
        else:
            rec, self._fresh = self._fresh, self._fresh + 1
        pos = self._rec_base + rec * RECORD_BYTES
        body = _REC.pack(0, ns[0], self._gen, offset, block_bytes, checksum.plain(crc), key, ns[1],
                         0 if checksum.is_legacy(crc) else 1)[4:]
        self.buf[pos + 4:pos + RECORD_BYTES] = body
        struct.pack_into("<I", self.buf, pos, _crc(body))  # last: until here the record is invalid
        self._gen += 1
        self._rec_of[offset] = rec
        ns[3] += 1
        _add(self._owner_records, owner, 1)
        return True

    def remove(self, offset: int, ns_key: str) -> None:
        rec = self._rec_of.pop(offset, None)
        if rec is None:
            return
        self._clear(rec)
        self._reuse.append(rec)
        ns = self._ns.get(ns_key)
        if ns is not None:
            ns[3] -= 1
            _add(self._owner_records, owner_of(ns_key), -1)
            if ns[3] <= 0:  # no record names it any more: the slot may serve another namespace
                del self._ns[ns_key]
                self._clear_ns(ns[0])
                self._free_ns.append(ns[0])
                _add(self._owner_slots, owner_of(ns_key), -1)

    @property
    def kept(self) -> int:
        return len(self._rec_of)

    def _used_records(self) -> list[int]:
        """Slots whose record is not all zeros (numpy: a big journal is mostly empty)."""
        words = np.frombuffer(self.buf, dtype=np.uint64, count=self.records * RECORD_BYTES // 8,
                              offset=self._rec_base).reshape(self.records, RECORD_BYTES // 8)
        return np.flatnonzero(words.any(axis=1)).tolist()

    # ---- slots -----------------------------------------------------------------------
    def _new_ns(self, ns_key: str, block_bytes: int) -> list | None:
        raw = ns_key.encode()
        if len(raw) > MAX_NS_KEY or not self._free_ns:
            return None
        slot = self._free_ns.pop()
        tag = int.from_bytes(os.urandom(8), "little") or 1
        pos = HEADER_BYTES + slot * NS_SLOT_BYTES
        body = _NS.pack(0, len(raw), tag, block_bytes)[4:] + raw
        self.buf[pos + 4:pos + _NS.size + len(raw)] = body
        struct.pack_into("<I", self.buf, pos, _crc(body))  # last
        ns = self._ns[ns_key] = [slot, tag, block_bytes, 0]
        _add(self._owner_slots, owner_of(ns_key), 1)
        return ns

    def _read_ns(self, slot: int) -> tuple[str, int, int] | None:
        pos = HEADER_BYTES + slot * NS_SLOT_BYTES
        crc, length, tag, size = _NS.unpack_from(self.buf, pos)
        if crc == 0 or length > MAX_NS_KEY:
            return None
        body = bytes(self.buf[pos + 4:pos + _NS.size + length])
        if _crc(body) != crc or tag == 0:
            return None
        try:
            return body[_NS.size - 4:].decode(), tag, size
        except UnicodeDecodeError:
            return None

    def _clear(self, rec: int) -> None:
        pos = self._rec_base + rec * RECORD_BYTES
        struct.pack_into("<I", self.buf, pos, 0)  # first: dead from here on
        self.buf[pos + 4:pos + RECORD_BYTES] = bytes(RECORD_BYTES - 4)

    def _clear_ns(self, slot: int) -> None:
        pos = HEADER_BYTES + slot * NS_SLOT_BYTES
        struct.pack_into("<I", self.buf, pos, 0)
        self.buf[pos + 4:pos + NS_SLOT_BYTES] = bytes(NS_SLOT_BYTES - 4)


def _add(counts: dict[str, int], owner: str, delta: int) -> None:
    left = counts.get(owner, 0) + delta
    if left:
        counts[owner] = left
    else:
        counts.pop(owner, None)


def _crc(body) -> int:
    # Salted so an all-zero body never carries a matching crc of 0.
    return zlib.crc32(body, 0x6B767469) or 1
