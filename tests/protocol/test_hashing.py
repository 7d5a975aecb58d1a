"""Block hashes: a fixed algorithm every engine, process and language agrees on."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.hashing import DEFAULT_SEED, ROOT, block_hashes, chain_hash

from .golden import from_json, ids, load

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = list(range(1000, 1048))
# Known answer for TOKENS, block_size 16, default seed (also in PROTOCOL.md section 8).
# If this changes, every key stored by an older build stops matching.
KNOWN = ["d253b71a9254e415c496ce98ca49f90a", "474d438c561ef830b5354a710619ab5b",
         "c99337aa72523ee1a9e039853fc7e187"]
HASHING = load("hashing.json")
TOKEN = st.integers(-(1 << 63), (1 << 63) - 1)


def spec_block_hashes(tokens, block_size, seed=DEFAULT_SEED, extra=b""):
    """PROTOCOL.md section 8, written from the text with hashlib and struct only."""
    out, parent = [], bytes(16)
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        data = parent + struct.pack(f"<{len(block)}q", *block)
        if extra:
            data += struct.pack("<I", len(extra)) + extra
        parent = hashlib.blake2b(data, digest_size=16, key=seed[:64]).digest()
        out.append(parent)
    return out


def test_known_answer():
    assert DEFAULT_SEED == b"kvtier-block-hash-v1"
    assert [h.hex() for h in block_hashes(TOKENS, 16)] == KNOWN


@pytest.mark.parametrize("case", HASHING, ids=ids(HASHING))
def test_golden_hash_vectors(case):
    seed, extra = from_json(case["seed"]), from_json(case["extra"])
    got = block_hashes(case["tokens"], case["block_size"], seed=seed, extra=extra)
    assert [h.hex() for h in got] == case["hashes"]
    assert spec_block_hashes(case["tokens"], case["block_size"], seed, extra) == got


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(TOKEN, max_size=40), block_size=st.integers(1, 9),
       seed=st.binary(min_size=1, max_size=64), extra=st.binary(max_size=20))
def test_implementation_matches_the_written_spec(tokens, block_size, seed, extra):
    assert block_hashes(tokens, block_size, seed=seed, extra=extra) == \
        spec_block_hashes(tokens, block_size, seed, extra)


def test_numpy_tokens_hash_like_a_list():
    assert block_hashes(np.array(TOKENS, dtype=np.int32), 16) == block_hashes(TOKENS, 16)


def test_same_hashes_in_fresh_processes_with_other_hash_seeds():
    # Python's hash() differs per PYTHONHASHSEED; block keys must not.
    code = ("from kvtier.protocol.hashing import block_hashes; "
            "print(','.join(h.hex() for h in block_hashes(list(range(1000, 1048)), 16, extra=b'x')))")
    here = ",".join(h.hex() for h in block_hashes(TOKENS, 16, extra=b"x"))
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": REPO}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, timeout=60)
        assert out.stdout.strip() == here


@given(tokens=st.lists(TOKEN, max_size=60), block_size=st.integers(1, 8), cut=st.integers(0, 60))
def test_prefix_of_tokens_gives_prefix_of_hashes(tokens, block_size, cut):
    full = block_hashes(tokens, block_size)
    assert len(full) == len(tokens) // block_size  # the partial tail is not hashed
    assert block_hashes(tokens[:cut], block_size) == full[:len(tokens[:cut]) // block_size]


@given(tokens=st.lists(TOKEN, min_size=1, max_size=40), block_size=st.integers(1, 8),
       tail=st.lists(TOKEN, max_size=7))
def test_partial_tail_changes_nothing(tokens, block_size, tail):
    whole = tokens[:len(tokens) // block_size * block_size]
    assert block_hashes(whole + tail[:block_size - 1], block_size) == block_hashes(whole, block_size)


@given(tokens=st.lists(TOKEN, min_size=8, max_size=40), block_size=st.integers(1, 8), data=st.data())
def test_changing_a_token_changes_its_block_and_all_later(tokens, block_size, data):
    before = block_hashes(tokens, block_size)
    if not before:
        return
    i = data.draw(st.integers(0, len(before) * block_size - 1))
    changed = list(tokens)
    changed[i] = tokens[i] + 1 if tokens[i] < (1 << 63) - 1 else tokens[i] - 1
    after = block_hashes(changed, block_size)
    j = i // block_size
    assert after[:j] == before[:j]
    assert all(a != b for a, b in zip(after[j:], before[j:]))


@given(tokens=st.lists(TOKEN, min_size=4, max_size=40), extra=st.binary(min_size=1, max_size=16))
def test_extra_changes_every_hash(tokens, extra):
    plain, tagged = block_hashes(tokens, 4), block_hashes(tokens, 4, extra=extra)
    assert len(plain) == len(tagged)
    assert all(a != b for a, b in zip(plain, tagged))


def test_seed_changes_every_hash():
    assert all(a != b for a, b in zip(block_hashes(TOKENS, 16), block_hashes(TOKENS, 16, seed=b"other")))


def test_chain_hash_is_the_step_of_block_hashes():
    first = chain_hash(ROOT, TOKENS[:16])
    assert ROOT == bytes(16)
    assert [first, chain_hash(first, TOKENS[16:32])] == block_hashes(TOKENS[:32], 16)


@pytest.mark.parametrize("block_size", [0, -16])
def test_block_size_must_be_positive(block_size):
    with pytest.raises(ValueError):
        block_hashes(TOKENS, block_size)
