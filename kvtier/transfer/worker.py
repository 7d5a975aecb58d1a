"""Copy worker: runs block copies off the daemon's control-loop thread.

Jobs start in submission order on background threads (torch releases the
GIL during copies, so the loop keeps answering lookups); with several threads
they may finish in any order. Each finished job is
queued and a byte is written to a pipe whose read end the daemon's poller
watches, so completions wake the loop without polling.

Primitives: ``submit(token, fn)``, ``completed() -> [(token, error)]``,
``wakeup_fd``, ``pending``, ``drain(timeout)``, ``close()``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from ..waker import Inbox


class CopyWorker:
    def __init__(self, threads: int = 1):
        self._jobs: queue.Queue = queue.Queue()
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

    def submit(self, token: Any, fn: Callable[[], None]) -> None:
        with self._idle:
            self._pending += 1
        self._jobs.put((token, fn))

    def completed(self) -> list[tuple[Any, BaseException | None]]:
        return self._done.take_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has run; True if none is left."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._done.close()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            token, fn = item
            error = None
            try:
                fn()
            except BaseException as exc:  # reported to the requester as failed blocks
                error = exc
            # Drop this job's closure before reporting it done and before
            # blocking on the next one: it holds tensor views over the client's
            # memory (for a CUDA cache, the worker's GPU memory stays mapped),
            # which must not outlive the registration or a drain.
            item = fn = None
            self._done.put((token, error))  # wakes the loop
            token = error = None
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
