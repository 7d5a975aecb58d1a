"""A block's checksum (pool/checksum.py): CRC-32C by its standard check value,
and a CRC-32 an earlier daemon wrote still verifies, each kind only against
its own algorithm."""

from __future__ import annotations

import mmap
import os
import zlib

from hypothesis import given
from hypothesis import strategies as st

from kvtier.pool import checksum


def test_crc32c_is_the_castagnoli_crc_by_its_check_value_over_any_buffer():
    assert checksum.of(b"123456789") == 0xE3069283  # the check value of CRC-32C (RFC 3720, B.4)
    assert checksum.of(b"") == 0
    m = mmap.mmap(-1, 1 << 20)  # a writable view of shared memory, as the pool hands out
    m[4096:8192] = os.urandom(4096)
    view = memoryview(m)[4096:8192]
    assert checksum.of(view) == checksum.of(bytes(view)) and checksum.matches(view, checksum.of(bytes(view)))
    view.release()
    m.close()


@given(st.binary(min_size=1, max_size=4096), st.integers(min_value=0))
def test_each_kind_matches_its_own_bytes_and_a_flipped_bit_matches_neither(data, at):
    new, old = checksum.of(data), checksum.legacy(zlib.crc32(data))
    assert not checksum.is_legacy(new) and checksum.is_legacy(old)
    assert checksum.plain(old) == zlib.crc32(data) and checksum.plain(new) == new
    assert checksum.matches(data, new) and checksum.matches(data, old)
    bad = bytearray(data)
    bad[at % len(data)] ^= 1 << (at % 8)
    assert not checksum.matches(bytes(bad), new) and not checksum.matches(bytes(bad), old)
    assert not checksum.matches(data, None)
    if new != zlib.crc32(data):  # the same 32 bits under the other algorithm are refused
        assert not checksum.matches(data, checksum.legacy(new)) and not checksum.matches(data, zlib.crc32(data))
