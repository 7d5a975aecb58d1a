"""Copies held until their worker's event fired, off the copy threads.

A CUDA store or load may carry a fence: the worker's interprocess event,
recorded on its stream after the kernels that wrote (or last read) the
blocks. The daemon must not copy before it fired. Waiting for it on a copy
thread would let one worker stall everyone: a worker that hangs, or dies
with its event never fired, would hold a copy thread until the fence
deadline (60 s) while other clients' copies queue behind it.

So fenced copies wait here instead: one thread polls every held fence
without blocking (``event.query()``, 5 µs .. 1 ms backoff) and hands a copy
to the copy worker only once its fence fired. A held copy leaves the gate
early as a failure when its op is cancelled (its client was reaped, it
timed out) or when its fence outlives the deadline; either way nothing
was queued on the GPU for it.

Nothing here touches CUDA: ``fired`` is any callable (the daemon passes the
copy engine's event query).

Primitives: ``FenceGate(release, timeout)`` with ``hold(token, owner, fired,
cancelled, run)``, ``pending``, ``wait_empty(timeout)``, ``close()``; ``FenceTimeout``;
``while_alive(fired, alive, cancel)``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .copy import Cancelled

log = logging.getLogger("kvtier.fences")
FENCE_TIMEOUT_S = 60.0
_MIN_DELAY, _MAX_DELAY = 5e-6, 1e-3


class FenceTimeout(RuntimeError):
    """The worker's event did not fire in time (worker dead or hung)."""


@dataclass
class _Held:
    token: Any
    owner: Any
    fired: Callable[[], bool]
    cancelled: threading.Event
    run: Callable[[], None]
    deadline: float


class FenceGate:
    def __init__(self, release: Callable[[Any, Callable[[], None], Any], None],
                 timeout: float = FENCE_TIMEOUT_S):
        """``release(token, fn, owner)`` hands a job to the copy worker: ``run``
        once the fence fired, or a function raising why it never will."""
        self.release, self.timeout = release, timeout
        self._held: list[_Held] = []
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="kvtier-fences", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._held)

    def hold(self, token, owner, fired: Callable[[], bool], cancelled: threading.Event,
             run: Callable[[], None]) -> None:
        with self._cv:
            self._held.append(_Held(token, owner, fired, cancelled, run, time.monotonic() + self.timeout))
            self._cv.notify()

    def _loop(self) -> None:
        delay = _MIN_DELAY
        while True:
            with self._cv:
                while not self._held and not self._closing:
                    self._cv.wait()
                    delay = _MIN_DELAY
                if self._closing and not self._held:
                    return
                held = list(self._held)
            left = [h for h in held if not self._settle(h)]
            with self._cv:
                # Keep what is still waiting plus whatever was held meanwhile.
                self._held = left + self._held[len(held):]
                if len(left) < len(held):
                    delay = _MIN_DELAY
                    self._cv.notify_all()  # wait_empty
                elif self._held:
                    self._cv.wait(delay)
                    delay = min(delay * 2, _MAX_DELAY)

    def _settle(self, h: _Held) -> bool:
        """Release ``h`` if its fate is known; True when it left the gate."""
        if h.cancelled.is_set() or self._closing:
            self.release(h.token, _raising(Cancelled("cancelled while waiting for the worker's event")), h.owner)
            return True
        try:
            fired = h.fired()
        except Exception as exc:  # the event cannot be opened or queried: the op fails alone
            self.release(h.token, _raising(exc), h.owner)
            return True
        if fired:
            self.release(h.token, h.run, h.owner)
            return True
        if time.monotonic() > h.deadline:
            why = FenceTimeout(f"worker event not done after {self.timeout:.0f}s (worker dead or hung)")
            self.release(h.token, _raising(why), h.owner)
            return True
        return False

    def wait_empty(self, timeout: float | None = None) -> bool:
        """Wait until nothing is held (every copy went to the worker); True if so."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._held, timeout)

    def close(self) -> None:
        """Release everything still held as cancelled and stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()


def while_alive(fired: Callable[[], bool], alive: Callable[[], bool],
                cancel: Callable[[str], None]) -> Callable[[], bool]:
    """``fired``, believed only while the worker that recorded the event lives.

    Once a worker dies, its interprocess event is gone and what a query of the
    daemon's imported copy says is undefined: an error (the op would end as a
    copy failure) or a spurious "fired", which would store blocks the worker
    was still writing. So a fire or an error counts only if the worker was
    still alive when it was seen (checked right after the query, so a fire
    seen then happened while it lived); otherwise the op is cancelled, as
    reaping would cancel it, and the gate releases it with nothing queued.
    The liveness check (a /proc read) runs only on a fire or an error, not on
    every poll."""
    def query() -> bool:
        try:
            ok = fired()
        except Exception:
            if not alive():
                cancel("the worker exited with its fence pending")
                return False
            raise
        if ok and not alive():
            cancel("the worker exited with its fence pending")
            return False
        return ok
    return query


def _raising(exc: BaseException) -> Callable[[], None]:
    def fail() -> None:
        raise exc
    return fail
