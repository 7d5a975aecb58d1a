"""Transfer latency histograms, kept by the poll loop (single thread, no locks).

An op's latency runs from when its request was accepted (``Op.started``) to
when its copy completed, so it includes time queued behind other copies: the
delay an engine actually sees. ``snapshot()`` returns fresh plain data (for
``stats()``, ``kvtier top`` and the Prometheus collector).
"""

from __future__ import annotations

from bisect import bisect_left

# Seconds. A 16 KiB block copies in microseconds; a multi-GiB swap in seconds.
BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistograms:
    def __init__(self, bounds: tuple[float, ...] = BOUNDS):
        self.bounds = bounds
        self._counts: dict[str, list[int]] = {}  # per kind: one slot per bound + overflow
        self._sums: dict[str, float] = {}

    def observe(self, kind: str, seconds: float) -> None:
        counts = self._counts.get(kind)
        if counts is None:
            counts = self._counts[kind] = [0] * (len(self.bounds) + 1)
            self._sums[kind] = 0.0
        counts[bisect_left(self.bounds, seconds)] += 1  # le semantics: v == bound counts in it
        self._sums[kind] += seconds

    def snapshot(self) -> dict:
        """{kind: {"count", "sum_s", "bounds", "cumulative"}}; cumulative[i] counts <= bounds[i]."""
        out = {}
        for kind, counts in self._counts.items():
            cumulative, running = [], 0
            for c in counts[:-1]:
                running += c
                cumulative.append(running)
            out[kind] = {"count": running + counts[-1], "sum_s": self._sums[kind],
                         "bounds": list(self.bounds), "cumulative": cumulative}
        return out
