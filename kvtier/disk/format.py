"""On-disk block files: names and the verified header (sans-IO).

One file per block: ``<root>/<ns dir>/<key hex>-<seq hex>.kvb``, where the
namespace directory is a digest of the namespace key (tenant and
fingerprint) and ``seq`` is the write's number (time-based, so files of
earlier daemons are older). A file is written under ``<root>/tmp/`` and
renamed into place when complete, so a name in a namespace directory never
holds a torn write of this daemon; a torn file after a power loss (rename
reached the disk before the data) fails its checksum and is deleted.

Layout: a ``HEADER_BYTES`` header (the payload starts 4 KiB-aligned, so
``O_DIRECT`` reads stay possible), then the block's bytes.

  magic  8s   b"KVTDISK\\0"
  version H   FORMAT_VERSION (2); version 1 (a CRC-32 payload checksum) is still read;
              another version is never read, only deleted
  keylen  H   block hash length
  fplen   H   namespace key length (UTF-8)
  _pad    H
  seq     Q   must match the file name
  size    Q   payload bytes: must match the file size and the namespace
  crc     I   CRC-32C of the payload (version 1: zlib's CRC-32; ``Header.crc`` carries it
              tagged, ``pool/checksum.py``)
  then the key, the namespace key, and zlib's crc32 of everything before it (I).

Primitives: ``encode_header(ns_key, key, seq, size, crc) -> bytes``,
``decode_header(buf) -> Header | str`` (a reason when it is not ours),
``file_bytes(size)`` (what a block's file takes on disk: ``disk_size`` counts it),
``ns_dir(ns_key)``, ``block_name(key, seq)``, ``parse_name(name)``.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

from ..pool import checksum

MAGIC = b"KVTDISK\0"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # 1: the payload checksum is a CRC-32 (before CRC-32C, pool/checksum.py)
HEADER_BYTES = 4096
PAGE = 4096  # the allocation unit of ext4/xfs/tmpfs, and O_DIRECT's alignment: a file takes whole pages
SUFFIX = ".kvb"
TMP_DIR = "tmp"
_FIXED = struct.Struct("<8sHHHHQQI")
MAX_NS_KEY = HEADER_BYTES - _FIXED.size - 4 - 64  # room for the key (hashes are 16 bytes) and the crc


@dataclass(frozen=True)
class Header:
    ns_key: str
    key: bytes
    seq: int
    size: int
    crc: int       # payload checksum as pool/checksum.py keeps it (a version 1 file's tagged)


def file_bytes(size: int) -> int:
    """The disk space a block file of ``size`` payload bytes takes: its header
    plus payload rounded up to whole pages, since the filesystem allocates no
    less (a 256-byte block's 4,352-byte file takes 8 KiB). Charging less would
    let a tenant of small blocks fill the disk past ``disk_size``."""
    return -(-(HEADER_BYTES + size) // PAGE) * PAGE


def ns_dir(ns_key: str) -> str:
    """A namespace's directory name: a digest, so a tenant or fingerprint never
    becomes a path (no separators, no length limits, nothing to escape)."""
    return hashlib.sha256(ns_key.encode()).hexdigest()[:24]


def block_name(key: bytes, seq: int) -> str:
    return f"{key.hex()}-{seq:016x}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int] | None:
    """(key, seq) of a block file name, or None when it is no block file of ours."""
    if not name.endswith(SUFFIX):
        return None
    stem, _, seq = name[:-len(SUFFIX)].rpartition("-")
    try:
        key = bytes.fromhex(stem)
        n = int(seq, 16)
    except ValueError:
        return None
    if not key or len(key) > 64 or len(seq) != 16 or stem != key.hex():
        return None
    return key, n


def encode_header(ns_key: str, key: bytes, seq: int, size: int, crc: int) -> bytes:
    """``crc``: the payload's CRC-32C (``checksum.of``); a file is always written in this version."""
    if checksum.is_legacy(crc):
        raise ValueError("a block file is written with the payload's CRC-32C, not a CRC-32")
    fp = ns_key.encode()
    if len(fp) > MAX_NS_KEY or len(key) > 64:
        raise ValueError("namespace key or block hash too long for a disk header")
    body = _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), len(fp), 0, seq, size, crc) + key + fp
    body += struct.pack("<I", zlib.crc32(body))
    return body + bytes(HEADER_BYTES - len(body))


def decode_header(buf) -> Header | str:
    """The header in ``buf`` (at least ``HEADER_BYTES``), or why it is not one of ours."""
    if len(buf) < HEADER_BYTES:
        return "truncated header"
    magic, version, keylen, fplen, _, seq, size, crc = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        return "not a kvtier block file"
    if version not in READ_VERSIONS:
        return f"format version {version}, this daemon reads {', '.join(map(str, READ_VERSIONS))}"
    end = _FIXED.size + keylen + fplen
    if keylen > 64 or end + 4 > HEADER_BYTES:
        return "header lengths out of range"
    (want,) = struct.unpack_from("<I", buf, end)
    if zlib.crc32(memoryview(buf)[:end]) != want:
        return "header checksum mismatch"
    key = bytes(buf[_FIXED.size:_FIXED.size + keylen])
    try:
        ns_key = bytes(buf[_FIXED.size + keylen:end]).decode()
    except UnicodeDecodeError:
        return "namespace key is not UTF-8"
    return Header(ns_key, key, seq, size, checksum.legacy(crc) if version == 1 else crc)
