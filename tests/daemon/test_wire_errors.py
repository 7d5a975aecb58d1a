"""A real daemon answers bad frames as PROTOCOL.md says: code, side, request id.

The golden error vectors are replayed on a raw DEALER socket (no kvtier
client in between), so what is checked is the bytes a foreign client sees.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import zmq

from kvtier.protocol import messages as m
from kvtier.protocol.codec import encode
from tests.conftest import DaemonProc
from tests.protocol.golden import load

DECODE_ERRORS = [v for v in load("errors.json") if v["stage"] == "decode" and "max_bytes" not in v]
GOLDEN = {v["name"]: bytes.fromhex(v["frame"]) for v in load("messages.json")}


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    # One daemon for the file: each test uses its own connection (own identity),
    # so sessions do not leak between tests, and startup is paid once.
    d = DaemonProc(tmp_path_factory.mktemp("wire"))
    yield d
    d.stop()


@pytest.fixture
def raw(shared_daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("ipc://" + shared_daemon.socket)
    yield sock
    sock.close()


def reply(sock, *frames) -> list:
    """Send one message of ``frames`` and return the daemon's reply, undecoded by kvtier."""
    sock.send_multipart(list(frames))
    assert sock.poll(10_000), "no reply from the daemon"
    (frame,) = sock.recv_multipart()  # replies are always a single frame
    return msgpack.unpackb(frame, raw=False)


def assert_error(got, code: int, request_id: int, side: str = "client"):
    tag, rid, body = got
    assert (tag, rid, body["code"], body["side"]) == ("err", request_id, code, side), got
    assert isinstance(body["message"], str) and body["message"]


def test_every_golden_bad_frame_gets_its_error_reply(raw):
    # Nothing here has said HELLO: decoding fails before the session check.
    for vec in DECODE_ERRORS:
        assert_error(reply(raw, bytes.fromhex(vec["frame"])), vec["code"], vec["request_id"], vec["side"])


def test_error_reply_keeps_the_request_id_of_a_bad_field(raw):
    # Fixed in the daemon: the id was replaced by 0, so clients timed out instead.
    frame = msgpack.packb(["lk", 77, {"reg": 1, "hashes": "not bytes"}], use_bin_type=True)
    assert_error(reply(raw, frame), 1, 77)


def test_oversize_frame_is_too_large(raw):
    frame = encode(m.Flush("x" * m.MAX_MESSAGE_BYTES), 5)
    assert len(frame) > m.MAX_MESSAGE_BYTES
    assert_error(reply(raw, frame), 9, 0)


def test_multi_frame_message_is_bad_message_with_id_0(raw):
    # e.g. a REQ-style empty delimiter in front of the frame
    assert_error(reply(raw, b"", GOLDEN["ping"]), 1, 0)


def test_requests_before_hello(raw):
    assert_error(reply(raw, GOLDEN["lookup"]), 8, 7)           # NOT_CONNECTED
    assert_error(reply(raw, GOLDEN["ping"]), 8, 0)             # a forgotten client learns it here
    # Nothing but HELLO before HELLO: stats once listed every tenant's namespaces to anyone.
    assert_error(reply(raw, GOLDEN["stats"]), 8, 15)


@pytest.mark.parametrize("name", ["ok", "hits", "welcome"])
def test_reply_tags_are_unknown_op(raw, name):
    sent = msgpack.unpackb(GOLDEN[name], raw=False)
    assert_error(reply(raw, GOLDEN[name]), 2, sent[1])


@pytest.mark.parametrize("name", ["offload", "restore", "discard"])
def test_swap_ops_need_a_session(raw, name):
    sent = msgpack.unpackb(GOLDEN[name], raw=False)
    assert_error(reply(raw, GOLDEN[name]), 8, sent[1])


def test_hello_version_mismatch_then_welcome(raw):
    assert_error(reply(raw, encode(m.Hello(2, os.getpid()), 41)), 7, 41)
    tag, rid, body = reply(raw, encode(m.Hello(1, os.getpid(), "raw"), 42))
    assert (tag, rid) == ("welcome", 42)
    assert body["version"] == 1 and body["max_message"] == m.MAX_MESSAGE_BYTES
    assert isinstance(body["heartbeat_s"], float) and body["client_id"] >= 1
    # Now in a session: an unknown registration is UNKNOWN_NAMESPACE, not NOT_CONNECTED.
    assert_error(reply(raw, GOLDEN["lookup"]), 5, 7)
    assert reply(raw, GOLDEN["bye"]) == ["ok", 255, {}]
