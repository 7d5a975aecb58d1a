"""Remote keys and values: naming, framing, authentication. Sans-IO.

A block crossing nodes is stored under a key derived from its namespace and
block hash, as a value that carries its own identity, a checksum and a MAC
keyed by the remote secret (``remote_secret_file``, readable by the
daemon's user alone). Whoever reaches the store without the secret can
neither name a namespace's keys nor write a value any node accepts:

    key    = b"kvt3:" + hex(ns.short) + b":" + hex(block hash)
    value  = header (80 bytes) + payload (the block's bytes)
    header = magic b"KVT3" | ns.full (16) | block hash (16, zero-padded) |
             payload length (u64 LE) | crc32c(payload) (u32 LE) |
             HMAC-SHA256(mac key, header[:48] + payload) (32)

    ns.full  = HMAC-SHA256(ns key, tenant SEP fingerprint)[:16]
    ns.short = ns.full[:8]         (spreads keys; the header binds)

Both keys are derived from the secret (HMAC with distinct labels), so a
namespace digest reveals nothing about the model or tenant behind it. The
MAC covers namespace, hash, length, checksum and payload: a value copied to
another block or namespace (a replay) fails the binding check (FOREIGN), a
value written without the secret fails the MAC (FORGED). A value failing
the MAC whose checksum still matches its payload was made by someone without
the secret; one whose checksum does not match was damaged (CORRUPT). The
reader does not recompute the checksum of an authenticated value: the writer
holds the secret, so the crc in its header is the payload's and can seed
the daemon's ``checksums`` table. HMAC-SHA256 runs at ~1.5 GB/s per core
here (OpenSSL, SHA extensions), about twice keyed BLAKE2b in CPython.

The checksum is a CRC-32C (``pool/checksum.py``), as in the disk tier's files
and the journal: a writer frames a 256 KiB value at 1.45-1.55 GB/s where zlib's
CRC-32 left 0.99-1.17 (BENCHMARKS.md 7.2), and the crc it hands the ``checksums``
table is the kind the daemon verifies fastest.

Earlier versions are never read: their keys are not looked up, and they expire
with their TTL. Version 1 (``kvt1:`` keys) had unauthenticated 48-byte
headers; version 2 (``kvt2:``, ``KVT2``) is version 3 with a CRC-32. So while
a cluster's nodes are upgraded one by one, an upgraded node and an older one
each miss what the other wrote (a recompute, never a wrong block) and neither
deletes the other's values, which it would as corrupt if they shared keys.

Primitives: ``ValueCodec(secret)`` with ``.namespace(fp)``, ``.key(ns,
hash)``, ``.frame(ns, hash, payload) -> (header, crc)``, ``.verify(value,
ns, hash, size) -> Verdict``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from ..pool import checksum

MAGIC = b"KVT3"
FIELDS = struct.Struct("<4s16s16sQI")   # what the MAC covers before the payload
MAC_BYTES = 32
HEADER_BYTES = FIELDS.size + MAC_BYTES  # 80
KEY_PREFIX = b"kvt3:"
MIN_SECRET_BYTES = 32

OK, MISSING, TORN, FOREIGN, CORRUPT, FORGED = "ok", "missing", "torn", "foreign", "corrupt", "forged"


@dataclass(frozen=True)
class NamespaceDigest:
    """What a namespace becomes on the wire: the key part and the binding."""
    short: bytes   # hex of 64 bits, in keys
    full: bytes    # 128 bits, in every value's header


@dataclass(frozen=True)
class Verdict:
    status: str            # OK, MISSING, TORN, FOREIGN, CORRUPT or FORGED
    crc: int = 0           # the payload's CRC-32C when OK
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def _padded(key: bytes) -> bytes:
    if len(key) > 16:
        raise ValueError("block hashes are at most 16 bytes")
    return key.ljust(16, b"\0")


class ValueCodec:
    """Keys and values under one remote secret (every node of a cluster has the same)."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the remote secret must be at least {MIN_SECRET_BYTES} bytes")
        self._ns_key = hmac.digest(secret, b"kvtier remote v2 namespace", "sha256")
        self._mac_key = hmac.digest(secret, b"kvtier remote v2 value", "sha256")

    def namespace(self, name: str) -> NamespaceDigest:
        """``name`` is the cluster-wide namespace: operator-named tenant SEP fingerprint."""
        full = hmac.digest(self._ns_key, name.encode(), "sha256")[:16]
        return NamespaceDigest(full[:8].hex().encode(), full)

    @staticmethod
    def key(ns: NamespaceDigest, block: bytes) -> bytes:
        return KEY_PREFIX + ns.short + b":" + block.hex().encode()

    def _mac(self, fields: bytes, payload) -> bytes:
        h = hmac.new(self._mac_key, fields, hashlib.sha256)
        h.update(payload)  # OpenSSL releases the GIL above a few KiB
        return h.digest()

    def frame(self, ns: NamespaceDigest, block: bytes, payload) -> tuple[bytes, int]:
        """The header for ``payload`` (any buffer) and the payload's CRC-32C."""
        crc = checksum.of(payload)
        fields = FIELDS.pack(MAGIC, ns.full, _padded(block), memoryview(payload).nbytes, crc)
        return fields + self._mac(fields, payload), crc

    def verify(self, value, ns: NamespaceDigest, block: bytes, size: int) -> Verdict:
        """Is ``value`` (bytes or None) block ``block`` of ``ns``, ``size`` bytes, written by a
        holder of the secret?"""
        if value is None:
            return Verdict(MISSING, why="no such key")
        mv = memoryview(value)
        if mv.nbytes < HEADER_BYTES:
            return Verdict(TORN, why=f"{mv.nbytes} bytes, shorter than the header")
        magic, digest, bkey, length, crc = FIELDS.unpack_from(mv)
        if magic != MAGIC:
            return Verdict(CORRUPT, why="bad magic")
        if digest != ns.full or bkey != _padded(block):
            return Verdict(FOREIGN, why="value belongs to another namespace or block")
        if length != size or mv.nbytes != HEADER_BYTES + size:
            return Verdict(TORN, why=f"payload {mv.nbytes - HEADER_BYTES} bytes, header says {length}, "
                                     f"block is {size}")
        payload = mv[HEADER_BYTES:]
        mac = self._mac(mv[:FIELDS.size].tobytes(), payload)
        if not hmac.compare_digest(mac, mv[FIELDS.size:HEADER_BYTES]):
            if checksum.of(payload) != crc:
                return Verdict(CORRUPT, why="checksum mismatch")
            return Verdict(FORGED, why="bad MAC: not written with this cluster's secret")
        return Verdict(OK, crc)
