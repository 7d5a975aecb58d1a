"""What a client's lookup mirror answered, counted for the daemon.

Lookups answered from shared memory never reach the daemon, so the client
counts them (lookups, hashes asked, hashes hit) and the connection reports
the counts since its last report ahead of its next request (``LookupsAnswered``,
sent without waiting for its reply: no round trip; ahead of a store or load at
most every ``connection.REPORT_EVERY`` s), on its heartbeat (in place of that
beat's ping), on ``ping``, ``stats`` and ``flush`` and before it closes; the daemon adds them to
the counters socket lookups use (``daemon/answered.py``). Counts taken for a
report that fails are given back and go with the next one; those of a
session that is lost are dropped with it (its registrations are gone).

Primitives: ``Tally().add(keys, hits)``, ``.take() -> (lookups, keys, hits)``, ``.give_back(counts)``.
"""

from __future__ import annotations

import threading


class Tally:
    def __init__(self):
        self._lock = threading.Lock()  # the engine's thread adds, the heartbeat thread takes
        self.lookups = self.keys = self.hits = 0

    def add(self, keys: int, hits: int) -> None:
        with self._lock:
            self.lookups += 1
            self.keys += keys
            self.hits += hits

    def take(self) -> tuple[int, int, int]:
        with self._lock:
            out = (self.lookups, self.keys, self.hits)
            self.lookups = self.keys = self.hits = 0
        return out

    def give_back(self, counts: tuple[int, int, int]) -> None:
        with self._lock:
            self.lookups += counts[0]
            self.keys += counts[1]
            self.hits += counts[2]
