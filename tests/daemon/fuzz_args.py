"""Well-typed requests with invalid values, for the daemon fuzz test.

Each maker returns ``(message, expected error code)``: the codec accepts these
frames, so it is the daemon's validation that must refuse them, with the
right code and without touching anything.
"""

from __future__ import annotations

import random
from typing import Iterator

from kvtier.protocol import ErrorCode, encode, pack_ids
from kvtier.protocol import messages as m

from .fuzz_cases import FUZZ_NS, Case, Ctx, hashes, ids, rid, templates

E = ErrorCode
MAX_BLOCKS = 1 << 16


def bad_id(rng, ctx: Ctx) -> int:
    return rng.choice([-1, -(2**31), ctx.num_blocks, ctx.num_blocks + rng.randrange(1000), 2**31 - 1])


def ids_with_one_bad(rng, ctx: Ctx, n: int) -> bytes:
    good = [rng.randrange(ctx.num_blocks) for _ in range(n)]
    good[rng.randrange(n)] = bad_id(rng, ctx)
    return pack_ids(good)


def not_my_reg(rng, ctx: Ctx) -> int:
    """A registration id this session does not own: another client's, or made up."""
    return rng.choice([ctx.foreign_reg, 0, -1, ctx.reg + 1 + rng.randrange(100), 2**63 - 1, -(2**63)])


# ---- prefix-cache ops ------------------------------------------------------------------
def mismatched_lengths(rng, ctx):
    n = rng.randint(1, 8)
    k = rng.choice([x for x in range(0, 12) if x != n])
    op = rng.choice([m.Store, m.Load])
    return op(ctx.reg, hashes(rng, n), ids(rng, ctx, k)), E.BAD_ARGUMENT


def ids_out_of_range(rng, ctx):
    n = rng.randint(1, 8)
    op = rng.choice([m.Store, m.Load])
    return op(ctx.reg, hashes(rng, n), ids_with_one_bad(rng, ctx, n)), E.BAD_ARGUMENT


