"""The copy worker takes turns: a job of many steps runs one step per turn,
round-robin between owners, so one client's big copy never holds another
client's small one behind it; with several threads, owners' jobs run at the
same time, and one job's steps never overlap.

In-process, real threads; every ordering is forced with events, no timing.
"""

from __future__ import annotations

import threading

from kvtier.transfer.worker import CopyWorker


def finished_in_order(worker: CopyWorker) -> list:
    """Tokens of the jobs that ended, in the order they ended, with their errors."""
    assert worker.drain(30), "jobs still pending after 30 s"
    return worker.completed()


def test_a_small_job_sent_after_a_big_one_of_another_owner_ends_first():
    worker = CopyWorker(threads=1)
    started, go, steps_run = threading.Event(), threading.Event(), []

    def big():
        for i in range(50):  # 50 chunks of one big load
            if i == 0:
                started.set()
                assert go.wait(30)
            steps_run.append(i)
            yield

    worker.submit_steps("big", big(), owner="client-a")
    assert started.wait(30)  # the big job holds the only thread
    worker.submit("small", lambda: None, owner="client-b")
    go.set()
    done = finished_in_order(worker)
    assert [token for token, _ in done] == ["small", "big"]
    assert [error for _, error in done] == [None, None]
    assert steps_run == list(range(50))  # every step ran, in order
    worker.close()


def test_one_owners_jobs_still_end_in_the_order_it_sent_them_on_one_thread():
    worker = CopyWorker(threads=1)
    gate = threading.Event()

    def steps(n, first=False):
        for i in range(n):
            if first and i == 0:
                assert gate.wait(30)
            yield

    worker.submit_steps("first", steps(5, first=True), owner="a")
    worker.submit_steps("second", steps(1), owner="a")
    worker.submit_steps("third", steps(3), owner="a")
    gate.set()
    assert [token for token, _ in finished_in_order(worker)] == ["first", "second", "third"]
    worker.close()


def test_two_owners_jobs_run_at_the_same_time_on_two_threads():
    worker = CopyWorker(threads=2)
    both = threading.Barrier(2, timeout=30)  # passes only if both copies are inside at once

    def copy():
        both.wait()
        yield

    worker.submit_steps("a", copy(), owner="client-a")
    worker.submit_steps("b", copy(), owner="client-b")
    done = finished_in_order(worker)
    assert sorted(token for token, _ in done) == ["a", "b"]
    assert [error for _, error in done] == [None, None]  # nobody broke the barrier waiting
    worker.close()


def test_a_jobs_steps_never_overlap_on_many_threads():
    worker = CopyWorker(threads=4)
    inside, overlaps, lock = set(), [], threading.Lock()

    def steps(token):
        for _ in range(200):
            with lock:
                overlaps.append(token in inside)
                inside.add(token)
            with lock:
                inside.discard(token)
            yield

    for i in range(6):
        worker.submit_steps(f"job-{i}", steps(f"job-{i}"), owner=f"client-{i % 3}")
    done = finished_in_order(worker)
    assert sorted(token for token, _ in done) == [f"job-{i}" for i in range(6)]
    assert len(overlaps) == 1200 and not any(overlaps)
    worker.close()


def test_a_step_that_raises_ends_its_job_with_that_error_and_runs_nothing_after_it():
    worker = CopyWorker(threads=2)
    ran = []

    def broken():
        ran.append(1)
        yield
        ran.append(2)
        raise ValueError("pool offset out of range")
        yield  # never reached
        ran.append(3)

    worker.submit_steps("broken", broken(), owner="a")
    worker.submit("plain", lambda: 1 / 0, owner="b")
    worker.submit("fine", lambda: None, owner="b")
    done = dict(finished_in_order(worker))
    assert isinstance(done["broken"], ValueError) and isinstance(done["plain"], ZeroDivisionError)
    assert done["fine"] is None and ran == [1, 2]
    assert worker.pending == 0
    worker.close()


def test_close_runs_every_step_already_queued():
    worker = CopyWorker(threads=2)
    counted = []

    def steps(n):
        for i in range(n):
            counted.append(i)
            yield

    for owner in range(4):
        worker.submit_steps(owner, steps(10), owner=owner)
    worker.close()
    assert len(counted) == 40
