"""Case generators for the daemon fuzz test (tests/daemon/test_fuzz.py).

Every generator is driven by one seeded ``random.Random`` and yields ``Case``s
lazily, so a case built after the runner re-opened its session uses the new
registration id. A case either names the exact error code it must get
(``want``) or leaves the verdict to the local codec (``want=None``, see
``test_fuzz.oracle``): whatever the codec refuses, the daemon must refuse
with the same code; whatever it accepts must get its normal reply or a
client-side error, never INTERNAL.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Iterator

import msgpack

from kvtier.protocol import ErrorCode, encode, pack_hashes, pack_ids
from kvtier.protocol import messages as m
from kvtier.protocol.messages import as_wire_dict

FUZZ_NS = "fuzz-model|float16|flashinfer|bs4|tp0of1"
E = ErrorCode

# Values of every msgpack type, to put where another type is expected.
WRONG = [None, True, False, 0, 1, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300,
         b"", b"\x00" * 17, [], [1, "a"], {}, {"reg": 1}, msgpack.ExtType(5, b"\x01"),
         msgpack.Timestamp(0, 0)]
PY_TYPE = {"int": int, "str": str, "bytes": bytes, "bool": bool, "list": list, "dict": dict}
# Bytes that msgpack gives meaning to: headers of long strings/bins/arrays/maps, nil, never-used.
MAGIC = [0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xC0, 0xC1, 0xC4, 0xC6, 0xC9, 0xCF, 0xD3,
         0xDB, 0xDD, 0xDF, 0xFF]


@dataclass
class Ctx:
    """What the runner's session looks like right now."""
    reg: int = 0               # the fuzz session's own registration
    foreign_reg: int = 0       # a registration of another (well-behaved) client
    specs: list = field(default_factory=list)
    num_blocks: int = 16
    swapped: str = "fuzz-swapped"   # a request the session swapped out (2 blocks)
    max_message: int = m.MAX_MESSAGE_BYTES


@dataclass
class Case:
    kind: str                          # category, for the count
    frames: list                       # one ZeroMQ message: a single frame, or several
    want: ErrorCode | None = None      # exact error expected; None: the codec is the oracle
    fresh: bool = False                # send on a connection that never said HELLO


def rid(rng: random.Random) -> int:
    return rng.choice([0, 1, rng.randrange(1 << 16), rng.randrange(1 << 64)])


def hashes(rng, n: int) -> bytes:
    return pack_hashes(rng.randbytes(16 * n))


def ids(rng, ctx: Ctx, n: int) -> bytes:
    return pack_ids([rng.randrange(ctx.num_blocks) for _ in range(n)])


def templates(rng, ctx: Ctx) -> list:
    """One valid request of every type for the fuzz session (before mutation)."""
    return [
        m.Hello(m.PROTOCOL_VERSION, os.getpid(), "fuzz"), m.Register(FUZZ_NS, ctx.specs),
        m.Unregister(ctx.reg), m.Lookup(ctx.reg, hashes(rng, 3)),
        m.Store(ctx.reg, hashes(rng, 2), ids(rng, ctx, 2)), m.Load(ctx.reg, hashes(rng, 2), ids(rng, ctx, 2)),
        m.Offload(ctx.reg, [["r-" + str(rng.randrange(50)), ids(rng, ctx, 2)], ["r-x", ids(rng, ctx, 1)]]),
        m.Restore(ctx.reg, ctx.swapped, ids(rng, ctx, 2)), m.Discard(ctx.reg, "r-" + str(rng.randrange(50))),
        m.Stats(True), m.Flush(FUZZ_NS), m.Ping(), m.Bye(),
    ]


# ---- raw bytes and mutations ------------------------------------------------------------
def random_bytes(rng, n: int) -> Iterator[Case]:
    for _ in range(n):
        size = min(int(rng.expovariate(1 / 40)), 4096)
        yield Case("random", [rng.randbytes(size)])


def mutate(rng, frame: bytes, other: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        pos = rng.randrange(len(b) + 1)
        if op == 0:
            del b[pos:]                                   # truncate
        elif op == 1 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)                 # flip a bit
        elif op == 2 and b:
            b[rng.randrange(len(b))] = rng.choice(MAGIC)  # plant a msgpack header byte
        elif op == 3:
            b[pos:pos] = rng.randbytes(rng.randint(1, 8))  # insert
        elif op == 4:
            del b[pos:pos + rng.randint(1, 8)]            # delete
        elif op == 5:
            b[pos:pos] = b[pos:pos + rng.randint(1, 16)]  # duplicate a run
        else:
            cut = rng.randrange(len(other) + 1)
            b[pos:] = other[cut:]                         # splice with another request
    return bytes(b)


def mutated(rng, ctx: Ctx, n: int) -> Iterator[Case]:
    for _ in range(n):
        frames = [encode(t, rid(rng)) for t in templates(rng, ctx)]
        i = rng.randrange(len(frames))
        yield Case("mutated", [mutate(rng, frames[i], rng.choice(frames))])


def truncations(rng, ctx: Ctx) -> Iterator[Case]:
    """Every prefix of one valid frame of each request type."""
    for t in templates(rng, ctx):
        frame = encode(t, rid(rng))
        for cut in range(len(frame)):
            yield Case("truncated", [frame[:cut]])


