"""What kvtier holds for this engine, as vLLM offloading events (scheduler side).

vLLM turns its offloading manager's ``take_events`` into ``BlockStored`` /
``BlockRemoved`` on its KV event stream (``kv_events_config``), which
KV-cache-aware routers read to count where a prefix can hit. kvtier's blocks
live in host memory, so they are announced as vLLM's own CPU offloading
announces its blocks: medium ``CPU``, locality ``LOCAL``, as the primary tier.

* **Stored**: a chunk this engine stored (``complete_store``), or found by a
  lookup (stored by another engine on the node, or by an earlier process):
  from then on this engine can load it. Each chunk is announced once.
* **Removed**: an announced chunk the pool no longer holds (with head
  slices, ``slices.py``: once any of its slices is gone). Learnt two ways:
  a lookup that misses it (always available), and, where the engine can read
  the daemon's block event stream (``kvtier_events`` in
  ``kv_connector_extra_config``; operators only), the daemon's own
  ``removed`` events for this namespace (evictions, flushes), as they happen.

Nothing is queued unless vLLM publishes KV events (it drains ``take`` only
then). A hybrid model's groups are separate namespaces, so each has its own
feed and layout, and a chunk is known by its group and kvtier key.
Primitives: ``TierEvents(enabled, feed, slices)`` with ``stored``,
``missing``, ``take``, ``close``; ``DaemonFeed(endpoint, fingerprint)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgpack
import zmq

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey, get_offload_group_idx

from .naming import kvtier_key
from .slices import PER_RANK, KVSlices

log = logging.getLogger("kvtier.vllm")


class DaemonFeed:
    """The daemon's block events for one namespace fingerprint, read without blocking."""

    MAX_PER_TAKE = 256   # messages drained per step: a flood never stalls a step

    def __init__(self, endpoint: str, fingerprint: str):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, fingerprint.encode())
        self.sub.connect(endpoint if "://" in endpoint else f"ipc://{endpoint}")
        self.fingerprint = fingerprint.encode()

    def removed(self) -> list[bytes]:
        """kvtier keys the daemon dropped from this namespace since the last call."""
        out: list[bytes] = []
        for _ in range(self.MAX_PER_TAKE):
            try:
                topic, body = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if topic != self.fingerprint:  # SUBSCRIBE matches prefixes
                continue
            try:
                events = msgpack.unpackb(body, raw=False)["events"]
                out.extend([k for kind, k in events if kind == "removed" and isinstance(k, bytes)])
            except Exception as exc:  # a malformed message is skipped whole, never fatal to the engine
                log.warning("kvtier: unreadable block event from the daemon: %s", exc)
        return out

    def close(self) -> None:
        self.sub.close(0)


class TierEvents:
    def __init__(self, enabled: bool, feed: DaemonFeed | dict[int, DaemonFeed] | None = None,
                 slices: KVSlices | dict[int, KVSlices] = PER_RANK):
        """``feed``, ``slices``: group 0's, or one per group index (a hybrid model)."""
        self.enabled = enabled
        feeds = feed if isinstance(feed, dict) else ({0: feed} if feed is not None else {})
        self.feeds: dict[int, DaemonFeed] = feeds if enabled else {}
        # head slices: the daemon reports each slice's key (slices.py)
        self.slices: dict[int, KVSlices] = slices if isinstance(slices, dict) else {0: slices}
        self._announced: dict[tuple[int, bytes], OffloadKey] = {}  # (group, slice's kvtier key) -> vLLM key
        self._pending: list[tuple[bool, OffloadKey]] = []  # (removed, key), in the order it happened

    def _slice_keys(self, key: OffloadKey) -> list[tuple[int, bytes]]:
        group = get_offload_group_idx(key)
        return [(group, h) for h in self.slices.get(group, PER_RANK).all_keys(kvtier_key(key))]

    def stored(self, keys: Iterable[OffloadKey]) -> None:
        """These chunks are loadable by this engine now."""
        if not self.enabled:
            return
        for key in keys:
            hs = self._slice_keys(key)
            if hs[0] not in self._announced:
                self._announced.update((h, key) for h in hs)  # any slice's removal removes the chunk
                self._pending.append((False, key))

    def missing(self, keys: Iterable[OffloadKey]) -> None:
        """A lookup found these chunks gone from the pool."""
        if self.enabled:
            self._drop(self._slice_keys(k)[0] for k in keys)

    def _drop(self, chunks: Iterable[tuple[int, bytes]]) -> None:
        for chunk in chunks:
            key = self._announced.pop(chunk, None)
            if key is not None:
                for sibling in self._slice_keys(key):
                    self._announced.pop(sibling, None)
                self._pending.append((True, key))

    def take(self) -> list[OffloadingEvent]:
        """One event per run of stores or removals, in the order they happened."""
        if not self.enabled:
            return []
        for group, feed in self.feeds.items():
            self._drop((group, h) for h in feed.removed())
        out: list[OffloadingEvent] = []
        for removed, key in self._pending:
            if not out or out[-1].removed != removed:
                out.append(OffloadingEvent([], Medium.CPU, removed=removed, locality=Locality.LOCAL))
            out[-1].keys.append(key)
        self._pending = []
        return out

    def close(self) -> None:
        for feed in self.feeds.values():
            feed.close()
