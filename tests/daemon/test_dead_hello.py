"""A HELLO whose sender is already dead leaves no session behind.

The daemon takes a local client's pid from the kernel (SO_PEERCRED on the
connection), never from the HELLO. A worker SIGKILLed with its HELLO in
flight is either refused (its connection is gone, so the kernel cannot say
who it was) or registered under its real pid and reaped by that pid at once,
not after reap_after_s.
"""

from __future__ import annotations

import subprocess
import sys
import time

import zmq

from kvtier.protocol import decode, encode
from kvtier.protocol import messages as m
from tests.conftest import REPO
from tests.daemon.test_reaping import wait_for

SEND_HELLO_AND_DIE = """
import os, sys, zmq
from kvtier.protocol import encode
from kvtier.protocol import messages as m
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect("ipc://" + sys.argv[1])
s.send(encode(m.Hello(m.PROTOCOL_VERSION, 999999, "ghost"), 1))  # a lying pid, too
s.poll(2000, zmq.POLLOUT)
os._exit(0)
"""


def test_hello_from_a_dead_process_leaves_no_session(daemon):
    gone = subprocess.run([sys.executable, "-c", SEND_HELLO_AND_DIE, daemon.socket],
                          env={"PYTHONPATH": REPO}, timeout=60)
    assert gone.returncode == 0
    # reap_after_s is 5 s; the pid check (every 0.1 s here) must win by far.
    assert wait_for(lambda: not daemon.stats()["clients"], 3)
    assert "pid=999999" not in daemon.read_log()  # the HELLO's pid was never believed


def test_a_local_session_carries_the_kernels_pid_not_the_hellos(daemon):
    import os
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect("ipc://" + daemon.socket)
    s.send(encode(m.Hello(m.PROTOCOL_VERSION, 2**31, "liar"), 2))  # 2**31 once stopped all reaping
    assert isinstance(decode(s.recv())[1], m.Welcome)
    time.sleep(0.5)  # several reap passes
    rows = [c for c in daemon.stats()["clients"] if c["name"] == "liar"]
    assert [(c["pid"], c["uid"]) for c in rows] == [(os.getpid(), os.getuid())]
    assert "reaping client" not in daemon.read_log()
    s.close(0)
