"""Pins of the wire contract: tags, fields, error codes, endpoints.

These tables are copied from PROTOCOL.md on purpose. Renaming a class, a
field or a code must not change the wire silently; when a change here is
intended, it is a protocol change (bump PROTOCOL_VERSION, update the spec).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.protocol import endpoints
from kvtier.protocol import messages as m
from kvtier.protocol.codec import error_reply
from kvtier.protocol.errors import ErrorCode, ProtocolError, side_of

M = dataclasses.MISSING
WIRE = {  # tag: (class, [(field, type, default)])
    "hi": ("Hello", [("version", "int", M), ("pid", "int", M), ("name", "str", ""), ("token", "str", "")]),
    "reg": ("Register", [("namespace", "str", M), ("tensors", "list", M), ("block_factor", "int", 1),
                         ("swap_quota", "int", -1),
                         ("ticket", "str", "")]),
    "unreg": ("Unregister", [("reg", "int", M)]),
    "lk": ("Lookup", [("reg", "int", M), ("hashes", "bytes", M)]),
    "st": ("Store", [("reg", "int", M), ("hashes", "bytes", M), ("blocks", "bytes", M), ("event", "bytes", b"")]),
    "lkm": ("LookupMany", [("reg", "int", M), ("chains", "list", M)]),
    "ld": ("Load", [("reg", "int", M), ("hashes", "bytes", M), ("blocks", "bytes", M), ("skip", "int", 0), ("event", "bytes", b""),
                    ("prefix", "bool", False)]),
    "off": ("Offload", [("reg", "int", M), ("requests", "list", M)]),
    "rst": ("Restore", [("reg", "int", M), ("request", "str", M), ("blocks", "bytes", M)]),
    "disc": ("Discard", [("reg", "int", M), ("request", "str", M)]),
    "stat": ("Stats", [("check", "bool", False)]),
    "flush": ("Flush", [("namespace", "str", "")]),
    "ping": ("Ping", []),
    "bye": ("Bye", []),
    "cancel": ("Cancel", [("request", "int", M)]),
    "seen": ("LookupsAnswered", [("counts", "list", M)]),
    "welcome": ("Welcome", [("version", "int", M), ("client_id", "int", M), ("heartbeat_s", "float", M),
                            ("max_message", "int", M), ("daemon_pid", "int", 0)]),
    "regd": ("Registered", [("reg", "int", M), ("namespace_id", "int", M), ("block_bytes", "int", M),
                            ("num_blocks", "int", M), ("index", "str", "")]),
    "hits": ("Hits", [("hits", "int", M)]),
    "hitsm": ("HitsMany", [("hits", "bytes", M)]),
    "done": ("TransferDone", [("done", "int", M), ("skipped", "int", 0), ("failed", "bytes", b""),
                              ("no_space", "bool", False), ("event", "bytes", b"")]),
    "stats": ("StatsReply", [("stats", "dict", M)]),
    "flushed": ("Flushed", [("removed", "int", M)]),
    "ok": ("Ok", []),
    "err": ("Error", [("code", "int", M), ("message", "str", M), ("side", "str", "client")]),
}
CODES = {  # value: (name, side)
    1: ("BAD_MESSAGE", "client"), 2: ("UNKNOWN_OP", "client"), 3: ("BAD_ARGUMENT", "client"),
    4: ("NO_SPACE", "daemon"), 5: ("UNKNOWN_NAMESPACE", "client"), 6: ("INTERNAL", "daemon"),
    7: ("VERSION_MISMATCH", "client"), 8: ("NOT_CONNECTED", "client"), 9: ("TOO_LARGE", "client"),
    10: ("UNAUTHORIZED", "client"), 11: ("SHUTTING_DOWN", "daemon"), 12: ("CANCELLED", "daemon"),
    13: ("OVER_LIMIT", "client"), 14: ("EXHAUSTED", "daemon"),
    15: ("NO_GPU", "daemon"),
}


def test_tag_table_is_pinned():
    got = {tag: (cls.__name__, [(f.name, f.type, f.default) for f in dataclasses.fields(cls)])
           for tag, cls in m.TABLE.items()}
    assert got == WIRE


def test_tags_are_unique_and_carried_by_their_class():
    assert len({cls for cls in m.TABLE.values()}) == len(m.TABLE)
    assert all(cls.TAG == tag for tag, cls in m.TABLE.items())


def test_a_duplicate_tag_cannot_be_registered():
    with pytest.raises(ValueError, match="duplicate"):
        @m.message("ping")
        class Another:
            pass
    assert m.TABLE["ping"] is m.Ping


def test_protocol_constants():
    assert m.PROTOCOL_VERSION == 1
    assert m.MAX_MESSAGE_BYTES == 16 * 1024 * 1024


def test_error_codes_and_sides_are_pinned():
    assert {int(c): (c.name, side_of(c)) for c in ErrorCode} == CODES


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_reply_carries_code_message_and_side(code):
    exc = ProtocolError(code, "why", request_id=7)
    reply = error_reply(exc)
    assert reply == m.Error(int(code), "why", CODES[int(code)][1])
    assert exc.side == reply.side and exc.request_id == 7
    assert str(exc) == f"{code.name}: why"


def test_endpoint_mapping():
    assert endpoints.endpoint("/run/kvtier/kvtier.sock") == "ipc:///run/kvtier/kvtier.sock"
    assert endpoints.endpoint("tcp://127.0.0.1:7070") == "tcp://127.0.0.1:7070"
    assert endpoints.endpoint("ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"


def test_default_socket_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_SOCKET", "/tmp/custom.sock")
    assert endpoints.default_socket() == "/tmp/custom.sock"
    monkeypatch.delenv("KVTIER_SOCKET")
    monkeypatch.setattr(endpoints.os.path, "isdir", lambda p: False)  # no /run/kvtier here
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert endpoints.default_socket() == "/run/user/1000/kvtier/kvtier.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    # Never under world-writable /tmp: whoever made the directory first would own the socket.
    assert endpoints.default_socket() == endpoints.os.path.expanduser("~/.kvtier/kvtier.sock")
