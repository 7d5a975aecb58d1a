"""Malformed frames and wrong-typed fields get error replies; the daemon keeps serving."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvtier.protocol import ErrorCode, decode, encode, pack_hashes, pack_ids
from kvtier.protocol import messages as m
from tests.helpers import NS, make_kv, ticket_for


@pytest.fixture
def raw(daemon):
    """A bare DEALER socket speaking to the daemon, plus a registered cache id."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect("ipc://" + daemon.socket)
    yield s
    s.close(0)


def ask(sock, frame: bytes):
    sock.send(frame)
    return decode(sock.recv())


def hello_and_register(sock, kv, socket):
    assert isinstance(ask(sock, encode(m.Hello(m.PROTOCOL_VERSION, 0, "raw"), 1))[1], m.Welcome)
    rid, reg = ask(sock, encode(m.Register(NS.fingerprint(), kv.specs([0] * len(kv.tensors)),
                                           ticket=ticket_for(socket, kv)), 2))
    assert isinstance(reg, m.Registered), reg
    return reg.reg


def code_of(reply) -> ErrorCode:
    assert isinstance(reply, m.Error), reply
    return ErrorCode(reply.code)


def test_garbage_frames_get_typed_errors(daemon, raw):
    cases = [
        (b"\xc1", ErrorCode.BAD_MESSAGE),                                  # not msgpack
        (msgpack.packb([1, 2]), ErrorCode.BAD_MESSAGE),                    # wrong arity
        (msgpack.packb(["nope", 5, {}]), ErrorCode.UNKNOWN_OP),            # unknown tag
        (msgpack.packb(["hits", 6, {"hits": 1}]), ErrorCode.UNKNOWN_OP),   # a reply is not a request
        (msgpack.packb(["lk", 7, {"reg": "x", "hashes": b""}]), ErrorCode.BAD_MESSAGE),
        (msgpack.packb(["lk", 8, {"reg": True, "hashes": b""}]), ErrorCode.BAD_MESSAGE),
        (msgpack.packb(["lk", 9, {"hashes": b""}]), ErrorCode.BAD_MESSAGE),  # missing field
        (encode(m.Lookup(1, b""), 10), ErrorCode.NOT_CONNECTED),           # before HELLO
        (encode(m.Hello(99, 1), 11), ErrorCode.VERSION_MISMATCH),
        (b"\x00" * (m.MAX_MESSAGE_BYTES + 1), ErrorCode.TOO_LARGE),
    ]
    for frame, want in cases:
        rid, reply = ask(raw, frame)
        assert code_of(reply) == want, (frame[:20], reply)
    # request ids are echoed whenever the frame carried one
    assert ask(raw, msgpack.packb(["nope", 77, {}]))[0] == 77


def test_bad_arguments_on_a_registered_cache(daemon, raw):
    kv = make_kv(seed=0)
    reg = hello_and_register(raw, kv, daemon.socket)
    h = pack_hashes([bytes([i]) * 16 for i in range(4)])
    cases = [
        (m.Store(reg, h, pack_ids([0, 1, 2])), ErrorCode.BAD_ARGUMENT),          # 3 ids for 4 hashes
        (m.Store(reg, h, pack_ids([0, 1, 2, 999])), ErrorCode.BAD_ARGUMENT),     # id out of range
        (m.Store(reg, h, pack_ids([0, 1, -1, 2])), ErrorCode.BAD_ARGUMENT),      # negative id
        (m.Store(reg, h[:-1], pack_ids([0, 1, 2, 3])), ErrorCode.BAD_ARGUMENT),  # 63-byte hashes
        (m.Store(reg, h, b"\x00" * 15), ErrorCode.BAD_ARGUMENT),                 # ragged id array
        (m.Load(reg, h, pack_ids([0, 1, 2, 3]), skip=1), ErrorCode.BAD_ARGUMENT),  # skip >= factor
        (m.Lookup(reg + 100, h), ErrorCode.UNKNOWN_NAMESPACE),                   # not our cache
        (m.Flush("no-such-namespace"), ErrorCode.UNKNOWN_NAMESPACE),
        # Memory by name is gone for good (anyone could name anyone's segment):
        (m.Register("x", [{"kind": "shm", "seg": "/etc/passwd"}]), ErrorCode.BAD_ARGUMENT),
        (m.Register("x", [{"kind": "shm", "seg": "/kvtier-kv.1.missing", "offset": 0,
                           "dtype": "float16", "shape": [4], "stride": [1], "block_dim": 0}]),
         ErrorCode.BAD_ARGUMENT),
        (m.Register("x", kv.specs([0] * 4)), ErrorCode.BAD_ARGUMENT),             # no memory handed over
        (m.Register("x", kv.specs([0] * 4), ticket="f" * 32), ErrorCode.UNAUTHORIZED),  # forged ticket
        (m.Register("x", kv.specs([0] * 3 + [9]), ticket=ticket_for(daemon.socket, kv)),
         ErrorCode.BAD_ARGUMENT),                                                 # block_dim out of range
        (m.Register(NS.fingerprint(), kv.specs([1] * 4), ticket=ticket_for(daemon.socket, kv)),
         ErrorCode.BAD_ARGUMENT),                                                 # other block size, same ns
    ]
    for i, (msg, want) in enumerate(cases):
        rid, reply = ask(raw, encode(msg, 100 + i))
        assert rid == 100 + i
        assert code_of(reply) == want, (msg, reply)
    # a tensor spec whose extent lies outside its segment is refused
    spec = kv.specs([0] * 4)
    spec[0] = {**spec[0], "shape": [10**6] + spec[0]["shape"][1:]}
    reply = ask(raw, encode(m.Register("y", spec, ticket=ticket_for(daemon.socket, kv)), 200))[1]
    assert code_of(reply) == ErrorCode.BAD_ARGUMENT
    kv.close()


def test_daemon_keeps_serving_and_data_is_intact(daemon, raw):
    kv = make_kv(seed=3)
    with daemon.client(name="good") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        hashes = [bytes([i]) * 16 for i in range(8)]
        assert c.store(hashes, list(range(8))).wait().ok
        before = [t[:8].clone() for t in kv.tensors]
        # a stream of junk from another connection in the middle of real work
        for frame in (b"", b"\x93", msgpack.packb(["st", 1, {"reg": 1}]), b"\xff" * 1000):
            code_of(ask(raw, frame)[1])
        raw.send_multipart([b"a", b"b", b"c"])  # multi-frame message: error reply
        assert code_of(decode(raw.recv())[1]) == ErrorCode.BAD_MESSAGE
        for t in kv.tensors:
            t.zero_()
        assert c.lookup(hashes) == 8
        assert c.load(hashes, list(range(8))).wait().ok
        assert all(torch_equal(a, t[:8]) for a, t in zip(before, kv.tensors))
    s = daemon.stats()
    assert s["errors"]["BAD_MESSAGE"] >= 3
    kv.close()


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
