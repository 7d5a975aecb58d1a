"""A self-pipe waker: any thread (or a signal handler) makes a poll return.

Its ``fd`` goes into the poller next to the sockets; ``wake()`` is safe from
signal handlers and never blocks (a full pipe already means "wake up");
``clear()`` empties it and returns what was written, so callers can tell
reasons apart by the bytes they wrote.
"""

from __future__ import annotations

import os


class Waker:
    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        return self._r

    def wake(self, why: bytes = b"x") -> None:
        try:
            os.write(self._w, why)
        except OSError:  # full (a wake-up is already pending) or closed at shutdown
            pass

    def clear(self) -> bytes:
        out = b""
        try:
            while chunk := os.read(self._r, 4096):
                out += chunk
        except BlockingIOError:
            pass
        return out

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class Inbox:
    """Results handed from worker threads to a poll loop: ``put`` queues one and
    wakes the loop; the loop, woken on ``fd``, takes them all with ``take_all``."""

    def __init__(self):
        import queue
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._empty = queue.Empty
        self._waker = Waker()

    @property
    def fd(self) -> int:
        return self._waker.fd

    def put(self, item) -> None:
        self._queue.put(item)
        self._waker.wake()

    def take_all(self) -> list:
        self._waker.clear()  # before reading: a put racing with us leaves a wake-up behind
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except self._empty:
                return out

    def close(self) -> None:
        self._waker.close()
