"""Lookups without a round trip: each namespace's hashes that a load would
serve - ready in RAM or on the disk tier - mirrored into shared memory that
its clients read (``pool/shm_index.py``), when ``lookup_index`` is on.

The mirror holds the union of the two tiers, so its longest prefix is the one
``BlockIndex.lookup`` answers (RAM's ready prefix extended by disk blocks). It
is updated synchronously where either index changes (a store's commit, a
ready block dropped by eviction, flush or discard; a disk file written,
dropped for room, flushed, found bad or found by the start-up scan), before
any reply goes out, so a client that saw its store done finds it in the
mirror. A block leaves the mirror only when it left both tiers: RAM asks the
disk tier (``attach_lower``) and the disk tier asks RAM before removing.
The segment is mode 0600 and owned by the daemon's user: clients running as
that user map it by name; clients of other users (the systemd deployment)
get a read-only descriptor of it over the hand-over socket (``open_for``),
only for a namespace they are registered in.
A lookup answered from the mirror refreshes no recency (the load that
follows does); its client reports it for the daemon's counters (``answered.py``).

Memory: the tables together stay within ``budget`` bytes of /dev/shm
(``lookup_index_share`` of the pool); one table takes at most a quarter of
it, sized down to what fits (a table that fills up overflows and its readers
ask the daemon), and a namespace that finds no room gets no mirror. A
table goes with its namespace (``forget``), so register/close cycles leave
nothing behind. On CPUs without x86 memory ordering there are no mirrors
(``seqlock_safe``).

Primitives: ``LookupIndexes(pool_bytes, budget).segment_for(bucket, ready_keys)``, ``.stored(bucket, keys)``,
``.removed(bucket, key)`` (``with .batch():`` one write per table), ``.cleared(bucket)``, ``.forget(bucket)``, ``.tables``, ``.bytes``, ``.close()``,
``.open_for(clients, peer, name) -> fd | why`` (a read-only descriptor for a registered process);
the disk tier's side: ``.attach_lower(tier)`` (``tier.keys_of(ns_key)``, ``tier.on_disk(ns_key, key)``, ``tier.keys_on_disk(ns_key)``),
``.disk_stored(ns_key, keys)``, ``.disk_removed(ns_key, keys)`` (keys RAM still holds stay), ``.disk_cleared(ns_key)``.
"""

from __future__ import annotations

import logging
import os
import secrets

from ..pool.index import Bucket
from ..pool.segment import SHM_DIR
from ..pool.shm_index import PREFIX, ShmIndexWriter, segment_name
from ..pool.shm_table import table_bytes

log = logging.getLogger("kvtier.daemon")
MAX_KEYS = 1 << 20   # per namespace (~36 MiB of table); more ready blocks: readers ask the daemon
MIN_KEYS = 64        # a table smaller than this is not worth a segment
STALE_PREFIX = PREFIX


