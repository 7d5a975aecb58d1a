"""HF's FIFO scheduler with kvtier at the two points where a request (re)starts.

Selected with ``ContinuousBatchingConfig(scheduler_type="kvtier")`` (the name
is registered in HF's public ``SCHEDULER_MAPPING`` on import). With no tier
attached, or a tier with no daemon (``tier.live`` False: nothing is hashed,
looked up or stored), it is HF's FIFO scheduler, unchanged.

- **Restore before scheduling.** HF restores swapped requests after the batch
  is fixed and has no way back if the copy fails. Here the swapped request's
  blocks are allocated and the restore is waited for while the request is
  still only a candidate; a swap lost with the daemon turns the request into
  a soft reset (HF's own recompute path) before anything is scheduled.
- **Prefix from kvtier.** A fresh prompt whose leading full blocks are in
  kvtier gets blocks allocated and loaded instead of prefilled, after HF's
  in-process prefix match; at least one prompt token is always left to
  compute (the forward pass that samples the first token needs one).
- **Store at finish, without waiting.** A finished request's full blocks are
  copied to kvtier; their references move to a holder entry in HF's block
  table, so HF frees the rest of the request at once and these blocks only
  when the daemon has read them (checked every step; waited for only when
  the cache is full and HF needs them back).

Primitives: ``KVTierScheduler`` (its ``tier`` attribute is set by the
manager), ``SCHEDULER_NAME``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

if TYPE_CHECKING:
    from .tier import HFKVTier

SCHEDULER_NAME = "kvtier"


class KVTierScheduler(FIFOScheduler):
    tier: "HFKVTier | None" = None

    def reset(self) -> None:
        super().reset()
        self._pool_blocks: dict[str, int] = {}  # request id -> leading blocks kvtier already holds
        self._keys: dict[str, list[bytes]] = {}  # request id -> its prompt's block keys (hashed once)

    def schedule_batch(self, token_budget: int, cache_budget: int):
        tier = self.tier
        if tier is not None:
            tier.register_when_connected()
            self.release_blocks(tier)
        batch = super().schedule_batch(token_budget, cache_budget)
        if batch[0] is None and tier is not None and tier.stores:
            # The cache is full and blocks wait for their stores: HF needs them now.
            self.release_blocks(tier, wait=True)
            batch = super().schedule_batch(token_budget, cache_budget)
        if tier is not None and batch[0]:
            tier.counters.computed_tokens += batch[2]
        return batch

    def _infer_request_tokens(self, state: RequestState, removed: set[str]) -> list[int]:
        tier = self.tier
        if tier is None or state.status != RequestStatus.PENDING:
            return super()._infer_request_tokens(state, removed)
        if state.is_cpu_offloaded:
            restored = self._restore(tier, state, removed)
            if restored is not False:  # restored, or no room yet: HF's path takes it from here
                return super()._infer_request_tokens(state, removed)
        if not tier.live:  # no daemon: nothing to look up (no hashing either)
            return super()._infer_request_tokens(state, removed)
        # A fresh prompt (possibly a soft reset just now)
        prompt = state.remaining_prefill_tokens
        super()._infer_request_tokens(state, removed)  # HF's in-process prefix match first
        if state.position_offset < len(prompt):
            self._load_prefix(tier, state, prompt, removed)
        return state.remaining_prefill_tokens

    def finish_request(self, request_id: str) -> None:
        state = self.active_requests.get(request_id)
        if self.tier is not None and self.tier.live and state is not None and state.status == RequestStatus.FINISHED:
            self._store(self.tier, state)
        self._pool_blocks.pop(request_id, None)
        self._keys.pop(request_id, None)
        super().finish_request(request_id)

    def release_blocks(self, tier: "HFKVTier", wait: bool = False) -> None:
        """Free the blocks the daemon has let go of: parked after a failed copy,
        or held for a store (``wait``: every store, once final)."""
        if tier.quarantine:
            self.cache.pool.free_blocks(tier.allocator.index, tier.release_quarantine())
        if tier.stores:
            for holder in tier.finished_stores(wait):
                self.cache.free_blocks(holder)

    # ---- swap -------------------------------------------------------------------------
    def _restore(self, tier: "HFKVTier", state: RequestState, removed: set[str]) -> bool | None:
        """True: restored and active; None: no room yet (stays swapped and
        waiting); False: the swap is lost and ``state`` is now a soft reset."""
        rid, page = state.request_id, tier.page_size
        count = tier.swapped_blocks(rid)
        # Blocks for exactly what was offloaded (restored into the first ones of
        # the new table); HF allocates the rest when it schedules the request.
        if not self.cache.can_store_request_tokens(state, max(0, count * page - state.position_offset)):
            return None
        if tier.restore(rid, tier.allocator.block_table[rid][:count]):
            state.is_cpu_offloaded = False
            self._activate(state, removed, restart=False)
            self._mark_complete(state, state.position_offset // page)
            return True
        self._drop_blocks(tier, rid, keep=0)
        fresh = state.create_equivalent_initial_request()
        vars(state).update(vars(fresh))  # in place: the scheduler loop holds this object
        return False

    # ---- prefix tier ------------------------------------------------------------------
    def _load_prefix(self, tier: "HFKVTier", state: RequestState, prompt: list[int], removed: set[str]) -> None:
        rid, page = state.request_id, tier.page_size
        usable = (len(prompt) - 1) // page  # leave at least one token to compute
        have = state.position_offset // page  # blocks HF matched in this process
        # HF offers every waiting request to every step until it fits: ask
        # kvtier only when the blocks a hit would need are free now.
        if usable <= have or not self.cache.can_store_request_tokens(state, (usable - have) * page, dry_run=True):
            return
        keys = self._keys.get(rid)
        if keys is None or len(keys) != usable:
            keys = self._keys[rid] = tier.prefix_keys(prompt[:usable * page])
        hits = tier.lookup(keys)
        if hits <= have or not self.cache.can_store_request_tokens(state, (hits - have) * page):
            return
        loaded = tier.load(keys[have:hits], tier.allocator.block_table[rid][have:hits])
        self._drop_blocks(tier, rid, keep=have + loaded)
        if not loaded:
            return
        self._pool_blocks[rid] = have + loaded
        state.position_offset = (have + loaded) * page
        state.remaining_prefill_tokens = prompt[state.position_offset:]
        if state.status == RequestStatus.PENDING:
            self._activate(state, removed, restart=True)
        self._mark_complete(state, have + loaded)

    def _store(self, tier: "HFKVTier", state: RequestState) -> None:
        table = tier.allocator.block_table.get(state.request_id)
        if not table:
            return
        computed = (state.initial_tokens + state.generated_tokens)[:state.position_offset]
        keys = tier.prefix_keys(computed)[:len(table)]
        skip = self._pool_blocks.get(state.request_id, 0)
        holder = tier.store(keys[skip:], table[skip:len(keys)])
        if holder is not None:  # the daemon reads these blocks: the holder keeps them allocated
            tier.allocator.block_table[holder] = table[skip:len(keys)]
            del table[skip:len(keys)]

    # ---- shared steps -------------------------------------------------------------------
    def _activate(self, state: RequestState, removed: set[str], restart: bool) -> None:
        """Waiting -> active, prefill continuing at ``position_offset``, as HF
        does after its own prefix match (and it holds even if this step
        cannot schedule the request: it owns blocks now)."""
        self.active_requests[state.request_id] = state
        self.waiting_requests.pop(state.request_id, None)
        removed.add(state.request_id)
        if restart:
            state.status = RequestStatus.PREFILLING  # the setter stamps the start of its lifespan
        else:
            state._status = RequestStatus.PREFILLING  # a restored request started long ago

    def _mark_complete(self, state: RequestState, full_blocks: int) -> None:
        """Hash the blocks that arrived so later prompts in this process share
        them, as HF does after its own restore."""
        if self.cache.use_prefix_sharing and full_blocks:
            (name,) = self.cache.cache_allocators
            self.cache.mark_complete_blocks(state, {name: full_blocks})

    def _drop_blocks(self, tier: "HFKVTier", request_id: str, keep: int) -> None:
        """Shorten a request's table to ``keep`` blocks. The dropped ones were
        just allocated for a copy (never shared nor hashed): back to the pool,
        except those a failed copy may still write, which wait in quarantine."""
        table = tier.allocator.block_table.get(request_id, [])
        dropped = table[keep:]
        del table[keep:]
        if not table:
            tier.allocator.block_table.pop(request_id, None)
        free = [b for b in dropped if not tier.is_parked(b)]
        if free:
            self.cache.pool.free_blocks(tier.allocator.index, free)


SCHEDULER_MAPPING.setdefault(SCHEDULER_NAME, KVTierScheduler)
