"""What kvtier holds for this engine, as vLLM offloading events (scheduler side).

vLLM turns its offloading manager's ``take_events`` into ``BlockStored`` /
``BlockRemoved`` on its KV event stream (``kv_events_config``), which
KV-cache-aware routers read to count where a prefix can hit. kvtier's blocks
live in host memory, so they are announced as vLLM's own CPU offloading
announces its blocks: medium ``CPU``, locality ``LOCAL``, as the primary tier.

* **Stored**: a chunk this engine stored (``complete_store``), or found by a
  lookup (stored by another engine on the node, or by an earlier process):
  from then on this engine can load it. Each chunk is announced once.
* **Removed**: an announced chunk kvtier no longer holds in any tier (with
  head slices, ``slices.py``: once any of its slices is gone). Learnt two
  ways: a lookup that misses it (always available), and, where the engine
  can read the daemon's block event stream (``kvtier_events`` in
  ``kv_connector_extra_config``; operators only), the daemon's own events
  for this namespace of this engine's tenant, as they happen. Another
  tenant's namespace with the same fingerprint is on the same topic: its
  messages are told apart by their ``tenant`` (this engine's own, learnt
  from the daemon once its first message arrives). With the disk tier a
  block has two copies: a RAM eviction (``removed``) of a block whose file
  is complete (``disk_stored``) is still a hit, so a chunk is removed once
  neither copy is left.

Nothing is queued unless vLLM publishes KV events (it drains ``take`` only
then). A hybrid model's groups are separate namespaces, so each has its own
feed and layout, and a chunk is known by its group and kvtier key.
Primitives: ``TierEvents(enabled, feed, slices, tenant)`` with ``stored``,
``missing``, ``take``, ``close``; ``DaemonFeed(endpoint, fingerprint)`` with
``messages() -> [(tenant, [(kind, key)])]``; ``own_tenant(client)``.
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


# The daemon's event kinds: which copy of a block appeared or went.
TIER = {"stored": ("ram", True), "removed": ("ram", False), "disk_stored": ("disk", True),
        "disk_removed": ("disk", False)}


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

    def messages(self) -> list[tuple[str, list[tuple[str, bytes]]]]:
        """(tenant, [(kind, kvtier key)]) of each message on this fingerprint since the last
        call: every tenant's namespace with this fingerprint publishes on the same topic."""
        out: list = []
        for _ in range(self.MAX_PER_TAKE):
            try:
                topic, body = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if topic != self.fingerprint:  # SUBSCRIBE matches prefixes
                continue
            try:
                msg = msgpack.unpackb(body, raw=False)
                events = [(kind, k) for kind, k in msg["events"] if kind in TIER and isinstance(k, bytes)]
                out.append((str(msg["tenant"]), events))
            except Exception as exc:  # a malformed message is skipped whole, never fatal to the engine
                log.warning("kvtier: unreadable block event from the daemon: %s", exc)
        return out

    def close(self) -> None:
        self.sub.close(0)


def own_tenant(client) -> str | None:
    """This connection's tenant, as the daemon's stats list it (a client sees its tenant's rows)."""
    me = client.client_id
    return next((row["tenant"] for row in client.stats()["clients"] if row["id"] == me), None)


class TierEvents:
    def __init__(self, enabled: bool, feed: DaemonFeed | dict[int, DaemonFeed] | None = None,
                 slices: KVSlices | dict[int, KVSlices] = PER_RANK, tenant=None):
        """``feed``, ``slices``: group 0's, or one per group index (a hybrid model).
        ``tenant``: this engine's tenant, or a callable that asks the daemon (None
        while it cannot say: the feed's messages are then skipped, lookups still count)."""
        self.enabled = enabled
        feeds = feed if isinstance(feed, dict) else ({0: feed} if feed is not None else {})
        self.feeds: dict[int, DaemonFeed] = feeds if enabled else {}
        # head slices: the daemon reports each slice's key (slices.py)
        self.slices: dict[int, KVSlices] = slices if isinstance(slices, dict) else {0: slices}
        self._announced: dict[tuple[int, bytes], OffloadKey] = {}  # (group, slice's kvtier key) -> vLLM key
        self._copies: dict[tuple[int, bytes], set] = {}  # announced slice -> tiers seen holding it ("ram", "disk")
        self.tenant = tenant
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
                    self._copies.pop(sibling, None)
                self._pending.append((True, key))

    def _own_tenant(self) -> str | None:
        if callable(self.tenant):
            try:
                found = self.tenant()
            except Exception as exc:  # the daemon is away: try again with the next message
                log.debug("kvtier: cannot learn this engine's tenant yet: %s", exc)
                return None
            if found is not None:
                self.tenant = found
            return found
        return self.tenant

    def _apply(self, group: int, events: list[tuple[str, bytes]]) -> None:
        """The daemon's events for this engine's namespace: a chunk goes once no tier holds it."""
        gone = []
        for kind, k in events:
            chunk = (group, k)
            if chunk not in self._announced:
                continue
            tier, present = TIER[kind]
            copies = self._copies.setdefault(chunk, {"ram"})  # announced: stored, or found by a lookup
            (copies.add if present else copies.discard)(tier)
            if not copies:
                gone.append(chunk)
        self._drop(gone)

    def take(self) -> list[OffloadingEvent]:
        """One event per run of stores or removals, in the order they happened."""
        if not self.enabled:
            return []
        for group, feed in self.feeds.items():
            messages = feed.messages()
            tenant = self._own_tenant() if messages else None
            for owner, events in messages:
                if owner == tenant:  # another tenant's namespace of the same fingerprint is not ours
                    self._apply(group, events)
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