class LookupIndexes:
    def __init__(self, pool_bytes: int, budget: int, ask_on_miss: bool = False):
        """``ask_on_miss``: the remote tier is on, which the tables do not mirror: readers
        answer whole hits only and ask the daemon (which asks the cluster) past a miss."""
        self.pool_bytes, self.budget, self.ask_on_miss = pool_bytes, budget, ask_on_miss
        # Keyed by namespace key (one bucket per key at a time: forget() goes with the bucket),
        # so the disk tier, which knows namespaces by key, reaches the same table.
        self._writers: dict[str, tuple[ShmIndexWriter, int]] = {}
        self.lower = None  # the disk tier, once attached
        self.bytes = 0  # /dev/shm bytes of every table
        self.refused = 0  # namespaces that found no room for a table
        self._batch: dict[str, list[bytes]] | None = None  # removals waiting for batch()'s end

    def segment_for(self, bucket: Bucket, ready_keys) -> str:
        """The mirror of ``bucket`` (created at its first registration, filled
        with ``ready_keys()``, what is ready), or "" when the budget has no room for one."""
        entry = self._writers.get(bucket.key)
        if entry is None:
            keys = self._fitting_keys(bucket.block_bytes)
            if keys is None:
                self.refused += 1
                log.info("no room left for a lookup mirror of %s (lookup_index_share): its clients "
                         "ask the daemon", bucket.key[:64])
                return ""
            # The daemon's pid in the name lets a later daemon remove it if this one is killed.
            w = ShmIndexWriter(segment_name(f"{os.getpid()}.{secrets.token_hex(16)}"), keys,
                               ask_on_miss=self.ask_on_miss)
            w.add(ready_keys())
            if self.lower is not None:  # what the disk holds is a hit too (after a restart: only there)
                w.add(self.lower.keys_of(bucket.key))
            entry = self._writers[bucket.key] = (w, w.segment.size)
            self.bytes += w.segment.size
        return entry[0].name

    def _fitting_keys(self, block_bytes: int) -> int | None:
        keys = min(MAX_KEYS, max(MIN_KEYS, self.pool_bytes // block_bytes))
        room = min(self.budget // 4, self.budget - self.bytes)
        while keys >= MIN_KEYS and table_bytes(keys) > room:
            keys //= 2
        return keys if keys >= MIN_KEYS else None

    @property
    def tables(self) -> int:
        return len(self._writers)

    def attach_lower(self, tier) -> None:
        """The disk tier (built after the mirrors): its blocks are hits too. Once, at start."""
        self.lower = tier

    def stored(self, bucket: Bucket, keys: list[bytes]) -> None:
        entry = self._writers.get(bucket.key)
        if entry is not None and keys:
            self._settle(bucket.key)
            entry[0].add(keys)

    def cleared(self, bucket: Bucket) -> None:
        """A flush hid every ready block of ``bucket`` at once (``pool/drain.py``)."""
        self.disk_cleared(bucket.key)  # the disk tier hides the same namespace's files next (start_flush)

    def disk_cleared(self, ns_key: str) -> None:
        """A flush hid the namespace's files (``DiskIndex.hide``); RAM's are hidden with them."""
        entry = self._writers.get(ns_key)
        if entry is not None:
            if self._batch:
                self._batch.pop(ns_key, None)  # removals of a table just emptied
            entry[0].clear()

    def removed(self, bucket: Bucket, key: bytes) -> None:
        """A ready block left RAM: still a hit while its file is on disk. Inside
        ``batch()`` the removal waits for the batch's end."""
        entry = self._writers.get(bucket.key)
        if entry is None:
            return
        if self._batch is not None:  # the disk is asked once per table, at the batch's end
            self._batch.setdefault(bucket.key, []).append(key)
        elif not (self.lower is not None and self.lower.on_disk(bucket.key, key)):
            entry[0].remove([key])

    def batch(self) -> "_RemovalBatch":
        """``with mirrors.batch(): ...`` - removals within it reach each table as one
        write at its end (an eviction pass drops tens of blocks: one table update per
        block cost a store more than the lookups it saves). Only removals wait, and
        only until the block ends, before any reply can go out."""
        return _RemovalBatch(self)

    def _settle(self, key: str) -> None:
        """An add inside a batch: the table's waiting removals go first, so a block
        removed and then stored again within one batch stays in the table."""
        if self._batch and key in self._batch:
            self._flush({key: self._batch.pop(key)})

    def _flush(self, pending: dict[str, list[bytes]]) -> None:
        for key, keys in pending.items():
            entry = self._writers.get(key)
            if entry is not None:
                on_disk = self.lower.keys_on_disk(key) if self.lower is not None else ()
                entry[0].remove([k for k in keys if k not in on_disk] if on_disk else keys)

    def disk_stored(self, ns_key: str, keys: list[bytes]) -> None:
        entry = self._writers.get(ns_key)
        if entry is not None and keys:
            self._settle(ns_key)
            entry[0].add(keys)

    def disk_removed(self, ns_key: str, keys: list[bytes]) -> None:
        """Files left the disk; the caller leaves out the keys still ready in RAM."""
        entry = self._writers.get(ns_key)
        if entry is not None and keys:
            entry[0].remove(keys)

    def open_for(self, clients, peer, name: str) -> int | str:
        """A read-only descriptor of table ``name`` for the process ``peer`` (kernel
        credentials), or why not: only a process with a live session registered in the
        table's namespace gets it (``daemon/handover.py`` passes it on, SCM_RIGHTS)."""
        key = next((k for k, (w, _) in self._writers.items() if w.name == name), None)
        if key is None:
            return "no such lookup mirror"
        if not any(c.peer is not None and (c.peer.uid, c.peer.pid) == (peer.uid, peer.pid)
                   and any(not r.closing and r.ns.key == key for r in c.regs.values()) for c in clients):
            return "no registration of this process uses that mirror"
        try:  # O_RDONLY: the receiver can map it for reading only
            return os.open(SHM_DIR + "/" + name.lstrip("/"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            return f"cannot open the mirror: {exc.strerror}"

    def forget(self, bucket: Bucket) -> None:
        """The namespace is gone: unlink its table (readers keep their mappings until they close)."""
        entry = self._writers.pop(bucket.key, None)
        if entry is not None:
            self.bytes -= entry[1]
            self._close(entry[0])

    def close(self) -> None:
        for w, _ in self._writers.values():
            self._close(w)
        self._writers.clear()
        self.bytes = 0

    @staticmethod
    def _close(w: ShmIndexWriter) -> None:
        try:
            w.close()
        except Exception:  # unlinking is best effort; a new daemon sweeps the rest
            log.exception("closing a lookup index failed")


class _RemovalBatch:
    """``LookupIndexes.batch()``: removals gathered per table, written on exit
    (nested batches join the outermost one)."""

    def __init__(self, mirrors: LookupIndexes):
        self.mirrors, self.outer = mirrors, False

    def __enter__(self) -> None:
        if self.mirrors._batch is None:
            self.mirrors._batch, self.outer = {}, True

    def __exit__(self, *exc) -> None:
        if self.outer:
            pending, self.mirrors._batch = self.mirrors._batch, None
            self.mirrors._flush(pending)

