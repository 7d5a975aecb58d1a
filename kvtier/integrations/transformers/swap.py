"""kvtier as HF's CPU swap pool, shared by every HF process on the node.

HF calls ``_offload_to_cpu`` with the victims of one step, whose blocks it has
already returned to its pool: the next ``schedule_batch`` may hand them out.
kvtier's ``offload`` is waited for here, so the copy is complete before that,
and the requests kvtier has no room for are known at once (HF soft resets
whatever this returns nothing for).

Restores do not happen here: HF calls ``restore_scheduled_requests`` once the
batch is fixed, when a failed copy can no longer be undone, so
``KVTierScheduler`` restores while the request is still a candidate.

Primitives: ``KVTierOffloadingManager``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

if TYPE_CHECKING:
    from .tier import HFKVTier


class KVTierOffloadingManager(OffloadingManager):
    def __init__(self, cache, scheduler, tier: "HFKVTier", compute_stream, distributed_helper) -> None:
        # No private pinned pool (0 GiB): kvtier's pool replaces it.
        super().__init__(cache, scheduler, cpu_offload_space_gib=0.0, safety_threshold=0.8,
                         compute_stream=compute_stream, distributed_helper=distributed_helper)
        self.tier = tier

    def _offload_to_cpu(self, victims: list[RequestState],
                        victim_block_tables: dict[str, dict[str, list[int]]]) -> set[str]:
        (name,) = self.cache.cache_allocators
        taken = self.tier.offload({s.request_id: victim_block_tables[s.request_id][name] for s in victims})
        for state in victims:
            state.is_cpu_offloaded = state.request_id in taken
        return taken

    def restore_scheduled_requests(self, requests_in_batch: list[FutureRequestState]) -> None:
        for future_state in requests_in_batch:
            if future_state.state.is_cpu_offloaded:
                # Only reachable with a scheduler that does not restore: refuse
                # rather than run a forward pass over blocks that were never filled.
                raise RuntimeError(f"request {future_state.state.request_id} was scheduled while swapped out; "
                                   "kvtier swap needs ContinuousBatchingConfig(scheduler_type='kvtier')")

    def free_request_cpu_cache(self, state: RequestState) -> None:
        if state.is_cpu_offloaded:
            self.tier.discard(state.request_id)
            state.is_cpu_offloaded = False

    def free_all_waiting_cpu_caches(self) -> None:
        for state in self.scheduler.waiting_requests.values():
            self.free_request_cpu_cache(state)

    def reset(self) -> None:
        self.scheduler.release_blocks(self.tier, wait=True)  # before HF frees every block
        self.free_all_waiting_cpu_caches()
        self.tier.discard_all()
