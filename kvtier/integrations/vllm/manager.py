"""Scheduler side (vLLM engine core process): which chunks kvtier holds.

The daemon owns the index, so this manager keeps no state of its own beyond
one step's lookup answers. vLLM asks ``lookup`` one key at a time, and again
every step for waiting requests; the connector calls ``prefetch`` with a
request's keys first, so each request costs one round trip per step.

It never promises a load it can deliver: a hit can still be evicted (or the
daemon lost) before the worker's load runs. Such a load comes back failed,
the connector reports the request as a failed receive, vLLM recomputes it,
and ``exclude`` makes later lookups for that request miss so it cannot loop.

With a TP layout cut in head slices (``slices.py``) a chunk is a hit only
when every slice is in the pool, so each rank can load its own part.

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

from ...client import Client, KVTierError, Namespace, ShmKVCache
from .events import TierEvents
from .naming import kvtier_key
from .slices import PER_RANK, KVSlices

log = logging.getLogger("kvtier.vllm")


class KVTierSpecs(LoadStoreSpec):
    """The pool side of a load or store: kvtier keys, one per chunk, in order."""

    def __init__(self, hashes: list[bytes]):
        self.hashes = hashes

    def __repr__(self) -> str:
        return f"KVTierSpecs({len(self.hashes)} chunks)"


class KVTierManager(OffloadingManager):
    def __init__(self, namespace: Namespace, engine_block_bytes: int, blocks_per_chunk: int,
                 socket: str | None, name: str, events: TierEvents | None = None, slices: KVSlices = PER_RANK):
        self.events = events or TierEvents(enabled=False)
        self.slices = slices
        self.client = Client(socket, name=name, require_daemon=False)
        # A lookup needs a registration in the namespace. The scheduler has no KV
        # cache, so it registers a one-block stand-in with the workers' block size.
        self._probe = ShmKVCache([(1, engine_block_bytes)], torch.int8)
        self.enabled = True
        try:
            self.client.register_kv_cache(self._probe, [0], namespace, block_factor=blocks_per_chunk)
        except KVTierError as exc:  # refused (e.g. block size clash): serve, but never hit
            log.error("kvtier: scheduler registration refused (%s); kvtier disabled", exc)
            self.enabled = False
        self._answers: dict[OffloadKey, bool] = {}   # this step's lookups
        self._excluded: set[str] = set()              # requests whose load failed
        self.round_trips = 0
        self._warned_unbatched = False

    # ---- lookups -----------------------------------------------------------------------
    def prefetch(self, req_id: str, keys: Sequence[OffloadKey]) -> None:
        """Answer this step's lookups of ``keys`` (a request's chunks, in order)
        with one round trip."""
        if not self.enabled or req_id in self._excluded or not keys:
            return
        if all(k in self._answers for k in keys):
            return
        hits = self._lookup([kvtier_key(k) for k in keys])
        for i, k in enumerate(keys):
            self._answers[k] = i < hits
        self.events.stored(keys[:hits])
        self.events.missing(keys[hits:hits + 1])  # the first miss is known gone; later ones unknown

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.enabled or req_context.req_id in self._excluded:
            return LookupResult.MISS
        hit = self._answers.get(key)
        if hit is None:  # not prefetched (another caller of the connector's API)
            if not self._warned_unbatched:
                self._warned_unbatched = True
                log.warning("kvtier: lookup without prefetch; one round trip per chunk")
            hit = self._answers[key] = self._lookup([kvtier_key(key)]) == 1  # one chunk, all its slices
            (self.events.stored if hit else self.events.missing)([key])
        return LookupResult.HIT if hit else LookupResult.MISS

    def _lookup(self, hashes: list[bytes]) -> int:
        """How many of these chunks, from the first, the pool holds whole (every slice)."""
        self.round_trips += 1
        n = self.slices.slices
        keys = hashes if n == 1 else [k for h in hashes for k in self.slices.all_keys(h)]
        try:
            return self.client.lookup(keys) // n
        except KVTierError as exc:  # a refused lookup is a miss, never a crash
            log.warning("kvtier: lookup failed: %s", exc)
            return 0

    def exclude(self, req_id: str) -> None:
        """A load for this request failed: it recomputes and never loads again."""
        self._excluded.add(req_id)

    # ---- loads and stores ----------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return KVTierSpecs([kvtier_key(k) for k in keys])

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        return PrepareStoreOutput(keys_to_store=keys, store_spec=KVTierSpecs([kvtier_key(k) for k in keys]),
                                  evicted_keys=[])

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

    def reset_cache(self) -> None:
        # vLLM's reset_prefix_cache(reset_connector=True) lands here. The pool is
        # shared by every engine on the node: forget our answers, flush nothing.
        self._answers.clear()

    def shutdown(self) -> None:
        self.events.close()
        self.client.close()
        self._probe.close()
