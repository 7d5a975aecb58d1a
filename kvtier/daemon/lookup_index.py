"""Lookups without a round trip: each namespace's ready hashes mirrored into
shared memory that its clients read (``pool/shm_index.py``), when
``lookup_index`` is on.

The mirror is updated synchronously where the index changes (a store's
commit, a ready block dropped by eviction, flush or discard), before any
reply goes out, so a client that saw its store done finds it in the mirror.
The segment is mode 0600 and owned by the daemon's user: only clients
running as that user can map it; others are simply answered over the socket.
A lookup answered from the mirror refreshes no recency and is not in the
daemon's hit counters (the load that follows does both).

Memory: the tables together stay within ``budget`` bytes of /dev/shm
(``lookup_index_share`` of the pool); one table takes at most a quarter of
it, sized down to what fits (a table that fills up overflows and its readers
ask the daemon), and a namespace that finds no room gets no mirror. A
table goes with its namespace (``forget``), so register/close cycles leave
nothing behind. On CPUs without x86 memory ordering there are no mirrors
(``seqlock_safe``).

Primitives: ``LookupIndexes(pool_bytes, budget).segment_for(bucket, ready_keys)``, ``.stored(bucket, keys)``,
``.removed(bucket, key)``, ``.cleared(bucket)``, ``.forget(bucket)``, ``.tables``, ``.bytes``, ``.close()``.
"""

from __future__ import annotations

import logging
import os
import secrets

from ..pool.index import Bucket
from ..pool.shm_index import PREFIX, ShmIndexWriter, segment_name, table_bytes

log = logging.getLogger("kvtier.daemon")
MAX_KEYS = 1 << 20   # per namespace (~36 MiB of table); more ready blocks: readers ask the daemon
MIN_KEYS = 64        # a table smaller than this is not worth a segment
STALE_PREFIX = PREFIX


class LookupIndexes:
    def __init__(self, pool_bytes: int, budget: int):
        self.pool_bytes, self.budget = pool_bytes, budget
        self._writers: dict[int, tuple[ShmIndexWriter, int]] = {}
        self.bytes = 0  # /dev/shm bytes of every table
        self.refused = 0  # namespaces that found no room for a table

    def segment_for(self, bucket: Bucket, ready_keys) -> str:
        """The mirror of ``bucket`` (created at its first registration, filled
        with ``ready_keys()``, what is ready), or "" when the budget has no room for one."""
        entry = self._writers.get(bucket.id)
        if entry is None:
            keys = self._fitting_keys(bucket.block_bytes)
            if keys is None:
                self.refused += 1
                log.info("no room left for a lookup mirror of %s (lookup_index_share): its clients "
                         "ask the daemon", bucket.key[:64])
                return ""
            # The daemon's pid in the name lets a later daemon remove it if this one is killed.
            w = ShmIndexWriter(segment_name(f"{os.getpid()}.{secrets.token_hex(16)}"), keys)
            w.add(ready_keys())
            entry = self._writers[bucket.id] = (w, w.segment.size)
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

    def stored(self, bucket: Bucket, keys: list[bytes]) -> None:
        entry = self._writers.get(bucket.id)
        if entry is not None and keys:
            entry[0].add(keys)

    def cleared(self, bucket: Bucket) -> None:
        """A flush hid every ready block of ``bucket`` at once (``pool/drain.py``)."""
        entry = self._writers.get(bucket.id)
        if entry is not None:
            entry[0].clear()

    def removed(self, bucket: Bucket, key: bytes) -> None:
        entry = self._writers.get(bucket.id)
        if entry is not None:
            entry[0].remove([key])

    def forget(self, bucket: Bucket) -> None:
        """The namespace is gone: unlink its table (readers keep their mappings until they close)."""
        entry = self._writers.pop(bucket.id, None)
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
