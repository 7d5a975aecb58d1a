"""A hostile local user for the flood tests and ``scripts/bench_attacks.py``.

``python flood_worker.py ROLE SOCKET [UID] [N]`` imports what it needs, drops
to UID for good (as ``tenant_worker.py`` does), attacks, prints one JSON line
with what it got, then holds everything it made until a line arrives on
stdin (so the caller measures the daemon mid-attack), and exits. Roles:

  registrations  N connections, each registering up to 64 caches of 16
                 handed-over descriptors (the unit's whole LimitNOFILE when
                 every registration kept a dup of each)
  transfers      N loads repeating one hash and one block 65,536 times,
                 then N/10 heavy loads (65,536 distinct blocks each), sent
                 without waiting for the answers
  handovers      N hand-over connections that never send anything, reopened
                 as soon as the daemon closes them
  lookups        1M-hash lookup frames (as large as max_message allows), at
                 most N unanswered (0: as fast as the socket takes them),
                 until stdin has a line
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import sys
import time
from collections import Counter

sys.path.insert(0, os.environ.get("KVTIER_REPO") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

import zmq  # noqa: E402

from kvtier.client.handover import hand_over  # noqa: E402
from kvtier.protocol import decode, encode, pack_ids  # noqa: E402
from kvtier.protocol import messages as m  # noqa: E402
from tests.privileges import drop_to  # noqa: E402

MAX_MESSAGE = 16 * 2**20


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def memfd(size: int) -> int:
    fd = os.memfd_create("flood", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def spec(i: int, blocks: int, block_bytes: int) -> dict:
    return {"kind": "fd", "fd": i, "offset": 0, "dtype": "uint8", "shape": [blocks, block_bytes],
            "stride": [block_bytes, 1], "block_dim": 0}


class Session:
    """A raw ZeroMQ session: what a client does, without the client's manners."""

    def __init__(self, path: str, name: str, rcvhwm: int = 100_000):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.connect("ipc://" + path)
        self.next_id = 0
        self.welcome = self.call(m.Hello(m.PROTOCOL_VERSION, 0, name))

    def send(self, msg) -> None:
        self.next_id += 1
        self.sock.send(encode(msg, self.next_id))

    def recv(self):
        try:
            return decode(self.sock.recv())[1]
        except zmq.Again:
            return "no answer"

    def call(self, msg):
        self.send(msg)
        return self.recv()


def outcome(reply) -> str:
    if isinstance(reply, str):
        return reply
    return type(reply).__name__ if not isinstance(reply, m.Error) else f"error {reply.code}"


def registrations(path: str, conns: int) -> None:
    fds = [memfd(16 * 4096) for _ in range(16)]
    specs = [spec(i, 16, 4096) for i in range(16)]
    got: Counter = Counter()
    sessions = []
    for c in range(conns):
        s = Session(path, f"regs-{c}")
        sessions.append(s)
        if not isinstance(s.welcome, m.Welcome):
            got["hello " + outcome(s.welcome)] += 1
            continue
        for r in range(64):
            try:
                ticket = hand_over(path, fds)
            except Exception as exc:  # the hand-over itself refused
                got[f"handover {type(exc).__name__}"] += 1
                continue
            got[outcome(s.call(m.Register("flood", specs, ticket=ticket)))] += 1  # one namespace: its cap is not the point
    say(step="attacked", outcomes=dict(got))
    sys.stdin.readline()


def transfers(path: str, n: int) -> None:
    """``n`` loads repeating one hash and one block 65,536 times, then
    ``n // 10`` heavy loads of 65,536 distinct blocks, none waited for."""
    blocks = 65536
    fd = memfd(blocks * 8)
    s = Session(path, "transfers")
    reg = s.call(m.Register("flood-transfers", [spec(0, blocks, 8)], ticket=hand_over(path, [fd])))
    hashes = os.urandom(16 * blocks)
    ids = pack_ids(range(blocks))
    stored = s.call(m.Store(reg.reg, hashes, ids))
    dup = m.Load(reg.reg, hashes[:16] * blocks, pack_ids([0] * blocks))
    heavy = m.Load(reg.reg, hashes, ids)
    start = time.monotonic()
    for i in range(n + n // 10):
        s.send(dup if i < n else heavy)
    say(step="attacked", stored=outcome(stored), sent=n + n // 10, sent_s=round(time.monotonic() - start, 2))
    sys.stdin.readline()  # the caller measures now, with every answer still unread
    got: Counter = Counter()
    s.sock.setsockopt(zmq.RCVTIMEO, 600_000)
    for i in range(n + n // 10):
        got[("duplicate " if i < n else "heavy ") + outcome(s.recv())] += 1
    say(step="answered", outcomes=dict(got))


def handovers(path: str, n: int) -> None:
    held: list[socket.socket] = []
    opened = 0
    said = False
    while True:
        while len(held) < n:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                c.connect(path + ".fd")
            except OSError:
                c.close()
                break
            held.append(c)
            opened += 1
        if not said and len(held) >= n:
            say(step="attacked", holding=len(held))
            said = True
        ready, _, _ = select.select([sys.stdin, *held], [], [], 0.05)
        if sys.stdin in ready:
            break
        for c in ready:  # the daemon closed it: open another
            held.remove(c)
            c.close()
    say(step="answered", opened=opened)


def lookups(path: str, window: int) -> None:
    """1M-hash lookups as fast as the daemon answers them, at most ``window``
    unanswered at a time (0: no limit, as fast as the socket takes them)."""
    fd = memfd(16 * 64)
    s = Session(path, "lookups", rcvhwm=1000)
    reg = s.call(m.Register("flood-lookups", [spec(0, 16, 64)], ticket=hand_over(path, [fd])))
    count = (MAX_MESSAGE - 64) // 16  # a frame just under max_message
    frame = encode(m.Lookup(reg.reg, os.urandom(16) * count), 1)  # sent zero-copy, one zmq message each
    say(step="attacked", hashes=count, frame_bytes=len(frame), window=window)
    sent = answered = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        if window and sent - answered >= window:
            if s.sock.poll(100):
                s.sock.recv(zmq.NOBLOCK)
                answered += 1
            continue
        try:
            s.sock.send(frame, zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)
        try:
            while True:
                s.sock.recv(zmq.NOBLOCK)
                answered += 1
        except zmq.Again:
            pass
    say(step="answered", sent=sent, answered=answered)
    # Leave without tearing the context down: with thousands of zero-copy
    # frames still referenced, pyzmq's gc thread and context term can wait on
    # each other for good ("pyzmq-gc send failed: Context was terminated", a
    # CI run hung 300 s here). The daemon, not this exit, is under test.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    role, path = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] != "-":
        drop_to(int(sys.argv[3]))
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    {"registrations": registrations, "transfers": transfers, "handovers": handovers,
     "lookups": lookups}[role](path, n)