# ---- types and framing -------------------------------------------------------------------
def wrong_types(rng, ctx: Ctx) -> Iterator[Case]:
    """Every field of every request with a value of every other type, and missing."""
    for t in templates(rng, ctx):
        body = as_wire_dict(t)
        for f in dataclasses.fields(t):
            name = f.name
            for v in WRONG:
                ok = PY_TYPE[f.type]
                if isinstance(v, ok) and (ok is bool or not isinstance(v, bool)):
                    continue
                yield Case("wrong-type", [_pack([t.TAG, rid(rng), {**body, name: v}])], E.BAD_MESSAGE)
            if f.default is dataclasses.MISSING:  # a required field, left out
                rest = {k: x for k, x in body.items() if k != name}
                yield Case("wrong-type", [_pack([t.TAG, rid(rng), rest])], E.BAD_MESSAGE)
        for bad_id in (-1, 1.0, "7", None, [1], 2**64 - 1 + 0.0):
            yield Case("wrong-type", [_pack([t.TAG, bad_id, body])], E.BAD_MESSAGE)
        for shape in ([t.TAG, 1], [t.TAG, 1, body, 0], {"tag": t.TAG}, [t.TAG.encode(), 1, body],
                      [t.TAG, 1, [body]], [t.TAG, 1, None]):
            yield Case("wrong-type", [_pack(shape)], E.BAD_MESSAGE)


def huge_headers(rng) -> Iterator[Case]:
    """msgpack headers that claim 4 GiB strings/bins/arrays/maps, alone and inside a request."""
    heads = [b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
             b"\xdf\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x05", b"\xc5\xff\xff", b"\xdc\xff\xff",
             b"\xde\xff\xff", b"\xc4\xff"]
    for head in heads:
        for tail in (b"", b"\x00" * 64):
            yield Case("huge-length", [head + tail], E.BAD_MESSAGE)
            # [ "lk", 5, {"reg": 1, "hashes": <head>...} ]
            prefix = b"\x93" + _pack("lk") + _pack(5) + b"\x82" + _pack("reg") + _pack(1) + _pack("hashes")
            yield Case("huge-length", [prefix + head + tail], E.BAD_MESSAGE)
            yield Case("huge-length", [b"\x93" + _pack("st") + _pack(6) + head + tail], E.BAD_MESSAGE)
    for depth in (200, 5000, 100_000):  # nesting beyond the unpacker's stack
        yield Case("huge-length", [b"\x91" * depth + b"\xc0"], E.BAD_MESSAGE)


def unknown_ops(rng) -> Iterator[Case]:
    replies = [m.Welcome(1, 1, 2.0, 100), m.Registered(1, 1, 512, 16), m.Hits(3), m.TransferDone(1),
               m.StatsReply({}), m.Flushed(0), m.Ok(), m.Error(1, "x")]
    for r in replies:  # well-formed, but a reply is not a request
        yield Case("unknown-op", [encode(r, rid(rng))], E.UNKNOWN_OP)
    tags = ["", "HI", "hello", "st ", "\x00", "x" * 10_000, "ping\x00", "\U0001f642"]
    tags += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
             for _ in range(40)]
    for tag in tags:
        if tag not in m.TABLE:
            yield Case("unknown-op", [_pack([tag, rid(rng), {}])], E.UNKNOWN_OP)


def multi_frame(rng, ctx: Ctx) -> Iterator[Case]:
    valid = encode(m.Ping(), 9)
    for n in range(2, 6):
        for _ in range(6):
            parts = [rng.choice([valid, b"", rng.randbytes(rng.randrange(64))]) for _ in range(n)]
            yield Case("multi-frame", parts, E.BAD_MESSAGE)


def over_limit(rng, ctx: Ctx) -> Iterator[Case]:
    """Frames just past the daemon's max_message (answered TOO_LARGE, not dropped)."""
    big = ctx.max_message + 1
    yield Case("over-limit", [b"\x00" * big], E.TOO_LARGE)
    yield Case("over-limit", [encode(m.Lookup(ctx.reg, b"\x00" * 16 * (big // 16 + 1)), 3)], E.TOO_LARGE)
    yield Case("over-limit", [encode(m.Ping(), 4) + rng.randbytes(big)], E.TOO_LARGE)
    yield Case("over-limit", [b"\x00" * (2 * ctx.max_message)], E.TOO_LARGE)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---- below ZeroMQ: raw bytes on the daemon's Unix socket ---------------------------------------
def zmtp_greeting(major=3, mechanism=b"NULL") -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + bytes([major, 0]) + mechanism.ljust(20, b"\x00") + bytes(32)


def zmtp_ready(socket_type=b"DEALER") -> bytes:
    body = b"\x05READY" + bytes([11]) + b"Socket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return b"\x04" + bytes([len(body)]) + body


def raw_streams(rng) -> Iterator[bytes]:
    """Byte streams that are not (valid) ZMTP: the daemon's ZeroMQ layer must drop
    the connection and keep serving everyone else."""
    hello = zmtp_greeting() + zmtp_ready()
    ping = encode(m.Ping(), 1)
    yield from (rng.randbytes(rng.randint(1, 2048)) for _ in range(12))
    yield zmtp_greeting()[:rng.randint(1, 63)]
    yield zmtp_greeting(major=1)
    yield zmtp_greeting(mechanism=b"CURVE") + zmtp_ready()
    yield zmtp_greeting(mechanism=b"\xff" * 20)
    yield zmtp_greeting() + zmtp_ready(b"PUB")                    # incompatible peer type
    yield hello + b"\x02" + (1 << 62).to_bytes(8, "big") + b"x" * 64  # a frame claiming 4 EiB
    yield hello + b"\x02" + (1 << 32).to_bytes(8, "big")              # a 4 GiB frame, never sent
    yield hello + b"\x06" + (1 << 40).to_bytes(8, "big")              # a 1 TiB command
    yield hello + b"\x01" + bytes([len(ping)]) + ping                 # 'more' set, then hang up
    yield hello + b"\x00" + bytes([len(ping) + 50]) + ping            # short frame, truncated
    yield hello + b"\x00" + bytes([len(ping)]) + ping                 # valid, then hang up unread
    yield hello + rng.randbytes(256)