def hashes_wrong_size(rng, ctx):
    h = rng.randbytes(16 * rng.randint(0, 4) + rng.randint(1, 15))
    op = rng.choice([lambda: m.Lookup(ctx.reg, h), lambda: m.Store(ctx.reg, h, ids(rng, ctx, len(h) // 16)),
                     lambda: m.Load(ctx.reg, h, ids(rng, ctx, len(h) // 16))])
    return op(), E.BAD_ARGUMENT


def ragged_ids(rng, ctx):
    n = rng.randint(1, 4)
    blocks = rng.randbytes(4 * n + rng.randint(1, 3))
    return rng.choice([m.Store, m.Load])(ctx.reg, hashes(rng, n), blocks), E.BAD_ARGUMENT


def bad_skip(rng, ctx):
    n = rng.randint(1, 4)  # the session's block_factor is 1, so only skip=0 is valid
    return m.Load(ctx.reg, hashes(rng, n), ids(rng, ctx, n - 1), skip=rng.choice([1, -1, 2**40])), E.BAD_ARGUMENT


def foreign_registration(rng, ctx):
    reg = not_my_reg(rng, ctx)
    op = rng.choice([
        lambda: m.Lookup(reg, hashes(rng, 2)), lambda: m.Store(reg, hashes(rng, 1), ids(rng, ctx, 1)),
        lambda: m.Load(reg, hashes(rng, 1), ids(rng, ctx, 1)), lambda: m.Unregister(reg),
        lambda: m.Offload(reg, [["r", ids(rng, ctx, 1)]]), lambda: m.Restore(reg, ctx.swapped, ids(rng, ctx, 2)),
        lambda: m.Discard(reg, ctx.swapped)])
    return op(), E.UNKNOWN_NAMESPACE


# ---- request swap -----------------------------------------------------------------------
def malformed_offload_item(rng, ctx):
    ok = [rng.choice("abc") + str(rng.randrange(10**6)), ids(rng, ctx, 2)]
    bad = rng.choice([
        "r", 7, b"x", {"r": ok[1]}, None, [], [ok[0]], [ok[0], ok[1], 1], [7, ok[1]], [b"r", ok[1]],
        [ok[0], "ids"], [ok[0], [1, 2]], ["", ok[1]], ["x" * 257, ok[1]], [ok[0] + "!", b""],
        [ok[0] + "!", ids_with_one_bad(rng, ctx, 3)], [ok[0] + "!", b"\x00" * 5],
        [ok[0] + "!", pack_ids([0] * (MAX_BLOCKS + 1))], ok,  # the last one: a duplicate request id
    ])
    items = [ok] + [[f"q{i}", ids(rng, ctx, 1)] for i in range(rng.randrange(3))]
    items.insert(rng.randrange(1, len(items) + 1), bad)  # whole call refused, whatever the position
    return m.Offload(ctx.reg, items), E.BAD_ARGUMENT


def offload_count(rng, ctx):
    if rng.random() < 0.5:
        return m.Offload(ctx.reg, []), E.BAD_ARGUMENT
    return m.Offload(ctx.reg, [[f"r{i}", b"\x00\x00\x00\x00"] for i in range(4097)]), E.BAD_ARGUMENT


def bad_restore(rng, ctx):
    return rng.choice([
        m.Restore(ctx.reg, "never-offloaded-" + str(rng.randrange(100)), ids(rng, ctx, 2)),
        m.Restore(ctx.reg, ctx.swapped, ids(rng, ctx, rng.choice([0, 1, 3, 17]))),  # wrong count
        m.Restore(ctx.reg, ctx.swapped, ids_with_one_bad(rng, ctx, 2)),
        m.Restore(ctx.reg, ctx.swapped, b"\x01\x00\x00"),
        m.Discard(ctx.reg, "never-offloaded"), m.Discard(ctx.reg, ""),
    ]), E.BAD_ARGUMENT


# ---- registration and management --------------------------------------------------------
SPEC_BREAKS = [
    ("kind", "cuda"), ("kind", "shm"), ("fd", 1), ("fd", -1), ("fd", 64), ("fd", "0"), ("fd", None),
    ("fd", 2**40), ("offset", -1), ("shape", [0, 2, 4, 2, 16]),  # zero blocks: was INTERNAL
    ("offset", 2**40), ("offset", "0"), ("offset", 1), ("offset", True), ("dtype", "float17"),
    ("dtype", 3), ("dtype", None), ("shape", []), ("shape", [1] * 9), ("shape", "x"),
    ("shape", [-1, 2, 4, 2, 16]), ("shape", [10**6, 2, 4, 2, 16]), ("shape", [16, 2, 4, 2]),
    ("stride", [2**41, 1, 1, 1, 1]), ("stride", [1, 1]), ("stride", [1.0] * 5),
    ("block_dim", -1), ("block_dim", 5), ("block_dim", "0"), ("block_dim", None),
]


def bad_register(rng, ctx):
    spec = dict(ctx.specs[0])
    return rng.choice([
        m.Register("", ctx.specs), m.Register("n" * 1025, ctx.specs), m.Register(FUZZ_NS, []),
        m.Register(FUZZ_NS, ctx.specs, block_factor=rng.choice([0, -1, 1025, 2**62])),
        m.Register(FUZZ_NS, [spec, "not a spec"]), m.Register(FUZZ_NS, [[1, 2]]),
        m.Register(FUZZ_NS, [{**spec, "shape": [16, 4, 4, 2, 16], "stride": [512, 128, 32, 16, 1]}]),  # 2nd size
    ]), E.BAD_ARGUMENT


def bad_session(rng, ctx):
    return rng.choice([
        (m.Hello(rng.choice([0, 2, -1, 2**40]), 1, "fuzz"), E.VERSION_MISMATCH),  # session survives
        (m.Flush("no-such-namespace-" + str(rng.randrange(100))), E.UNKNOWN_NAMESPACE),
    ])


MAKERS = [mismatched_lengths, ids_out_of_range, hashes_wrong_size, ragged_ids, bad_skip,
          foreign_registration, malformed_offload_item, offload_count, bad_restore, bad_register,
          bad_session]


def bad_arguments(rng: random.Random, ctx: Ctx, n: int) -> Iterator[Case]:
    for key, value in SPEC_BREAKS:  # each broken tensor spec once
        yield Case("bad-argument", [encode(m.Register(FUZZ_NS, [{**ctx.specs[0], key: value}]), 1)],
                   E.BAD_ARGUMENT)
    yield Case("bad-argument", [encode(m.Lookup(ctx.reg, hashes(rng, MAX_BLOCKS + 1)), 1)], E.BAD_ARGUMENT)
    yield Case("bad-argument", [encode(m.Register(FUZZ_NS, ctx.specs * 4097), 2)], E.BAD_ARGUMENT)
    for i in range(n):
        msg, want = MAKERS[i % len(MAKERS)](rng, ctx)
        yield Case("bad-argument", [encode(msg, rid(rng))], want)


# ---- valid or not, the codec accepts them: normal reply or a client error, never INTERNAL ----
def spec_variant(rng, ctx):
    """A random tensor spec over the fuzz cache's segment (odd shapes, strides, dtypes)."""
    dims = rng.randint(1, 5)
    spec = {**ctx.specs[0], "dtype": rng.choice(["uint8", "float16", "bfloat16", "float32", "int64",
                                                  "float8_e4m3fn"]),
            "shape": [rng.choice([0, 1, 2, 3, 16, 17, 4096]) for _ in range(dims)],
            "stride": [rng.choice([0, 1, 2, 16, 128, 256, 8191]) for _ in range(dims)],
            "offset": rng.choice([0, 2, 4096, 8190, 8192]), "block_dim": rng.randrange(dims)}
    tensors = [spec] * rng.randint(1, 3)
    return m.Register(f"{FUZZ_NS}-v{rng.randrange(4)}", tensors, block_factor=rng.choice([1, 2, 3]))


def odd_requests(rng, ctx):
    """Edge cases that are allowed: duplicates, empty lists, aliasing ids."""
    h = rng.randbytes(16)
    return rng.choice([
        m.Store(ctx.reg, h * 3, ids(rng, ctx, 3)), m.Load(ctx.reg, h * 3, ids(rng, ctx, 3)),
        m.Lookup(ctx.reg, b""), m.Store(ctx.reg, b"", b""), m.Load(ctx.reg, b"", b""),
        m.Offload(ctx.reg, [["\U0001f642" + str(rng.randrange(9)), pack_ids([3, 3, 3])]]),
        m.Restore(ctx.reg, ctx.swapped, pack_ids([5, 5])), m.Lookup(ctx.reg, hashes(rng, MAX_BLOCKS)),
        spec_variant(rng, ctx),
    ])


def odd_but_valid(rng: random.Random, ctx: Ctx, n: int) -> Iterator[Case]:
    for _ in range(n):
        yield Case("odd-valid", [encode(odd_requests(rng, ctx), rid(rng))])


def before_hello(rng, ctx: Ctx) -> Iterator[Case]:
    """Every request on a connection that never said HELLO (each case a fresh one)."""
    for _ in range(3):
        for t in _session_ops(rng, ctx):
            yield Case("before-hello", [encode(t, rid(rng))], E.NOT_CONNECTED, fresh=True)
        for t in (m.Stats(False), m.Stats(True)):  # allowed without a session (no token set)
            yield Case("before-hello", [encode(t, rid(rng))], None, fresh=True)
        for t in (m.Ping(), m.Flush("nope")):  # a ping or a flush needs a session
            yield Case("before-hello", [encode(t, rid(rng))], E.NOT_CONNECTED, fresh=True)
        yield Case("before-hello", [encode(m.Hello(3, 1), 1)], E.VERSION_MISMATCH, fresh=True)


def _session_ops(rng, ctx):
    return [t for t in templates(rng, ctx) if not isinstance(t, (m.Hello, m.Stats, m.Flush, m.Ping))]
