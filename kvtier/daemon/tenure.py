"""Full garbage collections that stay short however many blocks the daemon holds.

Every block the daemon holds is a tracked Python object (its ``pool.entry.Entry``;
the disk tier's index entries too), and CPython's full collection (generation
2) walks every tracked object that is not frozen: 540-650 ms of the loop thread
at 2.25M entries (BENCHMARKS.md 18.7), about 9 s at 32M (docs/SCALE.md), each
time the tracked objects grew by a quarter since the last one. The daemon
freezes what exists when it starts (``main.py``); before this, every block
stored later was walked again by every full pass.

``Tenure.install()`` hooks the collector's own callback: when a full
collection ends, everything that survived it (the pass has just found it
reachable) moves to the permanent generation (``gc.freeze()``, a splice of
lists: O(1)). The next full pass walks only what was promoted since the last
one, so its work is bounded by what the daemon allocated in between, not by
the pool. CPython runs a full pass once ``threshold2`` young-generation
passes have run (and the survivors grew by a quarter: they are few now); at
its default, 10, that is ~70,000 net allocations, whose walk took 21-32 ms
under the trace replay (BENCHMARKS.md 18.9), so tenure sets it to
``FULL_EVERY`` = 2 (~14,000: a few ms). The collector's total work stays the
same: each object is walked in a full pass once, then frozen.

The price: a frozen object is still freed by reference counting the moment
nothing refers to it, but one that later becomes part of a garbage *cycle*
is never collected. The daemon's long-lived objects do not leave cycles when
they go (an entry's LRU links are cleared when it leaves the order, a bucket
is forgotten only when empty; tests/daemon/test_tenure.py churns entries,
clients, flushes and disk blocks and audits). ``audit()`` (SIGUSR1, logged)
measures it on a running daemon: a full pass over the unfrozen objects,
then one over everything (a pause as long as before this module, at the
operator's request), reporting what the second found. ``gc_freeze = false``
leaves the collector as CPython ships it.

Primitives: ``Tenure()``, ``.install()``, ``.uninstall()``, ``.stats() -> dict``,
``.audit() -> dict`` (loop thread).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter

log = logging.getLogger("kvtier.daemon")
FULL_EVERY = 2  # generation-1 passes per full pass while installed (CPython's default: 10)


class Tenure:
    def __init__(self) -> None:
        self.installed = False
        self.full_passes = 0      # full collections seen since install
        self.last_ms = 0.0        # wall time of the last full collection
        self.longest_ms = 0.0     # and of the longest
        self._started = 0.0
        self._thresholds: tuple | None = None  # CPython's, while installed

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self._on_collect)
            self._thresholds = gc.get_threshold()
            gc.set_threshold(self._thresholds[0], self._thresholds[1], FULL_EVERY)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._on_collect)
            gc.set_threshold(*self._thresholds)
            self.installed = False

    def _on_collect(self, phase: str, info: dict) -> None:
        # Runs inside the collector, on whichever thread allocated last: no locks, no logging,
        # nothing that walks a generation (gc.get_freeze_count is O(frozen objects)).
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self.full_passes += 1
        self.last_ms = ms
        self.longest_ms = max(self.longest_ms, ms)
        gc.freeze()  # the survivors of this pass: the collector's lists are whole again by "stop"

    def stats(self) -> dict:
        # Not gc.get_freeze_count(): it walks the frozen list, 0.7 s at 2.5M objects (the audit's only).
        return {"tenure": self.installed, "full_passes": self.full_passes,
                "last_full_ms": round(self.last_ms, 3), "longest_full_ms": round(self.longest_ms, 3)}

    def audit(self) -> dict:
        """What freezing has kept alive: garbage cycles among frozen objects. A full
        pass over the unfrozen objects first (their cycles are not tenure's doing),
        then one over everything; re-frozen after. Holds the calling thread for a
        full pass over every object: an operator's tool, not a periodic task."""
        hooked = self.installed
        if hooked:
            gc.callbacks.remove(self._on_collect)  # not counted, not frozen mid-audit
        kinds: Counter = Counter()
        try:
            t0 = time.perf_counter()
            young = gc.collect()
            frozen = gc.get_freeze_count()
            gc.unfreeze()
            t1 = time.perf_counter()
            gc.set_debug(gc.DEBUG_SAVEALL)  # kept in gc.garbage, so the log can say what they were
            try:
                leaked = gc.collect()
            finally:
                gc.set_debug(0)
            t2 = time.perf_counter()
            kinds.update(type(o).__qualname__ for o in gc.garbage)
            gc.garbage.clear()
            if leaked:
                gc.collect()  # now freed
            gc.freeze()
        finally:
            if hooked:
                gc.callbacks.append(self._on_collect)
        out = {"unfrozen_cycles": young, "frozen_before": frozen, "frozen_cycles": leaked,
               "unfrozen_ms": round((t1 - t0) * 1e3, 1),
               "all_ms": round((t2 - t1) * 1e3, 1), "kinds": dict(kinds.most_common(8))}
        log.info("gc audit: %d objects in garbage cycles among %d frozen (freed now; a full pass "
                 "over every object took %.1f ms), %d among the unfrozen; kinds %s", leaked, frozen,
                 out["all_ms"], young, out["kinds"])
        return out
