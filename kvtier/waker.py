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
