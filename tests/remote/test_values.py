"""Remote values carry their identity and a checksum: only the intact block of
the right namespace and hash verifies. Sans-IO."""

from __future__ import annotations

import os
import zlib

import pytest

from kvtier.remote import values as v

NS = v.namespace_digest("tiny-llama|float16|flashinfer|bs16|tp0of1")
KEY = bytes(range(16))
BLOCK = os.urandom(4096)


def value(ns=NS, key=KEY, payload=BLOCK) -> bytes:
    header, _ = v.frame(ns, key, payload)
    return header + payload


def test_an_intact_value_verifies_and_reports_the_payload_crc():
    verdict = v.verify(value(), NS, KEY, len(BLOCK))
    assert verdict.ok and verdict.crc == zlib.crc32(BLOCK)


def test_a_flipped_payload_byte_is_corrupt():
    bad = bytearray(value())
    bad[v.HEADER_BYTES + 100] ^= 0x40
    assert v.verify(bytes(bad), NS, KEY, len(BLOCK)).status == v.CORRUPT


@pytest.mark.parametrize("cut", [10, v.HEADER_BYTES, v.HEADER_BYTES + 1000])
def test_a_truncated_value_is_torn(cut):
    assert v.verify(value()[:cut], NS, KEY, len(BLOCK)).status == v.TORN


def test_a_value_of_another_block_or_namespace_is_foreign():
    other_key = value(key=bytes(16))
    other_ns = value(ns=v.namespace_digest("other-model|float16|flashinfer|bs16|tp0of1"))
    assert v.verify(other_key, NS, KEY, len(BLOCK)).status == v.FOREIGN
    assert v.verify(other_ns, NS, KEY, len(BLOCK)).status == v.FOREIGN


def test_a_block_of_another_size_is_torn_even_when_intact():
    assert v.verify(value(), NS, KEY, len(BLOCK) * 2).status == v.TORN


def test_missing_is_its_own_verdict():
    assert v.verify(None, NS, KEY, len(BLOCK)).status == v.MISSING


def test_keys_differ_by_namespace_and_hash_and_carry_no_hash_tag():
    k = v.remote_key(NS, KEY)
    assert k != v.remote_key(NS, bytes(16))
    assert k != v.remote_key(v.namespace_digest("x|y"), KEY)
    assert b"{" not in k  # no hash tag: blocks spread over every master
