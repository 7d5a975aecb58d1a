"""A HELLO that arrives after its sender died is reaped at once, not after reap_after_s."""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from kvtier.protocol import decode, encode
from kvtier.protocol import messages as m
from tests.daemon.test_reaping import wait_for


def test_hello_from_a_dead_pid_is_reaped_by_pid(process_daemon):
    daemon = process_daemon
    # A worker SIGKILLed right after sending HELLO: the daemon reads the HELLO
    # when the pid no longer exists, so it cannot record a start time.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect("ipc://" + daemon.socket)
    s.send(encode(m.Hello(m.PROTOCOL_VERSION, gone.pid, "ghost"), 1))
    assert isinstance(decode(s.recv())[1], m.Welcome)
    t0 = time.monotonic()
    # reap_after_s is 10 s; the pid check (every 0.1 s here) must win by far.
    assert wait_for(lambda: not daemon.stats()["clients"], 3)
    assert time.monotonic() - t0 < 3
    assert f"(pid {gone.pid}) reaped (process exited)" in daemon.read_log()
    # A remote client (pid 0) is still judged by its heartbeat only.
    s.send(encode(m.Hello(m.PROTOCOL_VERSION, 0, "remote"), 2))
    assert isinstance(decode(s.recv())[1], m.Welcome)
    time.sleep(0.5)
    assert [c["name"] for c in daemon.stats()["clients"]] == ["remote"]
    s.close(0)
