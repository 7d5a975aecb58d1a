"""Remote values carry their identity, a checksum and a MAC keyed by the
cluster's secret: only the intact block of the right namespace and hash,
written by a holder of the secret, verifies. Sans-IO."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import pytest

from kvtier.pool import checksum
from kvtier.pool.keys import ns_key
from kvtier.remote import values as v

CODEC = v.ValueCodec(bytes(range(32)))
NS = CODEC.namespace(ns_key("team", "tiny-llama|float16|flashinfer|bs16|tp0of1"))
KEY = bytes(range(16))
BLOCK = os.urandom(4096)


def value(ns=NS, key=KEY, payload=BLOCK, codec=CODEC) -> bytes:
    header, _ = codec.frame(ns, key, payload)
    return header + payload


def test_an_intact_value_verifies_and_reports_the_payload_crc():
    verdict = CODEC.verify(value(), NS, KEY, len(BLOCK))
    assert verdict.ok and verdict.crc == checksum.of(BLOCK)  # a CRC-32C, as the checksums table keeps


def test_a_flipped_payload_byte_is_corrupt():
    bad = bytearray(value())
    bad[v.HEADER_BYTES + 100] ^= 0x40
    assert CODEC.verify(bytes(bad), NS, KEY, len(BLOCK)).status == v.CORRUPT


@pytest.mark.parametrize("cut", [10, v.HEADER_BYTES, v.HEADER_BYTES + 1000])
def test_a_truncated_value_is_torn(cut):
    assert CODEC.verify(value()[:cut], NS, KEY, len(BLOCK)).status == v.TORN


def test_a_value_of_another_block_or_namespace_is_foreign():
    """A valid value copied under another key (a replay) names its own block and namespace."""
    other_key = value(key=bytes(16))
    other_ns = value(ns=CODEC.namespace(ns_key("other-team", "tiny-llama|float16|flashinfer|bs16|tp0of1")))
    assert CODEC.verify(other_key, NS, KEY, len(BLOCK)).status == v.FOREIGN
    assert CODEC.verify(other_ns, NS, KEY, len(BLOCK)).status == v.FOREIGN


def test_a_value_made_without_the_secret_is_forged_even_with_a_correct_crc():
    """Everything public about a value (magic, digest, hash, length, crc) copied right;
    the MAC made with a guessed key. And one made by a cluster with another secret."""
    fields = v.FIELDS.pack(v.MAGIC, NS.full, KEY, len(BLOCK), checksum.of(BLOCK))
    guessed = hashlib.sha256(fields + BLOCK).digest()
    assert CODEC.verify(fields + guessed + BLOCK, NS, KEY, len(BLOCK)).status == v.FORGED
    stranger = v.ValueCodec(os.urandom(32))
    assert CODEC.verify(value(codec=stranger, ns=NS), NS, KEY, len(BLOCK)).status == v.FORGED


def test_a_version_1_value_is_not_accepted():
    """The old unauthenticated format: magic, 128-bit digest, hash, length, crc."""
    old = struct.pack("<4s16s16sQI", b"KVT1", NS.full, KEY, len(BLOCK), zlib.crc32(BLOCK)) + BLOCK
    assert not CODEC.verify(old, NS, KEY, len(BLOCK)).ok
    assert not CODEC.key(NS, KEY).startswith(b"kvt1:")


def version_2_value(payload=BLOCK) -> bytes:
    """A value as a version 2 writer with this cluster's secret framed it: KVT2, a CRC-32."""
    fields = v.FIELDS.pack(b"KVT2", NS.full, KEY, len(payload), zlib.crc32(payload))
    return fields + CODEC._mac(fields, payload) + payload


def test_a_version_2_value_is_under_another_key_and_not_accepted_at_this_one():
    # During a rolling upgrade the older nodes' values are misses here, never read: their
    # keys are not this version's, and one copied to a version 3 key fails its magic.
    assert CODEC.key(NS, KEY).startswith(b"kvt3:")
    assert CODEC.verify(version_2_value(), NS, KEY, len(BLOCK)).status == v.CORRUPT


def test_a_block_of_another_size_is_torn_even_when_intact():
    assert CODEC.verify(value(), NS, KEY, len(BLOCK) * 2).status == v.TORN


def test_missing_is_its_own_verdict():
    assert CODEC.verify(None, NS, KEY, len(BLOCK)).status == v.MISSING


def test_keys_differ_by_namespace_hash_and_secret_and_carry_no_hash_tag():
    k = CODEC.key(NS, KEY)
    assert k != CODEC.key(NS, bytes(16))
    assert k != CODEC.key(CODEC.namespace(ns_key("team", "x|y")), KEY)
    # Without the secret the namespace part of a key cannot be computed from the fingerprint.
    assert k != v.ValueCodec(bytes(32)).key(v.ValueCodec(bytes(32)).namespace(
        ns_key("team", "tiny-llama|float16|flashinfer|bs16|tp0of1")), KEY)
    assert b"{" not in k  # no hash tag: blocks spread over every master


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 32 bytes"):
        v.ValueCodec(b"x" * 31)
