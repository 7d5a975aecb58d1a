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

Primitives: ``LookupIndexes(max_keys).segment_for(bucket)``, ``.stored(bucket, keys)``,
``.removed(bucket, key)``, ``.close()``.
"""

from __future__ import annotations

import logging
import os
import secrets

from ..pool.index import Bucket
from ..pool.shm_index import PREFIX, ShmIndexWriter, segment_name

log = logging.getLogger("kvtier.daemon")
MAX_KEYS = 1 << 20   # per namespace (~36 MiB of table); more ready blocks: readers ask the daemon
STALE_PREFIX = PREFIX


class LookupIndexes:
    def __init__(self, pool_bytes: int):
        self.pool_bytes = pool_bytes
        self._writers: dict[int, ShmIndexWriter] = {}

    def segment_for(self, bucket: Bucket) -> str:
        """The mirror of ``bucket`` (created at its first registration, filled with what is ready)."""
        w = self._writers.get(bucket.id)
        if w is None:
            max_keys = min(MAX_KEYS, max(64, self.pool_bytes // bucket.block_bytes))
            # The daemon's pid in the name lets a later daemon remove it if this one is killed.
            w = ShmIndexWriter(segment_name(f"{os.getpid()}.{secrets.token_hex(16)}"), max_keys)
            w.add(list(bucket.ready_map))
            self._writers[bucket.id] = w
        return w.name

    def stored(self, bucket: Bucket, keys: list[bytes]) -> None:
        w = self._writers.get(bucket.id)
        if w is not None and keys:
            w.add(keys)

    def removed(self, bucket: Bucket, key: bytes) -> None:
        w = self._writers.get(bucket.id)
        if w is not None:
            w.remove([key])

    def close(self) -> None:
        for w in self._writers.values():
            try:
                w.close()
            except Exception:  # unlinking at exit is best effort; a new daemon sweeps the rest
                log.exception("closing a lookup index failed")
        self._writers.clear()
