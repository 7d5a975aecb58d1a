"""Property tests: every message class survives encode -> decode unchanged."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol import messages as m
from kvtier.protocol.codec import decode, encode
from kvtier.protocol.errors import ErrorCode, ProtocolError

U64 = (1 << 64) - 1
# msgpack carries ints in [-2^63, 2^64 - 1]; all of that range must round-trip.
INTS = st.integers(min_value=-(1 << 63), max_value=U64)
REQUEST_IDS = st.integers(min_value=0, max_value=U64)
# Values allowed inside list/dict fields: what msgpack can carry, with str keys.
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False), st.text(), st.binary())
NESTED = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
FIELD = {
    "int": INTS, "str": st.text(), "bytes": st.binary(), "bool": st.booleans(),
    "float": st.floats(allow_nan=False), "list": st.lists(NESTED, max_size=4),
    "dict": st.dictionaries(st.text(max_size=12), NESTED, max_size=4),
}


def message_of(cls) -> st.SearchStrategy:
    fields = {f.name: FIELD[f.type] for f in dataclasses.fields(cls)}
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


@pytest.mark.parametrize("tag", sorted(m.TABLE))
@settings(max_examples=40, deadline=None)
@given(data=st.data(), request_id=REQUEST_IDS)
def test_encode_decode_round_trip(tag, data, request_id):
    msg = data.draw(message_of(m.TABLE[tag]))
    frame = encode(msg, request_id)
    assert decode(frame) == (request_id, msg)
    # Canonical: re-encoding the decoded message gives the same bytes.
    assert encode(decode(frame)[1], request_id) == frame


@pytest.mark.parametrize("tag", sorted(m.TABLE))
@settings(max_examples=20, deadline=None)
@given(data=st.data(), request_id=REQUEST_IDS)
def test_dropping_a_required_field_is_bad_message(tag, data, request_id):
    cls = m.TABLE[tag]
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    if not required:
        return
    body = m.as_wire_dict(data.draw(message_of(cls)))
    del body[data.draw(st.sampled_from(required))]
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb([tag, request_id, body], use_bin_type=True))
    assert (info.value.code, info.value.request_id) == (ErrorCode.BAD_MESSAGE, request_id)


@pytest.mark.parametrize("tag", sorted(m.TABLE))
@settings(max_examples=20, deadline=None)
@given(data=st.data(), request_id=REQUEST_IDS)
def test_wrong_type_in_any_field_is_bad_message(tag, data, request_id):
    cls = m.TABLE[tag]
    fields = dataclasses.fields(cls)
    if not fields:
        return
    f = data.draw(st.sampled_from(fields))
    # A value of every other wire type, except int where a float is wanted (allowed).
    wrong = [t for t in FIELD if t != f.type and not (f.type == "float" and t == "int")]
    body = m.as_wire_dict(data.draw(message_of(cls)))
    body[f.name] = data.draw(FIELD[data.draw(st.sampled_from(wrong))])
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb([tag, request_id, body], use_bin_type=True))
    assert (info.value.code, info.value.request_id) == (ErrorCode.BAD_MESSAGE, request_id)


@given(garbage=st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_decode_or_raise_protocol_error(garbage):
    # Whatever arrives, the decoder answers with a message or a ProtocolError,
    # never another exception type that would escape the daemon's dispatch.
    try:
        decode(garbage)
    except ProtocolError as exc:
        assert exc.code in (ErrorCode.BAD_MESSAGE, ErrorCode.UNKNOWN_OP)


@pytest.mark.parametrize("bad", [-1, U64 + 1, True, 1.0, "1", None])
def test_encode_refuses_request_ids_the_peer_rejects(bad):
    with pytest.raises(ValueError):
        encode(m.Ping(), bad)


def test_encode_refuses_unregistered_types():
    with pytest.raises(TypeError):
        encode(m.Ping, 1)  # the class, not an instance

    @dataclasses.dataclass(frozen=True)
    class Impostor:
        TAG = "ping"

    with pytest.raises(TypeError):
        encode(Impostor(), 1)
