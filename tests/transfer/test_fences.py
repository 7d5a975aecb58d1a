"""The fence gate: fenced copies wait for their worker's event off the copy threads.

The gate only needs "has it fired?" from an event; on a GPU that is a CUDA
interprocess event's ``query()`` (``tests/transfer/test_cuda.py`` runs it
for real), here a host ``threading.Event`` plays the worker's event. The
copy worker is the daemon's real one, with its default single thread: the
property under test is that a worker whose event never fires holds no copy
thread, so other clients' copies run meanwhile.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvtier.daemon.state import ClientState, process_start
from kvtier.transfer.copy import Cancelled
from kvtier.transfer.fences import FenceGate, FenceTimeout, while_alive
from kvtier.transfer.worker import CopyWorker


@pytest.fixture
def worker():
    w = CopyWorker(threads=1)
    yield w
    w.close()


def completions(worker: CopyWorker, want: set, timeout: float = 10.0) -> dict:
    got, deadline = {}, time.monotonic() + timeout
    while not want <= set(got):
        assert time.monotonic() < deadline, f"never completed: {want - set(got)}"
        got.update(worker.completed())
        time.sleep(0.002)
    return got


def test_a_copy_whose_worker_event_never_fires_holds_no_copy_thread(worker):
    gate = FenceGate(worker.submit)
    try:
        hung, ran = threading.Event(), []
        gate.hold("hung-worker", "client-a", hung.is_set, threading.Event(), lambda: ran.append("a"))
        worker.submit("other-client", lambda: ran.append("b"), "client-b")
        done = completions(worker, {"other-client"})
        assert done["other-client"] is None and ran == ["b"] and gate.pending == 1
        hung.set()  # the worker's kernels finish at last: its copy runs then
        assert completions(worker, {"hung-worker"})["hung-worker"] is None
        assert ran == ["b", "a"] and gate.pending == 0
    finally:
        gate.close()


def test_a_held_copy_cancelled_by_a_reap_leaves_without_running(worker):
    gate = FenceGate(worker.submit)
    try:
        cancelled, ran = threading.Event(), []
        gate.hold("dead-worker", "client-a", lambda: False, cancelled, lambda: ran.append("copied"))
        cancelled.set()  # the daemon reaped the dead worker's client
        error = completions(worker, {"dead-worker"})["dead-worker"]
        assert isinstance(error, Cancelled) and ran == []
    finally:
        gate.close()


def test_a_fence_past_its_deadline_fails_its_copy_alone(worker):
    gate = FenceGate(worker.submit, timeout=0.05)
    try:
        ran = []
        gate.hold("late", "a", lambda: False, threading.Event(), lambda: ran.append("late"))
        error = completions(worker, {"late"})["late"]
        assert isinstance(error, FenceTimeout) and "worker dead or hung" in str(error) and ran == []
    finally:
        gate.close()


def test_an_event_that_cannot_be_queried_fails_that_copy_and_no_other(worker):
    gate = FenceGate(worker.submit)
    try:
        def broken():
            raise RuntimeError("invalid resource handle")
        gate.hold("broken", "a", broken, threading.Event(), lambda: None)
        gate.hold("fine", "b", lambda: True, threading.Event(), lambda: None)
        done = completions(worker, {"broken", "fine"})
        assert isinstance(done["broken"], RuntimeError) and done["fine"] is None
    finally:
        gate.close()


def test_closing_the_gate_hands_what_it_holds_to_the_worker_as_cancelled(worker):
    gate = FenceGate(worker.submit)
    gate.hold("held", "a", lambda: False, threading.Event(), lambda: None)
    assert not gate.wait_empty(0.01)
    gate.close()
    assert gate.wait_empty(0) and isinstance(completions(worker, {"held"})["held"], Cancelled)


# ---- a dead worker's event is not believed ---------------------------------------------------

@pytest.fixture
def engine(worker):
    """A real engine process, the daemon's record of it (as HELLO makes it), the gate,
    and ``kill()``: the process is gone for good."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gate = FenceGate(worker.submit)

    def kill():
        p.kill()
        p.wait()
    try:
        yield ClientState(1, b"id", p.pid, "engine", process_start(p.pid)), gate, kill
    finally:
        gate.close()
        kill()


def test_a_fire_seen_after_the_worker_died_cancels_the_copy_instead_of_running_it(worker, engine):
    """Once a worker is gone, a query of its event may say "fired" while its
    kernels never finished writing: the copy must not run (it would store
    half-written blocks); the op leaves the gate cancelled, as a reap would."""
    client, gate, kill = engine
    cancelled, ran, why = threading.Event(), [], []

    def cancel(reason):
        why.append(reason)
        cancelled.set()
    spurious = threading.Event()  # the dead worker's event "fires"
    gate.hold("dead", "client-a", while_alive(spurious.is_set, client.process_alive, cancel), cancelled,
              lambda: ran.append("copied"))
    kill()
    spurious.set()
    error = completions(worker, {"dead"})["dead"]
    assert isinstance(error, Cancelled) and ran == [] and why == ["the worker exited with its fence pending"]


def test_a_query_error_after_the_worker_died_is_a_cancel_and_while_it_lives_a_failure(worker, engine):
    client, gate, kill = engine

    def gone():
        raise RuntimeError("CUDA error: invalid resource handle")
    live_cancel, dead_cancel = threading.Event(), threading.Event()
    # While the worker lives, a broken event is that op's failure (a forged handle).
    gate.hold("alive", "a", while_alive(gone, client.process_alive, lambda why: live_cancel.set()),
              live_cancel, lambda: None)
    error = completions(worker, {"alive"})["alive"]
    assert isinstance(error, RuntimeError) and not live_cancel.is_set()
    kill()
    gate.hold("dead", "a", while_alive(gone, client.process_alive, lambda why: dead_cancel.set()),
              dead_cancel, lambda: None)
    assert isinstance(completions(worker, {"dead"})["dead"], Cancelled)


def test_a_fire_while_the_worker_lives_runs_the_copy(worker, engine):
    client, gate, _kill = engine
    ran = []
    gate.hold("ok", "a", while_alive(lambda: True, client.process_alive, lambda why: None),
              threading.Event(), lambda: ran.append("copied"))
    assert completions(worker, {"ok"})["ok"] is None and ran == ["copied"]
