"""Copy worker: runs block copies off the daemon's control-loop thread.

Jobs run on background threads (torch and numpy release the GIL while bytes
move, so the loop keeps answering lookups and the threads copy in parallel),
taken round-robin between owners (the daemon passes the client) and in
submission order within one owner: a client with a hundred queued copies
delays another client's next copy by one of them, not by all.

A job is a sequence of steps (``submit_steps``; ``submit`` is a job of one):
a thread runs one step, then the job goes back to its owner's queue and the
next owner's job runs. So a client's 1 GiB load holds another client's
small one back by one step (one copy chunk), not by the whole gigabyte. A
job's steps never run at the same time; with several threads, jobs - and
one owner's jobs - may finish in any order.

Finished jobs go to an ``Inbox`` whose fd the daemon's poller watches, so
completions wake the loop without polling.

Primitives: ``submit(token, fn, owner)``, ``submit_steps(token, steps, owner)``,
``completed() -> [(token, error)]``, ``wakeup_fd``, ``pending``, ``drain(timeout)``, ``close()``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

from ..lanes import Lanes
from ..waker import Inbox


class CopyWorker:
    def __init__(self, threads: int = 1):
        self._jobs = Lanes()  # owner -> its jobs, in turn
        self._ready = threading.Condition()
        self._closing = False
        self._done = Inbox()
        self._pending = 0
        self._idle = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"kvtier-copy-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    @property
    def wakeup_fd(self) -> int:
        return self._done.fd

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, token: Any, fn: Callable[[], None], owner: Any = None) -> None:
        """A job of one step: ``fn()``."""
        self.submit_steps(token, _once(fn), owner)

    def submit_steps(self, token: Any, steps: Iterator, owner: Any = None) -> None:
        """A job whose every ``next(steps)`` is one turn; it ends when ``steps``
        is exhausted or raises (that exception is its error)."""
        with self._idle:
            self._pending += 1
        with self._ready:
            self._jobs.push(owner, (token, steps))
            self._ready.notify()

    def _take(self):
        """The next owner's oldest job: (owner, token, steps), or None once closing and empty."""
        with self._ready:
            while not len(self._jobs):
                if self._closing:
                    return None
                self._ready.wait()
            owner, (token, steps) = self._jobs.pop()
            return owner, token, steps

    def _requeue(self, owner: Any, token: Any, steps: Iterator) -> None:
        """A job with steps left goes back first in its owner's queue (its own
        order holds), behind every other owner's turn."""
        with self._ready:
            self._jobs.push_front(owner, (token, steps))
            self._ready.notify()

    def completed(self) -> list[tuple[Any, BaseException | None]]:
        return self._done.take_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; True if none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        self._done.close()

    def _run(self) -> None:
        while (item := self._take()) is not None:
            owner, token, steps = item
            error = None
            try:
                next(steps)
            except StopIteration:
                pass
            except BaseException as exc:  # reported to the requester as failed blocks
                error = exc
            else:
                self._requeue(owner, token, steps)
                item = owner = token = steps = None
                continue
            # Drop this job's closure before reporting it done and before
            # blocking on the next one: it holds tensor views over the client's
            # memory (for a CUDA cache, the worker's GPU memory stays mapped),
            # which must not outlive the registration or a drain.
            item = owner = steps = None
            self._done.put((token, error))  # wakes the loop
            token = error = None
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


def _once(fn: Callable[[], None]) -> Iterator[None]:
    fn()
    return
    yield  # a generator: calling _once runs nothing yet
