"""Remote keys and values: naming, framing, verification. Sans-IO.

A block crossing nodes is stored under a key derived from its namespace
fingerprint and block hash, as a value that carries its own identity and a
checksum, so a reader can tell a good value from a torn one (short, or bytes
flipped) and from a foreign one (another namespace or block whose bytes
landed under this key):

    key   = b"kvt1:" + hex(blake2b-64(fingerprint)) + b":" + hex(block hash)
    value = header (48 bytes) + payload (the block's bytes)
    header = magic b"KVT1" | blake2b-128(fingerprint) | block hash (16 bytes,
             zero-padded) | payload length (u64 LE) | crc32(payload) (u32 LE)

The key's 64-bit namespace digest only spreads keys; the header's 128-bit
digest and the full hash are what bind a value to its block. The checksum is
zlib's crc32, the same function the daemon's ``checksums`` option uses, so a
verified block's crc can seed that table.

Primitives: ``namespace_digest(fp)``, ``remote_key(digest, key)``,
``frame(digest, key, payload) -> (header, crc)``, ``verify(value, digest,
key, size) -> Verdict``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVT1"
HEADER = struct.Struct("<4s16s16sQI")
HEADER_BYTES = HEADER.size  # 48
KEY_PREFIX = b"kvt1:"

OK, MISSING, TORN, FOREIGN, CORRUPT = "ok", "missing", "torn", "foreign", "corrupt"


@dataclass(frozen=True)
class NamespaceDigest:
    """What a fingerprint becomes on the wire: the key part and the binding."""
    short: bytes   # hex of a 64-bit digest, in keys
    full: bytes    # 128-bit digest, in every value's header


def namespace_digest(fingerprint: str) -> NamespaceDigest:
    full = hashlib.blake2b(fingerprint.encode(), digest_size=16, person=b"kvtier-remote").digest()
    return NamespaceDigest(full[:8].hex().encode(), full)


def remote_key(ns: NamespaceDigest, key: bytes) -> bytes:
    return KEY_PREFIX + ns.short + b":" + key.hex().encode()


def _padded(key: bytes) -> bytes:
    if len(key) > 16:
        raise ValueError("block hashes are at most 16 bytes")
    return key.ljust(16, b"\0")


def frame(ns: NamespaceDigest, key: bytes, payload) -> tuple[bytes, int]:
    """The header for ``payload`` (any buffer) and the payload's crc32."""
    crc = zlib.crc32(payload)  # releases the GIL above a few KiB
    return HEADER.pack(MAGIC, ns.full, _padded(key), memoryview(payload).nbytes, crc), crc


@dataclass(frozen=True)
class Verdict:
    status: str            # OK, MISSING, TORN, FOREIGN or CORRUPT
    crc: int = 0           # payload crc32 when OK
    why: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def verify(value, ns: NamespaceDigest, key: bytes, size: int) -> Verdict:
    """Is ``value`` (bytes or None) block ``key`` of namespace ``ns``, ``size`` bytes, intact?"""
    if value is None:
        return Verdict(MISSING, why="no such key")
    mv = memoryview(value)
    if mv.nbytes < HEADER_BYTES:
        return Verdict(TORN, why=f"{mv.nbytes} bytes, shorter than the header")
    magic, digest, bkey, length, crc = HEADER.unpack_from(mv)
    if magic != MAGIC:
        return Verdict(CORRUPT, why="bad magic")
    if digest != ns.full or bkey != _padded(key):
        return Verdict(FOREIGN, why="value belongs to another namespace or block")
    if length != size or mv.nbytes != HEADER_BYTES + size:
        return Verdict(TORN, why=f"payload {mv.nbytes - HEADER_BYTES} bytes, header says {length}, "
                                 f"block is {size}")
    actual = zlib.crc32(mv[HEADER_BYTES:])
    if actual != crc:
        return Verdict(CORRUPT, why="checksum mismatch")
    return Verdict(OK, crc)
