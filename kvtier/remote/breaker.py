"""Circuit breaker for the remote tier. Sans-IO: the caller passes the time.

closed   every call goes out; ``failures`` consecutive failures open it.
open     no call goes out (callers answer locally at once) until ``cooldown``
         passed; then one trial may go out (half-open).
half-open  the trial's success closes the breaker, its failure reopens it
         with the cooldown doubled (capped at ``max_cooldown``).

Primitives: ``allow(now) -> bool``, ``success()``, ``failure(now)``, ``state``.
"""

from __future__ import annotations

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class Breaker:
    def __init__(self, failures: int = 3, cooldown: float = 1.0, max_cooldown: float = 30.0):
        self.threshold, self.base, self.max_cooldown = failures, cooldown, max_cooldown
        self.state = CLOSED
        self.consecutive = 0
        self.cooldown = cooldown
        self.reopen_at = 0.0
        self.opened = 0            # times it opened, for stats

    def allow(self, now: float) -> bool:
        """May a call go out now? In open state, the first call after the cooldown
        becomes the half-open trial; others keep being refused until it reports."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN and now >= self.reopen_at:
            self.state = HALF_OPEN
            return True
        return False

    def success(self) -> None:
        self.state, self.consecutive, self.cooldown = CLOSED, 0, self.base

    def failure(self, now: float) -> None:
        self.consecutive += 1
        if self.state == HALF_OPEN:
            self.cooldown = min(self.cooldown * 2, self.max_cooldown)
            self._open(now)
        elif self.state == CLOSED and self.consecutive >= self.threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = OPEN
        self.reopen_at = now + self.cooldown
        self.opened += 1
