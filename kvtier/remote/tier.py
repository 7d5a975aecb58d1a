"""The remote tier: write-behind, existence probes and fetches on their own
threads, reported back to the caller's loop through a wakeup pipe.

The caller (the daemon's poll loop) never waits on the network: every verb
queues a job and returns at once, or refuses at once (breaker open, queue
full) so the caller answers from local state. Three threads, each with its
own connection, so a large write-behind batch never delays a lookup's probe
and a probe never waits behind a fetch:

  probe thread   pipelined EXISTS for the rest of a chain; while the breaker
                 is open it pings the store every cooldown to close it again;
                 a probe not answered within ``timeout_s`` is reported with 0
                 hits by the deadline thread (jobs.py), the late answer dropped
  fetch thread   pipelined GET, authenticate, copy payloads into the pool;
                 a cancelled fetch stops at its next batch
  write thread   CRC-32C + MAC header, pipelined SET with a TTL, byte budget

The pool is any writable buffer (the daemon's shared-memory segment; a
bytearray in tests). The caller guarantees the pool bytes a job names stay
put until the job is reported done: blocks being written out are held
(never evicted), blocks being fetched are invisible (allocated, not committed).

Values are keyed and authenticated with the cluster's secret (values.py):
a forged, foreign or damaged value is rejected, counted and deleted.

Primitives (loop thread): ``probe(ns, keys, token, tenant) -> bool``, ``fetch(ns, keys,
offsets, size, token, tenant) -> Job | None``, ``cancel(job)``, ``write(ns, keys, offsets,
size, token) -> int`` (how many of ``keys``, from the first, were queued),
``completed() -> [Job]`` (also a "healed" job when the breaker closes again),
``wakeup_fd``, ``stats()``, ``close()``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque

from . import values as v
from .breaker import CLOSED, OPEN, Breaker
from .jobs import Deadlines, Job, more_writes
from .settings import RemoteSettings
from .store import RedisStore, Unreachable
from .turns import Slots, TurnQueue
from ..waker import Inbox

log = logging.getLogger("kvtier.remote")

# Which counter a rejected value goes to: a value not made with this cluster's
# secret, or made for another block or namespace (copied there), is an attack.
REJECTED_AS = {v.MISSING: "missing", v.FORGED: "forged", v.FOREIGN: "forged"}


class RemoteTier:
    def __init__(self, settings: RemoteSettings, pool, clock=time.monotonic):
        self.settings = settings
        self.pool = memoryview(pool).cast("B")
        self.clock = clock
        self.breaker = Breaker(cooldown=min(1.0, 4 * settings.timeout_s), max_cooldown=5.0)
        self.lock = threading.Lock()        # breaker, counters, queued bytes
        self.counters: Counter = Counter()
        self.last_error = ""
        self.queued_bytes = 0               # write-behind bytes queued or being written (held by the caller)
        self.probe_slots = Slots(settings.max_probes, settings.max_probes_per_tenant)  # turns.py; locked
        self.window: deque = deque()        # (time, bytes) written in the last ttl_s, for the budget
        self.window_bytes = 0
        self.codec = v.ValueCodec(settings.secret)
        self._names: dict[str, v.NamespaceDigest] = {}
        self._done = Inbox()  # finished jobs; wakes the daemon's loop
        self._queues = {"probe": TurnQueue(), "fetch": TurnQueue(), "write": queue.Queue()}
        self._closing = threading.Event()
        self._threads = [threading.Thread(target=self._serve, args=(k,), name=f"kvtier-remote-{k}", daemon=True)
                         for k in self._queues]
        for t in self._threads:
            t.start()
        self._deadlines = Deadlines(self._expire)

    # ---- loop-thread API --------------------------------------------------------------
    @property
    def wakeup_fd(self) -> int:
        return self._done.fd

    def available(self) -> bool:
        with self.lock:
            return self.breaker.state == CLOSED

    def probe(self, fingerprint: str, keys: list[bytes], token, tenant: str = "") -> bool:
        """Ask how many of ``keys`` (a chain's continuation) the store holds in a row. False: not asked
        (store unavailable, or too many lookups waiting: in all, or ``tenant``'s: ``probe_over_share``)."""
        with self.lock:
            why = "closed" if self.breaker.state != CLOSED else self.probe_slots.take(tenant)
            if why:
                self.counters.update(probe_skipped=1, probe_over_share=why == "tenant")
                return False
        job = Job("probe", token, self._ns(fingerprint), list(keys), tenant=tenant,
                  deadline=time.monotonic() + self.settings.timeout_s)
        self._queues["probe"].put(job)
        self._deadlines.add(job)
        return True

    def fetch(self, fingerprint: str, keys: list[bytes], offsets: list[int], size: int, token,
              tenant: str = "") -> Job | None:
        """Copy blocks ``keys`` into the pool at ``offsets`` (``size`` bytes each), verified, in
        ``tenant``'s turn. None: not started (store unavailable); those blocks failed."""
        if not self.available():
            self.counters["fetch_skipped"] += len(keys)
            return None
        job = Job("fetch", token, self._ns(fingerprint), list(keys), list(offsets), size, tenant=tenant)
        self._queues["fetch"].put(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop a fetch. One still queued (behind a slow or hung store) is reported at once,
        every block failed, its pool bytes never touched; a running one stops at its next batch."""
        job.cancelled = True
        with self.lock:
            if job.started or job.reported:
                return
            job.reported = True
            self.counters["fetch_cancelled"] += len(job.keys)
        job.failed, job.error = list(range(len(job.keys))), "cancelled"
        self._done.put(job)

    def write(self, fingerprint: str, keys: list[bytes], offsets: list[int], size: int, token,
              if_missing: bool = False) -> int:
        """Write-behind of committed blocks; the caller holds them until the job is done.
        Returns how many of ``keys``, from the first, were queued: as many as fit in
        ``queue_bytes`` (a chain's prefix is what other nodes can use); 0 when the store
        is unavailable. The caller releases the others at once. ``if_missing``: one
        pipelined EXISTS first, and only the blocks the store lacks are SET (``job.present``)."""
        with self.lock:
            if self.breaker.state != CLOSED:
                self.counters["write_skipped"] += len(keys)
                return 0
            n = min(len(keys), max(0, self.settings.queue_bytes - self.queued_bytes) // max(1, size))
            self.counters["queue_full"] += len(keys) - n
            if not n:
                return 0
            self.queued_bytes += n * size
        self._queues["write"].put(Job("write", token, self._ns(fingerprint), list(keys[:n]), list(offsets[:n]),
                                      size, if_missing=if_missing))
        return n

    def completed(self) -> list[Job]:
        return self._done.take_all()

    def stats(self) -> dict:
        s = self.settings
        with self.lock:
            c = dict(self.counters)
            state, opened = self.breaker.state, self.breaker.opened
            queued, window, probes = self.queued_bytes, self.window_bytes, self.probe_slots.held
        keys = ("probes", "probe_blocks", "remote_hits", "probe_skipped", "probe_over_share", "probe_late",
                "fetches", "fetched", "fetched_bytes", "fetch_failed", "fetch_skipped", "fetch_cancelled", "missing",
                "corrupt", "forged", "written", "written_bytes", "write_failed", "write_skipped", "queue_full",
                "budget_skipped", "rejected", "errors")
        return {"enabled": True, "endpoint": s.display, "state": state, "opened": opened,
                "last_error": self.last_error, "queued_bytes": queued, "queue_bytes": s.queue_bytes,
                "window_bytes": window, "budget_bytes": s.budget, "ttl_s": s.ttl_s, "probes_waiting": probes,
                **{k: c.get(k, 0) for k in keys}}

    def close(self) -> None:
        self._closing.set()
        self._deadlines.close()
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=5 + 2 * self.settings.timeout_s)
        self._done.close()
        if not any(t.is_alive() for t in self._threads):
            self.pool.release()  # the pool's owner may unmap it now

    def _ns(self, fingerprint: str) -> v.NamespaceDigest:
        ns = self._names.get(fingerprint)
        if ns is None:
            ns = self._names[fingerprint] = self.codec.namespace(fingerprint)
        return ns

    # ---- threads ---------------------------------------------------------------------
    def _serve(self, kind: str) -> None:
        store = RedisStore(self.settings)
        q = self._queues[kind]
        run = {"probe": self._probe, "fetch": self._fetch, "write": self._write}[kind]
        try:
            while True:
                try:
                    job = q.get(timeout=self.breaker.cooldown if kind == "probe" else None)
                except queue.Empty:
                    self._heal(store)
                    continue
                if job is None:
                    return
                jobs = [job] + (more_writes(q, job, self.settings.batch_bytes) if kind == "write" else [])
                try:
                    run(store, jobs)
                except Exception as exc:  # a bug here must not lose the caller's job
                    log.exception("remote %s failed", kind)
                    for j in jobs:
                        j.error = j.error or f"{type(exc).__name__}: {exc}"
                        j.failed = list(range(len(j.keys))) if kind == "fetch" else j.failed
                        if kind == "write":  # counted, never retried: the same bug would hit again
                            j.failed, j.dropped = [], {"error": len(j.keys)}
                finally:
                    if kind == "probe":
                        with self.lock:
                            self.probe_slots.give(job.tenant)
                    for j in jobs:
                        if j is not None:
                            self._report(j)
                    if kind == "probe":
                        self._heal(store)
        finally:
            store.close()

    def _report(self, job: Job) -> None:
        with self.lock:
            if job.reported:
                return  # a probe answered at its deadline: this late result is dropped
            job.reported = True
        self._done.put(job)

    def _expire(self, job: Job) -> None:
        """Deadline thread: the store did not answer this probe in time; 0 remote hits."""
        with self.lock:
            if job.reported:
                return
            job.reported = True
            self.counters["probe_late"] += 1
        job.hits, job.error = 0, f"no answer within {self.settings.timeout_s}s"
        self._done.put(job)

    def _call(self, fn, *args):
        """Run one store call under the breaker; Unreachable opens it."""
        try:
            result = fn(*args)
        except Unreachable as exc:
            with self.lock:
                self.breaker.failure(self.clock())
                self.counters["errors"] += 1
                opened = self.breaker.state == OPEN
            if self.last_error != str(exc) or opened:
                log.warning("remote tier %s: %s%s", self.settings.display, exc,
                            "; answering locally for now" if opened else "")
            self.last_error = str(exc)
            raise
        with self.lock:
            was = self.breaker.state
            self.breaker.success()
        if was != CLOSED:
            log.info("remote tier %s is back", self.settings.display)
            self._done.put(Job("healed", None, None, []))  # the caller's write backlog may go on
        return result

    def _heal(self, store: RedisStore) -> None:
        """While the breaker is open, one ping per cooldown is the half-open trial."""
        if self._closing.is_set():
            return
        with self.lock:
            if self.breaker.state == CLOSED or not self.breaker.allow(self.clock()):
                return
        try:
            self._call(store.ping)
        except Unreachable:
            pass

    def _probe(self, store: RedisStore, jobs: list[Job]) -> None:
        for job in jobs:
            if job.reported:  # answered at its deadline while it waited behind a hung call
                continue
            if self.breaker.state != CLOSED:  # opened while this job waited
                job.error = "unavailable"
                continue
            try:
                found = self._call(store.exists, [self.codec.key(job.ns, k) for k in job.keys])
            except Unreachable as exc:
                job.error = str(exc)
                continue
            job.hits = next((i for i, hit in enumerate(found) if not hit), len(found))
            with self.lock:
                self.counters.update(probes=1, probe_blocks=len(job.keys), remote_hits=job.hits)

    def _fetch(self, store: RedisStore, jobs: list[Job]) -> None:
        for job in jobs:
            self._fetch_one(store, job)

    def _fetch_one(self, store: RedisStore, job: Job) -> None:
        with self.lock:
            if job.reported:  # cancelled while queued: answered already
                return
            job.started = True
        per = max(1, self.settings.batch_bytes // max(1, job.size))
        tally: Counter = Counter()
        rejected = []  # keys whose values failed verification: nobody should be offered them again
        for start in range(0, len(job.keys), per):
            chunk = range(start, min(start + per, len(job.keys)))
            if job.cancelled:
                job.error = job.error or "cancelled"
                job.failed.extend(chunk)
                tally["fetch_cancelled"] += len(chunk)
                continue
            if self.breaker.state != CLOSED:
                job.error = job.error or "unavailable"
                job.failed.extend(chunk)
                continue
            try:
                got = self._call(store.get, [self.codec.key(job.ns, job.keys[i]) for i in chunk])
            except Unreachable as exc:
                job.error = str(exc)
                job.failed.extend(chunk)
                continue
            for i, value in zip(chunk, got):
                verdict = self.codec.verify(value, job.ns, job.keys[i], job.size)
                if not verdict.ok:
                    job.failed.append(i)
                    tally[REJECTED_AS.get(verdict.status, "corrupt")] += 1
                    if verdict.status != v.MISSING:
                        rejected.append(self.codec.key(job.ns, job.keys[i]))
                        log.error("remote block %s of %s rejected: %s (%s)", job.keys[i].hex(),
                                  job.ns.short.decode(), verdict.status, verdict.why)
                    continue
                off = job.offsets[i]
                self.pool[off:off + job.size] = memoryview(value)[v.HEADER_BYTES:]
                job.crcs.append((off, verdict.crc))  # a CRC-32C (values.py)
                tally["fetched"] += 1
            del got
        if rejected:
            try:  # best effort: a writer may race us, and a good value lost is only a cache miss
                self._call(store.delete, rejected)
            except Unreachable:
                pass
        tally.update(fetches=1, fetched_bytes=tally["fetched"] * job.size, fetch_failed=len(job.failed))
        with self.lock:
            self.counters.update(tally)

    def _write(self, store: RedisStore, jobs: list[Job]) -> None:
        """SET the jobs' blocks in one pipeline. Not written: ``failed`` (store unreachable or
        breaker open: worth another try), ``dropped`` (over the budget, refused: for good)."""
        items, owners = [], []  # owners[i]: (job, index) of items[i]
        tally: Counter = Counter()
        checked = [j for j in jobs if j.if_missing]
        try:  # a value already there is not sent again (its bytes, the budget)
            found = iter(self._call(store.exists, [self.codec.key(j.ns, k) for j in checked for k in j.keys])
                         if checked and self.breaker.state == CLOSED else ())
            for j in checked:
                j.present = [i for i, _ in enumerate(j.keys) if next(found, False)]
        except Unreachable:
            pass  # the SETs below fail the same way: retried
        for job in jobs:
            if self.breaker.state != CLOSED:  # opened while this job waited
                tally["write_skipped"] += len(job.keys)
                job.failed = list(range(len(job.keys)))
                continue
            present = set(job.present)
            for i, (key, off) in enumerate(zip(job.keys, job.offsets)):
                if i in present:
                    continue
                if not self._within_budget(job.size):
                    tally["budget_skipped"] += 1
                    job.dropped["budget"] = job.dropped.get("budget", 0) + 1
                    continue
                payload = self.pool[off:off + job.size]
                header, _ = self.codec.frame(job.ns, key, payload)
                items.append((self.codec.key(job.ns, key), b"".join((header, payload))))
                owners.append((job, i))
        if items:
            try:
                refused = self._call(store.set, items, self.settings.ttl_s)
            except Unreachable:
                tally["write_failed"] += len(items)
                for job, i in owners:
                    job.failed.append(i)
            else:
                for why, (job, i) in zip(refused, owners):
                    if why is None:
                        tally.update(written=1, written_bytes=job.size)
                    else:
                        tally["rejected"] += 1
                        job.dropped["rejected"] = job.dropped.get("rejected", 0) + 1
                        self.last_error = why
        with self.lock:
            self.counters.update(tally)
            self.queued_bytes -= sum(len(job.keys) * job.size for job in jobs)  # no longer read from the pool

    def _within_budget(self, size: int) -> bool:
        """This node writes at most ``budget`` bytes per ``ttl_s``: every value expires
        within ``ttl_s``, so its live bytes in the store never exceed the budget."""
        if not self.settings.budget:
            return True
        now = self.clock()
        with self.lock:
            while self.window and self.window[0][0] <= now - self.settings.ttl_s:
                self.window_bytes -= self.window.popleft()[1]
            if self.window_bytes + size > self.settings.budget:
                return False
            self.window.append((now, size))
            self.window_bytes += size
            return True
