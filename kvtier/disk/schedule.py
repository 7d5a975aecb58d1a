"""The disk tier's write scheduling (sans-IO): who writes next, and what was not written.

Two queues decide the order:

``WriteBacklog`` (the loop thread): committed blocks waiting for room in the
write-behind queue, one FIFO per tenant. The queue in flight is bounded
(``queue_bytes``, its blocks pinned in the pool); blocks beyond it wait here
instead of being dropped, and the tenants take turns: each turn hands out at
most ``BATCH`` blocks of one tenant, so a tenant with a long backlog delays
another's blocks by one batch per turn, never by its whole backlog. An item is
a reference to a block in the pool (namespace, hash), not its bytes: when its
turn comes it is written from the pool if it is still there, else counted
``evicted``. Memory stays bounded: all tenants' backlogs together name at most
``limit_bytes`` of blocks (the pool's size); past that, the tenant with the
longest backlog loses its oldest item (``backlog_full``), so one tenant's
flood costs its own blocks, not another's.

``IOQueues`` (the I/O threads, under DiskIO's lock): reads and writes wait
in their own queues for their own threads. Reads are the foreground (a load
waits for them) and run at the daemon's priority; writes and unlinks run on
fewer threads at a lower CPU priority (``io.WRITE_NICE``), so the kernel
gives a store's copy and a load's reads the cores first and a write the
time they leave, never none (a niced thread still gets its share of a busy
core): a stream of reads cannot hold writes back, and writes cannot slow
the stores whose blocks they save (docs/DISK_TIER.md, "Where a store's
time went"). When the backlog is more than half its bound (``urgent``,
set by the loop), one more writer at the daemon's own priority helps: stores
coming faster than the niced writers keep up with share the cores with it
rather than lose their blocks (``evicted``, ``backlog_full``); it stops
below a quarter.

Why a block was not written is counted per tenant: ``evicted`` (left RAM
before its turn), ``backlog_full``, ``over_share`` (more than the tenant's
share of ``disk_size``), ``too_long`` (namespace key too long for a header),
``failed`` (the write failed: ENOSPC, EIO).

Primitives:
  WriteBacklog(limit_bytes)   .add(tenant, ns, keys), .take(room_bytes) -> (tenant, ns, keys) | None,
                              .forget(ns_key), .namespaces(), .lost(tenant, why, n), .blocks, .nbytes,
                              .of(tenant), .not_written(tenant=None)
  Adopted()                   .add(entries), .pull(n) -> [(ns, [hash])], .forget(ns_keys | None),
                              .counts() -> [(ns, n)], .left
  DiskJob(kind, token, items, size, deadline)   one verb's items, shared by its lane's threads
  IOQueues()                  .push(job), .take(lane) -> (job, index) | None, .reads, .writes, .urgent
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

BATCH = 32        # blocks of one tenant per turn
ADOPT_BATCH = 1024  # adopted blocks (warm restart) pulled into a backlog at a time


class WriteBacklog:
    # A tenant's FIFO holds runs, (bucket, deque of hashes): a store's blocks join as one run,
    # so a turn, a flush's forget and the bound's drop work on runs, not on an item per block
    # (per-block items were most of what the write-behind cost the loop thread).
    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.tenants: OrderedDict[str, deque] = OrderedDict()  # turn order: the head goes next
        self.bytes_of: Counter = Counter()   # tenant -> bytes of blocks named in its backlog
        self.blocks_of: Counter = Counter()  # tenant -> blocks named in its backlog
        self.items: dict = {}                # ns key -> {hash} in any backlog: named once
        self.blocks = 0
        self.nbytes = 0
        self.not_written_: Counter = Counter()  # (tenant, why) -> blocks

    def urgent(self, now: bool) -> bool:
        """Whether the urgent writer should help: from half the bound, until below a quarter."""
        return self.nbytes * (2 if not now else 4) > self.limit_bytes

    def of(self, tenant: str) -> int:
        return self.blocks_of.get(tenant, 0)

    def add(self, tenant: str, ns, keys: list[bytes]) -> None:
        """``keys`` of ``ns`` (committed, not yet on disk) join the tenant's backlog."""
        named = self.items.get(ns.key)
        if named is None:
            named = self.items[ns.key] = set()
        new = [k for k in dict.fromkeys(keys) if k not in named]
        if not new:
            return
        named.update(new)
        q = self.tenants.get(tenant)
        if q is None:
            q = self.tenants[tenant] = deque()
        if q and q[-1][0] is ns:
            q[-1][1].extend(new)
        else:
            q.append((ns, deque(new)))
        self._counted(tenant, ns, len(new))
        while self.nbytes > self.limit_bytes:  # the longest backlog pays
            self._drop_oldest(max(self.bytes_of, key=self.bytes_of.__getitem__))

    def take(self, room_bytes: int):
        """The next turn: up to ``BATCH`` blocks of one namespace of the head tenant
        that fit ``room_bytes``, as (tenant, ns, [hash]); None when the backlog is
        empty or its next block does not fit (it waits for room: no overtaking)."""
        if not self.tenants:
            return None
        tenant, q = next(iter(self.tenants.items()))
        ns = q[0][0]
        n = min(BATCH, room_bytes // ns.block_bytes)
        if n <= 0:
            return None
        keys: list = []
        while q and len(keys) < n and q[0][0] is ns:
            run = q[0][1]
            want = n - len(keys)
            if len(run) <= want:
                keys += run
                q.popleft()
            else:
                keys += [run.popleft() for _ in range(want)]
        self._taken(tenant, ns, keys)
        if q:
            self.tenants.move_to_end(tenant)  # the others' turn first
        else:
            del self.tenants[tenant]
        return tenant, ns, keys

    def namespaces(self) -> list[str]:
        return list(self.items)

    def forget(self, ns_key: str) -> int:
        """A flush: its blocks are gone from every tier, by policy (not counted as lost)."""
        if ns_key not in self.items:
            return 0
        n = 0
        for tenant in list(self.tenants):
            q = self.tenants[tenant]
            gone = [run for run in q if run[0].key == ns_key]
            if not gone:
                continue
            for ns, keys in gone:
                self._taken(tenant, ns, keys)
                n += len(keys)
            keep = deque(run for run in q if run[0].key != ns_key)
            if keep:
                self.tenants[tenant] = keep
            else:
                del self.tenants[tenant]
        return n

    def lost(self, tenant: str, why: str, n: int = 1) -> None:
        if n:
            self.not_written_[(tenant, why)] += n

    def not_written(self, tenant: str | None = None) -> dict:
        """{why: blocks} for ``tenant``; None: {tenant: {why: blocks}}."""
        out: dict = {}
        for (t, why), n in sorted(self.not_written_.items()):
            if tenant is None:
                out.setdefault(t, {})[why] = n
            elif t == tenant:
                out[why] = n
        return out

    def _drop_oldest(self, tenant: str) -> None:
        q = self.tenants[tenant]
        ns, run = q[0]
        k = run.popleft()
        if not run:
            q.popleft()
        self._taken(tenant, ns, [k])
        if not q:
            del self.tenants[tenant]
        self.lost(tenant, "backlog_full")

    def _counted(self, tenant: str, ns, n: int) -> None:
        self.blocks_of[tenant] += n
        self.bytes_of[tenant] += n * ns.block_bytes
        self.blocks += n
        self.nbytes += n * ns.block_bytes

    def _taken(self, tenant: str, ns, keys) -> None:
        named = self.items[ns.key]
        named.difference_update(keys)
        if not named:
            del self.items[ns.key]
        self._counted(tenant, ns, -len(keys))
        if not self.bytes_of[tenant]:
            del self.bytes_of[tenant]
        if not self.blocks_of[tenant]:
            del self.blocks_of[tenant]

    def problems(self) -> list[str]:
        named = [(ns.key, k) for q in self.tenants.values() for ns, run in q for k in run]
        flat = {(fp, k) for fp, keys in self.items.items() for k in keys}
        out = []
        if len(named) != len(flat) or set(named) != flat or len(named) != self.blocks:
            out.append("write backlog: queued items and their set disagree")
        if any(not q or any(not run for _, run in q) for q in self.tenants.values()):
            out.append("write backlog: an empty tenant queue or run kept")
        if any(not keys for keys in self.items.values()):
            out.append("write backlog: an empty namespace set kept")
        if self.nbytes > self.limit_bytes:
            out.append(f"write backlog: {self.nbytes} bytes > limit {self.limit_bytes}")
        return out


class Adopted:
    """Blocks a warm restart adopted (daemon/warm.py), waiting to join a write backlog: a
    SIGKILL may have left any of them unwritten. Per namespace an iterator over their hashes
    in commit order, so a kept pool of millions costs a list per namespace, not a backlog
    entry per block: the tier pulls a batch when its backlog runs low (the remote tier and,
    once its start-up scan is done, the disk tier), and checks each block then."""

    def __init__(self):
        self.waiting: dict = {}  # bucket -> [iterator over hashes, how many it has left]
        self.left = 0

    def counts(self) -> list:
        """[(ns, blocks waiting)]."""
        return [(ns, w[1]) for ns, w in self.waiting.items()]

    def add(self, entries: list) -> int:
        by_ns: dict = {}
        for e in entries:
            by_ns.setdefault(e.ns, []).append(e.key)
        for ns, keys in by_ns.items():
            self.waiting[ns] = [iter(keys), len(keys)]
            self.left += len(keys)
        return len(entries)

    def pull(self, n: int) -> list:
        """Up to ``n`` hashes, oldest namespace first: [(ns, [hash])]."""
        out = []
        while self.waiting and n > 0:
            ns, w = next(iter(self.waiting.items()))
            keys = list(islice(w[0], min(n, w[1])))
            w[1] -= len(keys)
            self.left -= len(keys)
            n -= len(keys)
            if not w[1]:
                del self.waiting[ns]
            out.append((ns, keys))
        return out

    def forget(self, ns_keys) -> None:
        """A flush (``ns_keys`` None: of everything): its blocks are gone from every tier, by policy."""
        for ns in [ns for ns in self.waiting if ns_keys is None or ns.key in ns_keys]:
            self.left -= self.waiting.pop(ns)[1]


@dataclass(eq=False)
class DiskJob:
    kind: str                    # "write" | "read" | "unlink"
    token: Any                   # the caller's, handed back untouched
    items: list                  # write: (ns_key, key, seq, offset); read: (entry, offset); unlink: path
    size: int = 0
    deadline: float = 0.0        # read: reported "expired" by then if not done
    evicted: list = field(default_factory=list)  # write: item i overwrites file evicted[i] (DiskIO.write)
    next: int = 0                # guarded by the lock: the next item a worker takes
    finished: int = 0            # guarded by the lock: items done
    expired: bool = False        # guarded by the lock
    started: float = 0.0         # when a worker took its first item (stall detection)
    ok: list = field(default_factory=list)      # write: (index, crc, path); read: (index, crc)
    failed: list = field(default_factory=list)  # indices not written / not read intact
    bad: list = field(default_factory=list)     # read: indices whose file must go (corrupt, foreign, gone)


class IOQueues:
    """Read jobs and write jobs (writes and unlinks), each lane taken by its own
    threads; a job's items are handed out one at a time (shared by the lane's threads)."""

    def __init__(self):
        self.reads: deque = deque()
        self.writes: deque = deque()   # writes and unlinks
        self.urgent = False            # the "urgent" lane takes writes too (the backlog is filling)

    def push(self, job) -> None:
        self.lane(job.kind).append(job)

    def lane(self, kind: str) -> deque:
        return self.reads if kind == "read" else self.writes  # "urgent" takes writes

    def take(self, lane: str):
        """The next (job, item index) of ``lane`` ("read" | "write" | "urgent": writes while
        ``urgent``), or None when there is none."""
        if lane == "urgent" and not self.urgent:
            return None
        q = self.lane(lane)
        if not q:
            return None
        job = q[0]
        i = job.next
        job.next += 1
        if job.next >= len(job.items):
            q.popleft()
        return job, i
