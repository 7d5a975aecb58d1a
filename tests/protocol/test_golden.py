"""The codec against the committed golden vectors (no sockets).

The vectors are what another implementation is told to match, so the Python
codec must decode every frame to the written fields and re-encode it to the
exact same bytes; a codec change that alters the wire fails here.
"""

from __future__ import annotations

import importlib.util
import os

import msgpack
import pytest

from kvtier.protocol import messages as m
from kvtier.protocol.arrays import unpack_hashes, unpack_ids
from kvtier.protocol.codec import decode, encode
from kvtier.protocol.errors import ErrorCode, ProtocolError, side_of

from .golden import GOLDEN_DIR, from_json, ids, load

MESSAGES = load("messages.json")
LENIENT = load("lenient.json")
ERRORS = load("errors.json")
UNPACK = {"unpack_hashes": unpack_hashes, "unpack_ids": unpack_ids}


def expected(vec) -> object:
    return m.TABLE[vec["tag"]](**from_json(vec["fields"]))


@pytest.mark.parametrize("vec", MESSAGES, ids=ids(MESSAGES))
def test_golden_frame_decodes_to_its_fields(vec):
    rid, msg = decode(bytes.fromhex(vec["frame"]))
    assert rid == vec["request_id"]
    assert type(msg).__name__ == vec["class"]
    assert msg == expected(vec)


@pytest.mark.parametrize("vec", MESSAGES, ids=ids(MESSAGES))
def test_golden_fields_encode_to_exact_frame(vec):
    assert encode(expected(vec), vec["request_id"]).hex() == vec["frame"]


def test_every_message_class_has_a_golden_vector():
    assert {v["tag"] for v in MESSAGES} == set(m.TABLE)


def test_hand_assembled_frame_matches_codec():
    # [tag, id, body] as a 3-array, written byte by byte from the msgpack spec:
    # 0x93 array(3), 0xa4 "ping", 0x01 id, 0x80 empty map. Keeps the golden
    # files honest: they are not just whatever encode() happened to write.
    assert encode(m.Ping(), 1) == b"\x93\xa4ping\x01\x80"
    # Unregister(reg=300): fixstr "unreg", uint8 id 200, map(1) {"reg": uint16 300}
    frame = b"\x93\xa5unreg\xcc\xc8\x81\xa3reg\xcd\x01\x2c"
    assert decode(frame) == (200, m.Unregister(300))
    assert encode(m.Unregister(300), 200) == frame


@pytest.mark.parametrize("vec", LENIENT, ids=ids(LENIENT))
def test_lenient_frame_decodes_and_reencodes_canonically(vec):
    rid, msg = decode(bytes.fromhex(vec["frame"]))
    assert (rid, msg) == (vec["request_id"], expected(vec))
    assert encode(msg, rid).hex() == vec["canonical"]
    assert vec["canonical"] != vec["frame"]


@pytest.mark.parametrize("vec", ERRORS, ids=ids(ERRORS))
def test_bad_frame_raises_expected_code_and_request_id(vec):
    frame = bytes.fromhex(vec["frame"])
    max_bytes = vec.get("max_bytes", m.MAX_MESSAGE_BYTES)
    if vec["stage"] == "decode":
        with pytest.raises(ProtocolError) as info:
            decode(frame, max_bytes)
        assert info.value.request_id == vec["request_id"]
    else:  # the frame itself is fine; its packed array is not
        rid, msg = decode(frame, max_bytes)
        assert rid == vec["request_id"]
        with pytest.raises(ProtocolError) as info:
            UNPACK[vec["stage"]](getattr(msg, vec["field"]))
    assert info.value.code == ErrorCode(vec["code"])
    assert info.value.code.name == vec["code_name"]
    assert info.value.side == vec["side"] == side_of(info.value.code)


def test_error_vectors_cover_the_brief():
    names = set(ids(ERRORS))
    for required in ("not_msgpack", "arity_2", "arity_4", "unknown_tag", "missing_field",
                     "str_for_bytes", "bool_for_int", "oversize", "request_id_negative",
                     "hashes_not_multiple_of_16"):
        assert required in names
    # Recoverable failures must keep the caller's id so its error reply is matched.
    recoverable = [v for v in ERRORS if v["request_id"]]
    assert len(recoverable) >= 10


def test_oversize_is_checked_before_parsing():
    # A frame one byte over the limit is refused even though it is valid msgpack.
    frame = encode(m.Flush("x" * 100), 9)
    assert decode(frame, len(frame)) == (9, m.Flush("x" * 100))
    with pytest.raises(ProtocolError) as info:
        decode(frame, len(frame) - 1)
    assert (info.value.code, info.value.request_id) == (ErrorCode.TOO_LARGE, 0)


def test_events_vector_is_the_documented_shape():
    (vec,) = load("events.json")
    body = msgpack.unpackb(bytes.fromhex(vec["body"]), raw=False)
    assert body == from_json(vec["fields"])
    assert list(body) == ["seq", "ts", "events"]
    assert all(kind in ("stored", "removed") and len(h) == 16 for kind, h in body["events"])
    assert bytes.fromhex(vec["topic"]).decode() == "tiny-llama|float16|flashinfer|bs16|tp0of1"


def test_schema_json_matches_message_table():
    schema = load("schema.json")
    assert schema["protocol_version"] == m.PROTOCOL_VERSION
    assert [r["tag"] for r in schema["messages"]] == list(m.TABLE)
    for row in schema["messages"]:
        fields = m.wire_fields(m.TABLE[row["tag"]])
        assert [(f["name"], f["type"]) for f in row["fields"]] == [(f.name, f.type) for f in fields]
    assert [(c["code"], c["side"]) for c in schema["error_codes"]] == [(int(c), side_of(c)) for c in ErrorCode]


def test_golden_files_are_what_the_generator_writes():
    path = os.path.join(os.path.dirname(os.path.dirname(GOLDEN_DIR)), "scripts", "gen_golden.py")
    spec = importlib.util.spec_from_file_location("gen_golden", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, doc in gen.build().items():
        with open(os.path.join(GOLDEN_DIR, name)) as f:
            assert f.read() == gen.render(doc), f"{name} is stale: run scripts/gen_golden.py"
