"""Packed arrays: 16-byte hashes and little-endian int32 ids in one bin field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.protocol.arrays import HASH_BYTES, pack_hashes, pack_ids, unpack_hashes, unpack_ids
from kvtier.protocol.errors import ErrorCode, ProtocolError

I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


def test_hashes_are_concatenated_digests():
    a, b = bytes(range(16)), bytes(range(16, 32))
    assert HASH_BYTES == 16
    assert pack_hashes([a, b]) == a + b
    assert unpack_hashes(a + b) == [a, b]
    assert all(type(h) is bytes for h in unpack_hashes(a + b))  # usable as dict keys
    assert pack_hashes([]) == b"" and unpack_hashes(b"") == []


def test_pre_packed_hashes_pass_through():
    data = bytes(range(48))
    assert pack_hashes(data) == data
    assert pack_hashes(memoryview(data)) == data


@pytest.mark.parametrize("digests", [[b""], [bytes(16), bytes(15)], [bytes(17)],
                                     [bytes(32), b""]])  # right total length, wrong digests
def test_pack_hashes_rejects_a_digest_of_the_wrong_size(digests):
    with pytest.raises(ValueError):
        pack_hashes(digests)


@pytest.mark.parametrize("n", [1, 15, 17, 31, 33])
def test_hashes_length_not_multiple_of_16(n):
    with pytest.raises(ValueError):
        pack_hashes(bytes(n))
    with pytest.raises(ProtocolError) as info:
        unpack_hashes(bytes(n))
    assert info.value.code == ErrorCode.BAD_ARGUMENT


def test_ids_are_little_endian_int32():
    assert pack_ids([3, 4, 5]) == bytes.fromhex("03000000" "04000000" "05000000")
    assert pack_ids([-1, 256]) == bytes.fromhex("ffffffff" "00010000")
    assert unpack_ids(bytes.fromhex("ffffffff" "00010000")).tolist() == [-1, 256]
    assert pack_ids([]) == b"" and unpack_ids(b"").tolist() == []
    assert pack_ids(range(2)) == pack_ids(np.arange(2, dtype=np.int64)) == pack_ids([0, 1])


def test_int32_bounds():
    assert unpack_ids(pack_ids([I32_MIN, I32_MAX])).tolist() == [I32_MIN, I32_MAX]
    for bad in (I32_MAX + 1, I32_MIN - 1, 1 << 63, 1 << 70, -(1 << 70)):
        with pytest.raises(ValueError, match="int32"):
            pack_ids([0, bad])
    with pytest.raises(ValueError, match="int32"):
        pack_ids(np.array([1 << 40], dtype=np.int64))


@pytest.mark.parametrize("bad", [[1.5], [0.0, 1.0], [True, False], np.array([2.0]), [[1, 2], [3, 4]], 7])
def test_pack_ids_rejects_non_integer_or_nested_input(bad):
    # These used to pack silently (1.5 -> block 1, True -> block 1, 2-D flattened).
    with pytest.raises(ValueError):
        pack_ids(bad)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_ids_length_not_multiple_of_4(n):
    with pytest.raises(ProtocolError) as info:
        unpack_ids(bytes(n))
    assert info.value.code == ErrorCode.BAD_ARGUMENT


@given(st.lists(st.integers(I32_MIN, I32_MAX), max_size=200))
def test_ids_round_trip(ids):
    data = pack_ids(ids)
    assert len(data) == 4 * len(ids)
    assert unpack_ids(data).tolist() == ids


@given(st.lists(st.binary(min_size=16, max_size=16), max_size=50))
def test_hashes_round_trip(hashes):
    data = pack_hashes(hashes)
    assert len(data) == 16 * len(hashes)
    assert unpack_hashes(data) == hashes
