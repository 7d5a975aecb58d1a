"""Scheduler side (vLLM engine core process): which chunks kvtier holds.

The daemon owns the index, so this manager keeps no state of its own beyond
one step's lookup answers. vLLM asks ``lookup`` one key at a time, and again
every step for waiting requests; the connector first hands the manager a
request's keys of each KV cache group (``expect``), and vLLM's first lookup
in a group asks the daemon about all of them at once (``prefetch``): a
request costs one round trip per group vLLM looks into per step, and a miss
in the first group (vLLM then stops) costs one (a hit in a head-sliced
layout costs a second one, for the other slices of the chunks that hit,
``slices.py``).

Hybrid models: each group is looked up in its own namespace (``groups.py``),
a full-attention group as a prefix (vLLM stops at its first miss), a
sliding-window group chunk by chunk (vLLM scans it from the end for a run
of hits as long as the window, so chunks early in the prompt may be absent).
vLLM combines the groups' answers into a hit every group can serve.

It never promises a load it can deliver: a hit can still be evicted (or the
daemon lost) before the worker's load runs. Such a load comes back failed,
the connector reports the request as a failed receive, vLLM recomputes it,
and ``exclude`` makes later lookups for that request miss so it cannot loop.

``prepare_store`` hands every key to the worker: the daemon skips blocks it
already holds or is writing, so deduplication costs no copy.

``take_events`` reports what the pool holds for this engine on vLLM's KV
event stream (``events.py``): chunks stored or found by a lookup, and chunks
a lookup or the daemon's event feed says are gone.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence

import torch

from vllm.v1.kv_offload.base import (
    get_offload_group_idx,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from ...client import Client, KVTierError, ShmKVCache
from .events import TierEvents, own_tenant
from .groups import TierGroup
from .naming import kvtier_key
from .pool_spec import KVTierSpecs

log = logging.getLogger("kvtier.vllm")


ROLES = (None, "kv_both", "kv_producer", "kv_consumer")  # None: no kv_transfer_config role (both)

# Chunks of a windowed group asked about in one round trip (the daemon's
# LookupMany limit); vLLM needs the last ones, so those are the ones asked.
MAX_CHUNKS_PER_LOOKUP = 4096


class _GroupLookup:
    """One group's scheduler-side registration: lookups in its namespace."""

    def __init__(self, group: TierGroup, blocks_per_chunk: int, client: Client):
        self.group = group
        self.client = client
        # A lookup needs a registration in the namespace. The scheduler has no KV
        # cache, so it registers a one-block stand-in with the workers' block size
        # (one slice of an engine block when the layout is sliced).
        self.probe = ShmKVCache([(1, group.engine_block_bytes)], torch.int8)
        self.enabled = True
        try:
            self.client.register_kv_cache(self.probe, [0], group.namespace, block_factor=blocks_per_chunk)
        except KVTierError as exc:  # refused (e.g. block size clash): serve, but never hit
            log.error("kvtier: scheduler registration of group %d refused (%s); no hits",
                      group.group_idx, exc)
            self.enabled = False

    def hits(self, hashes: list[bytes]) -> list[bool]:
        """Which of these chunks the pool holds whole (every TP slice,
        ``slices.py``): a prefix for a full-attention group (a second round
        trip only when a sliced chunk hit), each chunk on its own for a
        windowed one. A refused lookup is all misses, never a crash."""
        sl = self.group.slices
        n = sl.slices
        try:
            if not self.group.windowed:
                # Slice 0's key is the chunk's key: a miss costs what the
                # per-rank layout's lookup costs; the other slices are asked
                # for only over the prefix that hit.
                whole = self.client.lookup(hashes)
                if whole and n > 1:
                    whole = self.client.lookup(sl.keys(hashes[:whole])) // n
                return [i < whole for i in range(len(hashes))]
            asked = hashes[-(MAX_CHUNKS_PER_LOOKUP // n):]
            flat = sl.keys(asked)
            found = self.client.lookup_many([flat[i:i + n] for i in range(0, len(flat), n)])
            return [False] * (len(hashes) - len(asked)) + [f == n for f in found]
        except KVTierError as exc:
            log.warning("kvtier: lookup failed: %s", exc)
            return [False] * len(hashes)

    def close(self) -> None:
        self.client.close()
        self.probe.close()


class KVTierManager(OffloadingManager):
    def __init__(self, groups: list[TierGroup], blocks_per_chunk: int, socket: str | None, name: str,
                 events: TierEvents | None = None, kv_role: str | None = None):
        if kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {sorted(r for r in ROLES if r)}, not {kv_role!r}")
        # vLLM's kv_role, honoured here where vLLM's offloading scheduler does not look at it:
        # a producer fills the pool and never loads, a consumer loads and never stores.
        self.loads, self.stores = kv_role != "kv_producer", kv_role != "kv_consumer"
        self.events = events or TierEvents(enabled=False)
        # One connection for every group: each group's lookups use a registration
        # of their own in the group's namespace (``Client.share``).
        first = Client(socket, name=name, require_daemon=False)
        clients = [first] + [first.share() for _ in groups[1:]]
        if self.events.tenant is None:  # the daemon's events name their tenant: this engine's, asked once
            self.events.tenant = lambda: own_tenant(first)
        self.groups = {g.group_idx: _GroupLookup(g, blocks_per_chunk, c) for g, c in zip(groups, clients)}
        self._position = {g.group_idx: i for i, g in enumerate(groups)}
        self._answers: dict[OffloadKey, bool] = {}   # this step's lookups
        self._expected: dict[int, tuple[str, list[OffloadKey], set[OffloadKey]]] = {}  # group -> a request's keys
        self._excluded: set[str] = set()              # requests whose load failed
        self.round_trips = 0
        self._warned_unbatched = False

    @property
    def enabled(self) -> bool:
        """Lookups can hit (every group's registration was accepted)."""
        return all(g.enabled for g in self.groups.values())

    # ---- lookups -----------------------------------------------------------------------
    def expect(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """vLLM is about to look up ``keys`` (a request's chunks of one group,
        in order): the first lookup of one of them asks about all (no I/O here)."""
        if keys:
            self._expected[get_offload_group_idx(keys[0])] = (req_id, list(keys), set(keys))

    def prefetch(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """Answer this step's lookups of ``keys`` (a request's chunks of one
        group, in order) with one round trip."""
        if not self.loads or not self.enabled or req_id in self._excluded or not keys:
            return
        if all(k in self._answers for k in keys):
            return
        found = self._lookup(keys)
        for k, hit in zip(keys, found):
            self._answers[k] = hit
        self.events.stored(k for k, hit in zip(keys, found) if hit)
        # A prefix lookup knows only its first miss is gone; a windowed one knows each.
        misses = [k for k, hit in zip(keys, found) if not hit]
        group = self.groups.get(get_offload_group_idx(keys[0]))
        self.events.missing(misses if group is not None and group.group.windowed else misses[:1])

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.loads or not self.enabled or req_context.req_id in self._excluded:
            return LookupResult.MISS
        hit = self._answers.get(key)
        if hit is None:
            expected = self._expected.get(get_offload_group_idx(key))
            if expected is not None and expected[0] == req_context.req_id and key in expected[2]:
                self.prefetch(req_context.req_id, expected[1])
                hit = self._answers.get(key)
        if hit is None:  # not expected (another caller of the connector's API)
            if not self._warned_unbatched:
                self._warned_unbatched = True
                log.warning("kvtier: lookup without prefetch; one round trip per chunk")
            hit = self._answers[key] = self._lookup([key])[0]  # one chunk, all its slices
            (self.events.stored if hit else self.events.missing)([key])
        return LookupResult.HIT if hit else LookupResult.MISS

    def _lookup(self, keys: Sequence[OffloadKey]) -> list[bool]:
        group = self.groups.get(get_offload_group_idx(keys[0]))
        if group is None:  # a group the spec did not offload: never a hit
            return [False] * len(keys)
        self.round_trips += 1
        return group.hits([kvtier_key(k) for k in keys])

    def exclude(self, req_id: str) -> None:
        """A load for this request failed: it recomputes and never loads again."""
        self._excluded.add(req_id)

    def _specs(self, keys: Collection[OffloadKey]) -> KVTierSpecs:
        """vLLM lists a job's keys group after group; kvtier keeps them apart."""
        groups: list[list[bytes]] = [[] for _ in self._position]
        for k in keys:
            groups[self._position[get_offload_group_idx(k)]].append(kvtier_key(k))
        return KVTierSpecs(groups=groups)

    # ---- loads and stores ----------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._specs(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys) if self.stores else []  # nothing to store is not a failed allocation
        return PrepareStoreOutput(keys_to_store=keys, store_spec=self._specs(keys), evicted_keys=[])

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        if success:
            self.events.stored(keys)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.events.take()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._excluded.discard(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._answers.clear()  # the pool changes between steps
        self._expected.clear()

    def reset_cache(self) -> None:
        # vLLM's reset_prefix_cache(reset_connector=True) lands here. The pool is
        # shared by every engine on the node: forget our answers, flush nothing.
        self._answers.clear()

    def shutdown(self) -> None:
        self.events.close()
        for group in self.groups.values():
            group.close()
