"""The checksum of a block's bytes: CRC-32C, with CRC-32 values still readable.

Every block the daemon writes to a lower tier, journals for a warm restart or
verifies on its way back (``checksums``) carries a checksum of its payload.
That was zlib's CRC-32, 2.7 GB/s on this machine: for a store of 16 blocks of
256 KiB, 1.5 ms of a disk writer's CPU, and as much on every load read back
from disk. CRC-32C (Castagnoli) has a CPU instruction on x86 (SSE4.2) and
ARMv8: the ``crc32c`` package computes it at 11-23 GB/s here, releasing the
GIL, and keeps a table-driven C fallback where the instruction is missing.

What earlier daemons wrote (block files of format 1, journal records with no
algorithm byte) carries CRC-32 (remote values of the ``KVT2`` format did
too; they are no longer read: ``remote/values.py``). Such a
value is kept *tagged*: bit 32 set above the 32-bit CRC-32. So one int says
both which algorithm and what value, in every table that holds checksums
(the disk index, the daemon's ``crcs``, warm restart's unverified blocks),
and ``matches`` checks either kind. A CRC-32C value is a plain 32-bit int.

Where the CPU lacks the instruction (or ``CRC32C_SW_MODE=force``), the
package's table-driven code computes the same values, more slowly: the daemon
warns at start and ``kvtier status`` says which (``pool.checksum``).

Primitives: ``of(buf) -> int`` (CRC-32C of a buffer), ``legacy(crc32) -> int``
(the tagged form of a CRC-32), ``is_legacy(value)``, ``plain(value) -> int``
(the 32 bits a format stores), ``matches(buf, value) -> bool``,
``IMPLEMENTATION`` ("crc32c-hardware" or "crc32c-software").
"""

from __future__ import annotations

import zlib

from crc32c import crc32c as _crc32c
from crc32c import hardware_based as _hardware

IMPLEMENTATION = "crc32c-hardware" if _hardware else "crc32c-software"

LEGACY = 1 << 32
MASK = LEGACY - 1


def of(buf) -> int:
    """CRC-32C of ``buf`` (bytes, a memoryview of the pool, a numpy array: any buffer)."""
    return _crc32c(buf)


def legacy(crc32: int) -> int:
    """The tagged form of a CRC-32 (zlib's) read from an earlier format."""
    return (crc32 & MASK) | LEGACY


def is_legacy(value: int) -> bool:
    return value >= LEGACY


def plain(value: int) -> int:
    """The 32 bits a format stores; ``is_legacy`` says which algorithm they are of."""
    return value & MASK


def matches(buf, value: int | None) -> bool:
    """Does ``buf`` have checksum ``value`` (CRC-32C, or a tagged CRC-32)? None never matches."""
    if value is None:
        return False
    if value >= LEGACY:
        return zlib.crc32(buf) == value & MASK
    return _crc32c(buf) == value
