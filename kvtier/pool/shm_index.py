"""One namespace's READY block hashes, readable by clients from shared memory.

The daemon, sole writer, mirrors a namespace's ready set into an
open-addressing hash table in a named segment; a client of that namespace maps
it and answers a lookup without a round trip: all hashes are probed at once in
numpy and the answer is the index of the first miss.

Consistency (seqlock): the writer makes the sequence number odd, mutates, then
makes it even; a reader reads it, probes, reads it again and retries when it
was odd or moved. Readers never block the writer, and a reader that keeps
losing the race (or finds the table overflowed) gets None: ask the daemon.
This relies on x86 keeping stores in order and loads in order (numpy gives no
fences): on other CPUs a reader refuses to open (``SegmentError``, so the
client asks over the socket) and the daemon does not build mirrors at all.

Tenancy: one segment per namespace, named with a random token that the daemon
hands only to clients registered in that namespace, mode 0600 (or the pool's
group mode), so a client can only read the namespaces it may see. Engines of
other users get a read-only descriptor of it over the hand-over socket
(``daemon/handover.py``), again only for a namespace they are registered in.

Bounded work for hostile keys: an insert that would land past the
``MAX_PROBE`` buckets a lookup probes marks the table overflowed (readers
fall back to the daemon) instead of growing probe chains - a key stored
where no lookup looks would be never found and never removed.

Removals without tombstones where they can: a probe passes a
bucket only while it has no empty slot, and no write ever empties a slot of a
bucket that has none, so a bucket holding an empty slot has never been passed
since the table was last cleared or rehashed: the key a removal finds there can
leave an empty slot, not a tombstone. Only removals from full buckets leave
tombstones, so churn at a steady ready set (every eviction one removal) no
longer fills the table with them and rehashes it in one call every quarter of
its capacity of removals (BENCHMARKS 20.4).

Layout and the vectorized probes: ``shm_table.py``. Small writes (a store's
commit, an eviction pass) go key by key (``SMALL_WRITE``), larger ones vectorized.

Primitives: ``ShmIndexWriter(name, capacity, ask_on_miss=False).add(hashes)``, ``.remove(hashes)``,
``.clear()``, ``.close()``; ``ShmIndexReader(name, fd=None).ready_prefix(packed) -> int | None``,
``.close()``; ``segment_name(token)``, ``seqlock_safe()``. ``hashes`` are 16-byte digests (a list or
packed bytes).
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets

import numpy as np
import posix_ipc

from .segment import SegmentError, ShmSegment
from .shm_table import (ASK_ON_MISS, BUCKET, CAP_W, COUNT_W, EMPTY, FLAGS_W, HEADER_WORDS, LANES, MAGIC,
                        MAGIC_W, MAX_LOAD, MAX_PROBE, OVERFLOW, READY, SEQ_W, TOMB, TOMB_W, _ROW, _Table,
                        _capacity, _hashes, _size)

READ_RETRIES = 64       # seqlock retries before a reader gives up (asks the daemon)
# Writes of at most this many hashes go key by key in plain Python over memoryviews: a
# store's commit or an eviction pass changes a few dozen keys, and numpy's per-call
# overhead made such a write ~150-270 us (the mirror slowed stores 1.5-1.9x on the
# public trace, BENCHMARKS 20.1); larger ones (a table's first fill) stay vectorized.
SMALL_WRITE = 64
PREFIX = "kvtier-ix."
X86 = ("x86_64", "amd64", "i386", "i486", "i586", "i686", "x86")


def seqlock_safe(machine: str | None = None) -> bool:
    """Whether this CPU keeps stores and loads in order (x86 TSO), which the
    fence-less seqlock needs; ``machine`` defaults to this one's."""
    return (machine if machine is not None else platform.machine()).lower() in X86


def segment_name(token: str | None = None) -> str:
    """An unguessable segment name (the token is the read capability)."""
    return f"/{PREFIX}{token or secrets.token_hex(16)}"


