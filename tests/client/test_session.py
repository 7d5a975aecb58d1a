"""Client session loss: what an engine sees when the daemon forgets it."""

from __future__ import annotations

import signal
import threading
import time

import zmq

from kvtier.client import Client
from kvtier.protocol import decode, encode
from kvtier.protocol import messages as m
from tests.daemon.test_reaping import wait_for
from tests.helpers import NS, make_kv

SLOW_COPY = {"KVTIER_COPY_DELAY_S": "5"}  # every copy stalls 5 s: a store is still in flight


def test_a_forgotten_clients_transfer_ends_with_the_daemons_cancel_confirmation(daemon_factory):
    """The daemon forgets a client mid-store (here: a second HELLO on its
    connection, which starts a new session): it cancels the copy and still
    answers it once stopped, so the handle resolves soon (not after
    transfer_timeout) and only after nothing touches the blocks."""
    d = daemon_factory(process=True, env=SLOW_COPY)
    kv = make_kv(seed=2)
    hashes = [bytes([i]) * 16 for i in range(4)]
    c = d.client(name="restarting", heartbeat=False)
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        h = c.store(hashes, [0, 1, 2, 3])
        assert wait_for(lambda: d.stats(check=False)["clients"][0]["inflight"] == 1, 10)
        c.channel.call(m.Hello(m.PROTOCOL_VERSION, 0, "restarting", ""), timeout=10)
        r = h.wait(timeout=5)
        assert r.failed == (0, 1, 2, 3) and "cancelled" in r.error
        assert h.held_blocks == ()
        # Nothing is being written any more. The namespace itself may already be
        # gone: with the old session's registration forgotten and no block in it,
        # the reaper forgets it (forget_idle_namespaces) on its next turn.
        rows = d.stats()["namespaces"]
        assert [n["writing"] for n in rows] in ([], [0]), rows
    finally:
        c.close()
        kv.close()


class GarblingDaemon:
    """A peer that speaks the protocol but answers the first ``ping`` with a
    frame that is not msgpack: what a version skew or a daemon bug looks like
    from the client. A real ROUTER socket and the real codec, in a thread."""

    def __init__(self, path: str):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("ipc://" + path)
        self.hellos = 0
        self._garbled = False
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, frame = self.router.recv_multipart()
            rid, msg = decode(frame)
            if isinstance(msg, m.Hello):
                self.hellos += 1
                reply = encode(m.Welcome(m.PROTOCOL_VERSION, self.hellos, 0.2, m.MAX_MESSAGE_BYTES), rid)
            elif isinstance(msg, m.Ping) and not self._garbled:
                self._garbled = True
                reply = b"\xc1 not msgpack"
            else:
                reply = encode(m.Ok(), rid)
            self.router.send_multipart([identity, reply])

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.router.close(0)
        self.ctx.term()


def test_undecodable_reply_neither_raises_nor_stops_the_heartbeat(tmp_path):
    peer = GarblingDaemon(str(tmp_path / "garble.sock"))
    c = Client(str(tmp_path / "garble.sock"), name="engine", timeout=1.0)
    try:
        # The garbled ping reply is dropped, the ping times out, the session is
        # marked lost and the heartbeat thread reconnects (HELLO again).
        assert wait_for(lambda: c.reconnects == 1 and c.connected, 10)
        assert peer.hellos == 2 and c.keeper.alive
    finally:
        c.close()
        peer.close()


def test_register_while_the_daemon_is_gone_is_replayed_later(daemon_factory):
    # Heartbeats 3 s apart: the daemon dies before the client has noticed.
    slow = {"KVTIER_HEARTBEAT_S": "3", "KVTIER_REAP_AFTER_S": "10"}
    first = daemon_factory(process=True, env=slow)
    kv = make_kv(seed=4)
    hashes = [bytes([i]) * 16 for i in range(4)]
    c = first.client(name="engine", timeout=2.0)
    try:
        first.stop(signal.SIGKILL)
        # Still believed healthy, so the registration is sent and finds no
        # daemon: the engine gets None (degraded), not an exception ...
        assert c.register_kv_cache(kv, [0] * 4, NS) is None
        assert c.lookup(hashes) == 0
        # ... and once a daemon is back the heartbeat replays it.
        daemon_factory(process=True, socket=first.socket, env=slow)
        assert wait_for(lambda: c.connected, 15)
        assert c.store(hashes, [0, 1, 2, 3]).wait().ok
        assert c.lookup(hashes) == 4
    finally:
        c.close()
        kv.close()


def test_close_cancels_transfers_in_flight_and_waits_for_the_confirmation(daemon_factory):
    """close() does not leave a copy running behind the engine's back: it
    cancels, and the handle is resolved by the daemon's answer."""
    d = daemon_factory(process=True, env={"KVTIER_COPY_DELAY_S": "3"})
    kv = make_kv(seed=5)
    c = d.client(name="closing")
    try:
        c.register_kv_cache(kv, [0] * 4, NS)
        h = c.store([bytes([i]) * 16 for i in range(2)], [0, 1])
        t = time.monotonic()
        c.close()
        assert time.monotonic() - t < 2.0  # the 3 s copy stopped at its cancel
        assert h.done()  # resolved by close(), not after transfer_timeout (60 s)
        r = h.wait()
        assert r.failed == (0, 1) and "cancelled" in r.error
        assert not c.connected
    finally:
        c.close()
        kv.close()
