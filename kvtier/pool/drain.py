"""Flushes spread over many short steps: blocks hidden at once, freed a slice at a time.

Dropping a namespace's blocks one by one in a single call held the daemon's
loop 1.05 s for 10^6 blocks (every engine's lookup waited). A flush here
takes two phases:

  * ``start`` detaches each named namespace's ready map (an O(1) swap for a
    fresh, empty one) and clears its lookup mirror: from that moment no
    lookup, load, mirror reader or tier write-behind (``is_ready``) sees a
    block the flush covers. A chain can never be seen half removed, because
    none of it is seen at all.
  * ``step(n)`` frees at most ``n`` of the hidden entries (policy, journal,
    events, slot): the detached map is emptied with ``popitem`` (O(1) each,
    no snapshot of a million entries; in the table's order, which nobody sees). An entry
    a transfer holds (pinned) goes back to the ready map instead, as a flush
    always left held blocks.

While a namespace drains, its entries stay in the hidden maps (``Bucket.hidden``:
``Bucket.entry`` finds them, so slots, offsets and dedup stay exact) and in the policy: eviction may take a hidden
entry first (``index._drop`` finds it in ``Bucket.hidden``); a store of a
hidden key frees that entry at once and stores the block anew (``revive``),
so a store after the flush lands; blocks committed after ``start`` go to the
new ready map and are not part of the flush; a second flush of the namespace
hides the new map as another part.

Primitives: ``Drains(index).start(buckets) -> Flush``, ``.step(n) -> [Flush]``
(the flushes finished by it), ``.pending``, ``.busy``, ``.releasing``, ``.revive(ns, keys)``,
``.unhide(e)``; ``Flush.removed``, ``.hidden``.
"""

from __future__ import annotations

from collections import deque

from .entry import new_map


class Flush:
    """One flush request: the hidden maps it frees and what it removed so far."""

    def __init__(self, parts: list) -> None:
        self.parts = parts   # [(bucket, hidden map)], freed from the last
        self.hidden = sum(len(h) for _, h in parts)  # entries it hid at start
        self.kept = 0        # held by a transfer when reached: back in the ready map

    @property
    def removed(self) -> int:
        """Blocks the flush took away (freed by it, or evicted or re-stored while hidden)."""
        return self.hidden - self.kept

    @property
    def done(self) -> bool:
        return not self.parts


class Drains:
    def __init__(self, index) -> None:
        self.index = index
        self.queue: deque[Flush] = deque()
        self._spent: list[dict] = []  # emptied hidden maps, released alone in the next step

    @property
    def pending(self) -> int:
        """Flushes started and not yet finished."""
        return len(self.queue)

    @property
    def releasing(self) -> bool:
        """An emptied map waits: the next ``step`` only frees it (its own turn)."""
        return bool(self._spent)

    @property
    def busy(self) -> bool:
        """A flush pending, or an emptied map still to release: ``step`` has work."""
        return bool(self.queue or self._spent)

    def start(self, buckets: list) -> Flush:
        """Hide every READY block of ``buckets`` now; ``step`` frees them."""
        parts = []
        for ns in buckets:
            hidden, ns.ready_map = ns.ready_map, new_map()
            if not hidden:
                continue
            ns.hidden.append(hidden)
            parts.append((ns, hidden))
            if self.index.mirror is not None:
                self.index.mirror.cleared(ns)
        job = Flush(parts)
        self.queue.append(job)
        return job

    def step(self, n: int) -> list[Flush]:
        """Free up to ``n`` hidden entries, oldest flush first; the flushes this finished."""
        index, done = self.index, []
        if self._spent:  # a million-entry map's table is ~40 MB: freeing it (munmap) is this step's work
            self._spent.clear()
            return done
        while self.queue and n > 0:
            job = self.queue[0]
            while job.parts and n > 0:
                ns, hidden = job.parts[-1]
                k = min(n, len(hidden))
                n -= k
                for _ in range(k):
                    key, e = hidden.popitem()  # in no set order (nobody sees a hidden map)
                    if e.pins:  # a transfer reads it: kept, and visible again
                        ns.ready_map[key] = e
                        job.kept += 1
                        if index.mirror is not None:
                            index.mirror.stored(ns, [key])
                    else:
                        index._drop(e, removed=True)
                if not hidden:
                    job.parts.pop()
                    ns.hidden = [h for h in ns.hidden if h is not hidden]
                    self._spent.append(hidden)
                    n = 0
            if job.done:
                done.append(self.queue.popleft())
        return done

    def revive(self, ns, keys: list) -> None:
        """A store names keys a flush hid: free those entries now (unless held),
        so the store writes the block anew instead of skipping it."""
        ready = ns.ready_map
        for key in keys:
            e = None if key in ready else ns.entry(key)  # hidden, or being written (not hidden)
            if e is not None and e.pins == 0 and self.unhide(e):
                self.index._drop(e, removed=True)

    @staticmethod
    def unhide(e) -> bool:
        """Take ``e`` out of the hidden map holding it; False when none does."""
        for hidden in e.ns.hidden:
            if hidden.pop(e.key, None) is not None:
                return True
        return False
