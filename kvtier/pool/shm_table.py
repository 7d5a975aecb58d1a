"""The lookup mirror's table layout, shared by its writer and its readers
(``shm_index.py``): a 64-byte header of uint64 words (magic, capacity, seq,
count, tombstones, flags), then ``capacity`` uint64 (each hash's first 8
bytes), as many for the last 8 bytes, then ``capacity`` state bytes (0 empty,
1 ready, 2 tombstone). Slots come in buckets of ``BUCKET``; ``_Table`` is the
numpy view of a mapped segment and its vectorized probes.

Primitives: ``_Table(buf, size, name, capacity=None)`` (``.find``, ``.first_miss``, ``.home``),
``table_bytes(max_keys)``, ``_capacity(n)``, ``_size(capacity)``, ``_hashes(hashes)``.
"""

from __future__ import annotations

import numpy as np

from .segment import SegmentError

MAGIC = 0x6B76_7469_6572_6978  # "kvtierix"
HEADER_WORDS = 8
MAGIC_W, CAP_W, SEQ_W, COUNT_W, TOMB_W, FLAGS_W = range(6)
OVERFLOW = 1
ASK_ON_MISS = 2         # a tier below the table's may hold the rest (remote): only whole hits are answered
EMPTY, READY, TOMB = 0, 1, 2
BUCKET = 8              # slots compared at once per hash
LANES = np.arange(BUCKET, dtype=np.int64)[None, :]
MAX_PROBE = 8           # buckets probed at most: longer means the table is hostile or full
MAX_LOAD = 0.5          # ready keys per slot before the table counts as overflowed
_ROW = np.dtype((np.void, 16))  # a digest as one opaque value


def _capacity(n: int) -> int:
    cap = 8 * BUCKET
    while cap < n:
        cap *= 2
    return cap


def _hashes(hashes) -> np.ndarray:
    """(n, 2) uint64 view of 16-byte digests (a list or packed bytes)."""
    raw = hashes if isinstance(hashes, (bytes, bytearray, memoryview)) else b"".join(hashes)
    if len(raw) % 16:
        raise ValueError(f"hashes are {len(raw)} bytes, not a multiple of 16")
    return np.frombuffer(raw, dtype=np.uint64).reshape(-1, 2)


class _Table:
    """Numpy views over a mapped segment (``buf``: writable for the writer,
    a read-only mapping for readers). Slots come in buckets of ``BUCKET``: a
    hash lives in its home bucket or, when that is full, a later one, so a
    lookup is nearly always one gather of each hash's home bucket."""

    def __init__(self, buf, size: int, name: str, capacity: int | None = None):
        self.header = np.frombuffer(buf, dtype=np.uint64, count=HEADER_WORDS)
        cap = capacity if capacity is not None else int(self.header[CAP_W])
        if cap < BUCKET or cap & (cap - 1) or size < _size(cap):
            raise SegmentError(f"index segment {name}: bad capacity {cap}")
        self.capacity, self.bmask = cap, np.uint64(cap // BUCKET - 1)
        at = HEADER_WORDS * 8
        self.k0 = np.frombuffer(buf, dtype=np.uint64, count=cap, offset=at)
        self.k1 = np.frombuffer(buf, dtype=np.uint64, count=cap, offset=at + 8 * cap)
        self.state = np.frombuffer(buf, dtype=np.uint8, count=cap, offset=at + 16 * cap)
        self.k0_rows = self.k0.reshape(-1, BUCKET)        # one row per bucket: a row gather per hash
        self.k1_rows = self.k1.reshape(-1, BUCKET)
        self.state_rows = self.state.reshape(-1, BUCKET)

    def home(self, h0: np.ndarray) -> np.ndarray:
        return (h0 & self.bmask).astype(np.int64)

    def find(self, h0: np.ndarray, h1: np.ndarray) -> np.ndarray:
        """Slot of each hash, or -1."""
        out = np.full(len(h0), -1, dtype=np.int64)
        nb = self.capacity // BUCKET
        pending, bucket = np.arange(len(h0)), self.home(h0)
        for _ in range(MAX_PROBE):
            slot, full = self._probe(bucket, h0[pending], h1[pending])
            got = slot >= 0
            out[pending[got]] = slot[got]
            on = ~got & full  # a full bucket: the hash may live further on
            if not on.any():
                break
            pending, bucket = pending[on], (bucket[on] + 1) % nb
        return out

    def first_miss(self, h0: np.ndarray, h1: np.ndarray) -> int:
        """Index of the first hash that is not READY (len when all are)."""
        home = self.home(h0)
        slot, _ = self._probe(home, h0, h1, need_full=False)
        miss = np.flatnonzero(slot < 0)
        if not len(miss):
            return len(h0)
        # A home-bucket miss is final unless the bucket is full (rare): then probe on.
        first = int(miss[0])
        if not (self.state_rows[home[first]] != EMPTY).all():
            return first
        again = self.find(h0[miss], h1[miss])
        real = miss[again < 0]
        return int(real[0]) if len(real) else len(h0)

    def _probe(self, bucket, h0, h1, need_full: bool = True):
        """(slot or -1, bucket full?) per hash, looking in one bucket each. Only
        the first 8 bytes are compared across the bucket; the matching slot's
        state and last 8 bytes are checked after (removed slots have k0 zeroed)."""
        eq = self.k0_rows[bucket] == h0[:, None]
        lane = eq.argmax(1)
        slot = bucket * BUCKET + lane
        ok = (self.k0[slot] == h0) & (self.state[slot] == READY) & (self.k1[slot] == h1)
        # Hashes sharing their first 8 bytes share a bucket: the first such slot may be another
        # hash's. Those rows (never seen with real digests) are compared on all 16 bytes.
        again = np.flatnonzero(~ok & (eq.sum(1) > 1))
        if len(again):
            b = bucket[again]
            whole = eq[again] & (self.k1_rows[b] == h1[again, None]) & (self.state_rows[b] == READY)
            hit = whole.any(1)
            slot[again[hit]] = b[hit] * BUCKET + whole[hit].argmax(1)
            ok[again[hit]] = True
        full = (self.state_rows[bucket] != EMPTY).all(1) if need_full else None
        return np.where(ok, slot, -1), full

    def close(self) -> None:
        self.header = self.k0 = self.k1 = self.state = self.k0_rows = self.k1_rows = self.state_rows = None


def _size(capacity: int) -> int:
    return HEADER_WORDS * 8 + 17 * capacity


def table_bytes(max_keys: int) -> int:
    """Bytes of the segment a writer for ``max_keys`` makes."""
    return _size(_capacity(int(max_keys / MAX_LOAD) + 1))
