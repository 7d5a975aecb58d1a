"""The fence gate: fenced copies wait for their worker's event off the copy threads.

The gate only needs "has it fired?" from an event; on a GPU that is a CUDA
interprocess event's ``query()`` (``tests/transfer/test_cuda.py`` runs it
for real), here a host ``threading.Event`` plays the worker's event. The
copy worker is the daemon's real one, with its default single thread: the
property under test is that a worker whose event never fires holds no copy
thread, so other clients' copies run meanwhile.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.transfer.copy import Cancelled
from kvtier.transfer.fences import FenceGate, FenceTimeout
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