class ShmIndexWriter:
    """Daemon side: owns the segment, mirrors adds and removals under the seqlock."""

    def __init__(self, name: str, max_keys: int, mode: int = 0o600, group: int | None = None,
                 ask_on_miss: bool = False):
        """``ask_on_miss``: readers answer whole hits only, asking the daemon past a miss
        (a remote tier may hold what the table lacks)."""
        cap = _capacity(int(max_keys / MAX_LOAD) + 1)
        self.segment = ShmSegment(name, _size(cap), create=True, mode=mode, group=group)
        self.t = _Table(self.segment.buffer, self.segment.size, name, cap)
        self.t.k0[:] = 0
        self.t.k1[:] = 0
        self.t.state[:] = EMPTY
        self.t.header[:] = 0
        self.t.header[CAP_W] = cap
        self.ask = ASK_ON_MISS if ask_on_miss else 0
        self.t.header[FLAGS_W] = self.ask
        self.t.header[MAGIC_W] = MAGIC  # last: a reader seeing the magic sees a whole table
        self.name = name
        self.small = SMALL_WRITE  # writes of at most this many hashes go key by key
        self._bind()

    def _bind(self) -> None:
        """Scalar views of the table's memory for small writes (``_add_few``, ``_remove_few``)."""
        cap = self.t.capacity
        self._mm, self._nb = self.segment._mmap, cap // BUCKET
        self._k0_at, self._st_at = HEADER_WORDS * 8, HEADER_WORDS * 8 + 16 * cap
        self._hw, self._k0, self._k1, self._st = (memoryview(a).cast("B").cast(c) for a, c in (
            (self.t.header, "Q"), (self.t.k0, "Q"), (self.t.k1, "Q"), (self.t.state, "B")))

    @property
    def overflowed(self) -> bool:
        return bool(int(self.t.header[FLAGS_W]) & OVERFLOW)

    def add(self, hashes) -> None:
        """Mark digests ready (already present ones are left as they are)."""
        h = _hashes(hashes)
        if not len(h) or self.overflowed:
            return
        if len(h) <= self.small:
            return self._add_few(h.tolist())
        t = self.t
        with _Write(t.header):
            h = h[t.find(h[:, 0], h[:, 1]) < 0]
            if len(h) > 1:  # duplicates once, first seen first (16-byte rows as one key: 5x np.unique(axis=0))
                first = np.unique(np.ascontiguousarray(h).view(_ROW).ravel(), return_index=True)[1]
                if len(first) < len(h):
                    h = h[np.sort(first)]
            if int(t.header[COUNT_W]) + len(h) > MAX_LOAD * t.capacity:
                t.header[FLAGS_W] |= np.uint64(OVERFLOW)
                return
            if int(t.header[COUNT_W] + t.header[TOMB_W]) + len(h) > 0.75 * t.capacity:
                self._rehash()
            self._insert(h)

    def remove(self, hashes) -> None:
        h = _hashes(hashes)
        if not len(h) or self.overflowed:
            return
        if len(h) <= self.small:
            return self._remove_few(h.tolist())
        t = self.t
        with _Write(t.header):
            slots = np.unique(t.find(h[:, 0], h[:, 1]))
            slots = slots[slots >= 0]
            # In a bucket with an empty slot a removed slot is empty too, not a tombstone (docstring).
            tomb = ~(t.state_rows[slots // BUCKET] == EMPTY).any(1)
            t.state[slots] = np.where(tomb, TOMB, EMPTY)
            t.k0[slots] = 0  # a removed slot never matches a hash's first 8 bytes
            t.header[COUNT_W] -= np.uint64(len(slots))
            t.header[TOMB_W] += np.uint64(int(tomb.sum()))

    def clear(self) -> None:
        """Empty the table (and lift an overflow: the daemon re-adds what is ready)."""
        t = self.t
        with _Write(t.header):
            t.state[:] = EMPTY
            t.k0[:] = 0
            t.header[COUNT_W] = t.header[TOMB_W] = 0
            t.header[FLAGS_W] = self.ask

    # ---- small writes, key by key (the same table, the same rules as the vectorized path) ----
    def _find1(self, h0: int, h1: int, needle: bytes) -> int:
        """Slot of one hash or -1: its home bucket, then on while buckets are full (``find``).
        ``mmap.find`` scans a bucket's 64 bytes of first halves in C (``needle``: h0's bytes)."""
        mm, k1, st, k0_at, st_at, nb = self._mm, self._k1, self._st, self._k0_at, self._st_at, self._nb
        b = h0 & (nb - 1)
        for _ in range(MAX_PROBE):
            lo = k0_at + b * BUCKET * 8
            hi = lo + BUCKET * 8
            i = mm.find(needle, lo, hi)
            while i >= 0:  # a match at an unaligned offset spans two slots: not this hash
                if not (i - k0_at) & 7:
                    s = (i - k0_at) >> 3
                    if st[s] == READY and k1[s] == h1:
                        return s
                i = mm.find(needle, i + 1, hi)
            if mm.find(b"\x00", st_at + b * BUCKET, st_at + b * BUCKET + BUCKET) >= 0:
                return -1  # a bucket with an empty slot ends the probe
            b = (b + 1) % nb
        return -1

    def _free1(self, b: int) -> int:
        """First slot of bucket ``b`` that is not READY (empty or a tombstone), or -1."""
        lo = self._st_at + b * BUCKET
        e, t = self._mm.find(b"\x00", lo, lo + BUCKET), self._mm.find(b"\x02", lo, lo + BUCKET)
        first = t if e < 0 else e if t < 0 else min(e, t)
        return first - self._st_at if first >= 0 else -1

    def _unbind(self) -> None:
        for v in (self._hw, self._k0, self._k1, self._st):  # they hold the mapping: released first
            v.release()

    def _add_few(self, pairs: list) -> None:
        hw, k0, k1, st, nb = self._hw, self._k0, self._k1, self._st, self._nb
        cap = self.t.capacity
        with _Write(self.t.header):
            for h0, h1 in pairs:
                needle = h0.to_bytes(8, "little")
                if self._find1(h0, h1, needle) >= 0:  # present (or a duplicate in this batch)
                    continue
                if hw[COUNT_W] + 1 > MAX_LOAD * cap:
                    hw[FLAGS_W] |= OVERFLOW
                    return
                if hw[COUNT_W] + hw[TOMB_W] + 1 > 0.75 * cap:
                    self._rehash()
                b = h0 & (nb - 1)
                for _ in range(MAX_PROBE):
                    slot = self._free1(b)
                    if slot >= 0:
                        break
                    b = (b + 1) % nb
                else:  # past the probe window nobody would find it: stop serving (as _insert)
                    hw[FLAGS_W] |= OVERFLOW
                    return
                if st[slot] == TOMB:
                    hw[TOMB_W] -= 1
                k0[slot], k1[slot], st[slot] = h0, h1, READY
                hw[COUNT_W] += 1

    def _remove_few(self, pairs: list) -> None:
        hw, k0, st, mm, st_at = self._hw, self._k0, self._st, self._mm, self._st_at
        with _Write(self.t.header):
            for h0, h1 in pairs:
                s = self._find1(h0, h1, h0.to_bytes(8, "little"))
                if s >= 0:
                    k0[s] = 0  # a removed slot never matches a hash's first 8 bytes
                    hw[COUNT_W] -= 1
                    lo = st_at + s - s % BUCKET
                    if mm.find(b"\x00", lo, lo + BUCKET) >= 0:  # a bucket with an empty slot: no tombstone (docstring)
                        st[s] = EMPTY
                    else:
                        st[s] = TOMB
                        hw[TOMB_W] += 1

    def _insert(self, h: np.ndarray) -> None:
        """Each hash into the first free slot of its home bucket or a later one.
        Per round one hash per bucket takes a slot; hashes of full buckets move on."""
        t = self.t
        nb = t.capacity // BUCKET
        pending, bucket, hops = np.arange(len(h)), t.home(h[:, 0]), np.zeros(len(h), dtype=np.int64)
        while len(pending):
            st = t.state[bucket[:, None] * BUCKET + LANES]
            free = st != READY
            full = ~free.any(1)
            _, first = np.unique(np.where(full, -1, bucket), return_index=True)
            won = first[~full[first]]
            slot = bucket[won] * BUCKET + free[won].argmax(1)
            t.header[TOMB_W] -= np.uint64(int((t.state[slot] == TOMB).sum()))
            t.k0[slot], t.k1[slot] = h[pending[won], 0], h[pending[won], 1]
            t.state[slot] = READY
            t.header[COUNT_W] += np.uint64(len(won))
            hops[full] += 1
            # Lookups probe buckets home .. home + MAX_PROBE - 1: a key placed
            # further on would be found by nobody and removed by nobody.
            if (hops >= MAX_PROBE).any():
                t.header[FLAGS_W] |= np.uint64(OVERFLOW)  # a chain too long: stop serving
                return
            bucket = np.where(full, (bucket + 1) % nb, bucket)
            keep = np.ones(len(pending), dtype=bool)
            keep[won] = False
            pending, bucket, hops = pending[keep], bucket[keep], hops[keep]

    def _rehash(self) -> None:
        t = self.t
        ready = t.state == READY
        h = np.stack([t.k0[ready], t.k1[ready]], axis=1)
        t.state[:] = EMPTY
        t.k0[:] = 0
        t.header[COUNT_W] = t.header[TOMB_W] = 0
        if len(h):
            self._insert(h)

    def close(self) -> None:
        """Unmap and unlink; readers keep their mappings until they close."""
        self._unbind()
        self.t.close()
        self.segment.release(unlink=True)


class _Write:
    """The seqlock's write side: odd while the table changes."""

    def __init__(self, header: np.ndarray):
        self.header = header

    def __enter__(self):
        self.header[SEQ_W] += np.uint64(1)

    def __exit__(self, *exc):
        self.header[SEQ_W] += np.uint64(1)


class ShmIndexReader:
    """Client side: answers ready prefixes from the mapped table, or None."""

    def __init__(self, name: str, machine: str | None = None, fd: int | None = None):
        """Map the table ``name``, or, given ``fd`` (a read-only descriptor the daemon
        handed over: engines of other users than the daemon's), that one; the
        reader owns ``fd`` from here (closed once mapped, also on failure)."""
        if not seqlock_safe(machine):
            if fd is not None:
                os.close(fd)
            raise SegmentError(f"index segment {name}: its seqlock needs x86 memory ordering, "
                               f"this CPU is {machine or platform.machine()}")
        # Mapped read-only: a client cannot write the table other clients read.
        if fd is None:
            try:
                shm = posix_ipc.SharedMemory(name, read_only=True)
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError, ValueError) as exc:
                raise SegmentError(f"index segment {name}: {exc}") from None
            fd, close = shm.fd, shm.close_fd
        else:
            close = lambda: os.close(fd)  # noqa: E731
        try:
            size = os.fstat(fd).st_size
            if size < _size(64):
                raise SegmentError(f"index segment {name} is too small ({size} bytes)")
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise SegmentError(f"index segment {name}: {exc}") from None
        finally:
            close()
        self.t = _Table(self._mmap, size, name)
        if int(self.t.header[MAGIC_W]) != MAGIC:
            self.close()
            raise SegmentError(f"{name} is not a kvtier index segment")

    def ready_prefix(self, hashes) -> int | None:
        """How many leading hashes are READY; None when the table cannot say
        (overflowed, or the writer kept it busy): ask the daemon instead."""
        h = _hashes(hashes)
        t, header = self.t, self.t.header
        for _ in range(READ_RETRIES):
            seq = int(header[SEQ_W])
            if seq & 1:
                continue
            flags = int(header[FLAGS_W])
            if flags & OVERFLOW:
                return None
            n = t.first_miss(h[:, 0], h[:, 1])
            if int(header[SEQ_W]) == seq:
                return None if flags & ASK_ON_MISS and n < len(h) else n
        return None

    def close(self) -> None:
        self.t.close()
        self._mmap.close()
