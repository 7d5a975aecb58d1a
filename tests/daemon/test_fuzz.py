"""Fuzz the daemon's socket: thousands of random, mutated and wrong frames.

A raw DEALER (no kvtier client) sends each case and must get exactly one
reply with the request id the frame carried: the error the local codec
predicts, the exact error the case names, or, for frames that happen to be
valid, the normal reply; never INTERNAL. Byte streams below ZeroMQ and frames
past the transport limit are dropped by ZeroMQ; the daemon must answer a
Ping afterwards. At the end a well-behaved client's blocks load back byte for
byte and the pool passes its integrity check.

Seeded (``SEED``); ``KVTIER_FUZZ_CASES`` raises the number of random and
mutated cases (default 4000). Run with ``-s`` to see the count per category.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import time
from collections import Counter

import zmq

from kvtier.client import Client, ShmKVCache
from kvtier.client.handover import hand_over
from kvtier.protocol import ErrorCode, ProtocolError, decode, encode, pack_ids
from kvtier.protocol import messages as m
from kvtier.protocol.errors import CLIENT_FAULT
from tests.helpers import NS, make_kv

from . import fuzz_args, fuzz_cases
from .fuzz_cases import FUZZ_NS, Case, Ctx

SEED = int(os.environ.get("KVTIER_FUZZ_SEED", "20240611"))
MAX_MESSAGE = 2 * 2**20
REPLIES = {m.Hello: m.Welcome, m.Register: m.Registered, m.Unregister: m.Ok, m.Lookup: m.Hits,
           m.Store: m.TransferDone, m.Load: m.TransferDone, m.Offload: m.TransferDone,
           m.Restore: m.TransferDone, m.Discard: m.Ok, m.Stats: m.StatsReply, m.Flush: m.Flushed,
           m.Ping: m.Ok, m.Bye: m.Ok}
SESSION_CHANGING = (m.Hello, m.Bye, m.Register, m.Unregister)


def oracle(frame: bytes) -> tuple[int, ErrorCode | None, object]:
    """What the daemon must answer, from the local codec: (request id, error code, message)."""
    try:
        rid, msg = decode(frame, MAX_MESSAGE)
    except ProtocolError as exc:
        return exc.request_id, exc.code, None
    if type(msg) not in REPLIES:  # a reply tag sent as a request
        return rid, ErrorCode.UNKNOWN_OP, None
    return rid, None, msg


class Fuzzer:
    """Sends cases on one session (HELLO + a registered cache + a swapped request),
    re-opening it whenever a case was a valid HELLO/BYE/REGISTER/UNREGISTER."""

    def __init__(self, path: str, ctx: Ctx, protect: set[str], daemon_alive, kv):
        self.endpoint, self.ctx, self.protect, self.daemon_alive = "ipc://" + path, ctx, protect, daemon_alive
        self.kv = kv  # the memory every REGISTER hands over (a fresh ticket each time)
        self.counts: Counter = Counter()
        self.reopened = self.accepted = 0
        self.sock = self.socket()
        self.open_session()

    def socket(self) -> zmq.Socket:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 10_000)
        s.connect(self.endpoint)
        return s

    def ask(self, sock, frames: list) -> tuple[int, object]:
        sock.send_multipart(frames)
        return decode(sock.recv(), 1 << 30)

    def open_session(self) -> None:
        assert isinstance(self.ask(self.sock, [encode(m.Hello(m.PROTOCOL_VERSION, os.getpid(), "fuzz"), 1)])[1],
                          m.Welcome)
        reg = self.ask(self.sock, [encode(m.Register(FUZZ_NS, self.ctx.specs, ticket=self.ticket()), 2)])[1]
        self.ctx.reg = reg.reg
        done = self.ask(self.sock, [encode(m.Offload(reg.reg, [[self.ctx.swapped, pack_ids([0, 1])]]), 3)])[1]
        assert done.done == 1, done

    def ticket(self) -> str:
        return hand_over(self.endpoint, self.kv.fds())

    def run(self, case: Case) -> None:
        if len(case.frames) == 1:
            want_rid, code, msg = oracle(case.frames[0])
        else:
            want_rid, code, msg = 0, ErrorCode.BAD_MESSAGE, None
        if isinstance(msg, m.Register) and not msg.ticket and not case.fresh:
            # A real client hands its memory over before every REGISTER: so does the fuzzer,
            # or every geometry variant would stop at "no memory handed over".
            msg = dataclasses.replace(msg, ticket=self.ticket())
            case = dataclasses.replace(case, frames=[encode(msg, want_rid)])
        if isinstance(msg, m.Flush) and msg.namespace in self.protect:
            self.counts["skipped (flush of protected data)"] += 1
            return
        sock = self.socket() if case.fresh else self.sock
        try:
            rid, reply = self.ask(sock, case.frames)
        except zmq.Again:
            state = "alive" if self.daemon_alive() else "DEAD"
            raise AssertionError(f"no reply (daemon {state}) to {case.kind} case {case.frames!r:.300}") from None
        finally:
            if case.fresh:
                sock.close(0)
        where = f"{case.kind} case {case.frames!r:.300} -> {reply!r:.300}"
        assert rid == want_rid, where
        if case.want is not None or code is not None:
            assert isinstance(reply, m.Error) and reply.code == (case.want or code), where
        else:
            ok = isinstance(reply, REPLIES[type(msg)]) or (
                isinstance(reply, m.Error) and reply.code in CLIENT_FAULT and reply.side == "client")
            assert ok, where
        if isinstance(reply, m.StatsReply) and "integrity" in reply.stats:
            assert reply.stats["integrity"] == "ok", where
        self.counts[case.kind] += 1
        self.accepted += msg is not None  # passed the codec: reached the handlers
        if isinstance(msg, SESSION_CHANGING) and not case.fresh and not isinstance(reply, m.Error):
            self.open_session()
            self.reopened += 1


def all_cases(rng: random.Random, ctx: Ctx, budget: int):
    yield from fuzz_args.before_hello(rng, ctx)
    yield from fuzz_cases.wrong_types(rng, ctx)
    yield from fuzz_cases.huge_headers(rng)
    yield from fuzz_cases.unknown_ops(rng)
    yield from fuzz_cases.multi_frame(rng, ctx)
    yield from fuzz_cases.over_limit(rng, ctx)
    yield from fuzz_cases.truncations(rng, ctx)
    yield from fuzz_args.bad_arguments(rng, ctx, budget // 5)
    yield from fuzz_args.odd_but_valid(rng, ctx, budget // 10)
    yield from fuzz_cases.random_bytes(rng, budget // 4)
    yield from fuzz_cases.mutated(rng, ctx, budget - budget // 5 - budget // 10 - budget // 4)


def ping(fuzzer: Fuzzer, sock=None, tries: int = 50) -> None:
    """The daemon answers a Ping (retrying while ZeroMQ reconnects a dropped socket)."""
    own = sock is None
    sock = sock or fuzzer.socket()
    sock.setsockopt(zmq.RCVTIMEO, 200)
    try:
        for i in range(tries):
            sock.send(encode(m.Ping(), 1000 + i))
            try:
                while True:  # skip a reply to an earlier, timed-out try
                    rid, reply = decode(sock.recv())
                    if rid == 1000 + i:
                        # Ok in a session; NOT_CONNECTED on a fresh or forgotten one. Either
                        # way the daemon is alive and answering.
                        assert isinstance(reply, m.Ok) or (isinstance(reply, m.Error) and reply.code == 8), reply
                        return
            except zmq.Again:
                continue
        raise AssertionError("daemon stopped answering pings")
    finally:
        if own:
            sock.close(0)


def dropped_connections(fuzzer: Fuzzer, path: str, rng: random.Random) -> int:
    """Cases ZeroMQ refuses before the daemon sees them; returns how many were sent."""
    n = 0
    for size in (4 * MAX_MESSAGE + 1, 5 * MAX_MESSAGE):  # past the transport's hard limit
        s = fuzzer.socket()
        s.send(bytes(size))
        assert s.poll(300) == 0, "an oversize frame must be dropped, not answered"
        ping(fuzzer, s)  # the same DEALER reconnects and is served again
        s.close(0)
        n += 1
    for payload in fuzz_cases.raw_streams(rng):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(path)
            try:
                raw.sendall(payload)
                raw.settimeout(0.05)
                raw.recv(256)  # whatever ZeroMQ says (its greeting), or the hang-up
            except OSError:
                pass  # reset or timed out: both fine
        n += 1
    ping(fuzzer)
    return n


def test_fuzz_the_daemon_socket(daemon_factory, record_property):
    d = daemon_factory(process=True, pool_size="64MiB", slab_size="4MiB", env={"KVTIER_MAX_MESSAGE": str(MAX_MESSAGE)})
    budget = int(os.environ.get("KVTIER_FUZZ_CASES", "4000"))
    rng = random.Random(SEED)
    good_kv, fuzz_kv = make_kv(seed=7), ShmKVCache([(16, 2, 4, 2, 16)])  # 16 KiB vs 512 B blocks
    hashes = [bytes([0xA0 + i]) * 16 for i in range(16)]
    with Client(d.socket, name="good") as good:
        # A well-behaved engine stores 16 blocks before the storm.
        good.register_kv_cache(good_kv, [0] * 4, NS)
        assert good.store(hashes, list(range(16))).wait().ok
        stored = [t[:16].clone() for t in good_kv.tensors]

        ctx = Ctx(foreign_reg=good.registration.reg, specs=fuzz_kv.specs([0]), max_message=MAX_MESSAGE)
        fuzzer = Fuzzer(d.socket, ctx, {"", NS.fingerprint()}, lambda: d.proc.poll() is None, fuzz_kv)
        t0 = time.monotonic()
        for case in all_cases(rng, ctx, budget):
            fuzzer.run(case)
        dropped = dropped_connections(fuzzer, d.socket, rng)
        elapsed = time.monotonic() - t0
        assert d.proc.poll() is None, "the daemon died"

        # The good engine's blocks are all there and byte-identical.
        for t in good_kv.tensors:
            t.fill_(0)
        assert good.lookup(hashes) == 16
        assert good.load(hashes, list(range(16))).wait().ok
        assert all(a.equal(t[:16]) for a, t in zip(stored, good_kv.tensors))
        fuzzer.ask(fuzzer.sock, [encode(m.Bye(), 9)])
        fuzzer.sock.close(0)
    s = d.stats(check=True)  # asserts integrity == "ok"
    assert "INTERNAL" not in s["errors"], s["errors"]
    answered = sum(v for k, v in fuzzer.counts.items() if not k.startswith("skipped"))
    total = answered + dropped
    print(f"\nfuzz: {total} cases in {elapsed:.1f} s (seed {SEED}): {answered} answered, "
          f"{dropped} dropped by ZeroMQ, {fuzzer.accepted} passed the codec, session re-opened "
          f"{fuzzer.reopened} times; {dict(sorted(fuzzer.counts.items()))}; daemon errors {s['errors']}")
    record_property("fuzz_cases", total)
    assert total >= budget
    good_kv.close()
    fuzz_kv.close()
