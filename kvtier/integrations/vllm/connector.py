"""``KVTierConnector``: vLLM's OffloadingConnector, made safe for a shared tier.

What it changes, and why:

* Worker side: the stock worker asserts that every transfer succeeded. With
  a tier shared by many engines a hit can be evicted before its load runs,
  and the daemon can go away; such a load is reported as a *failed receive*
  (``KVConnectorTransferResults.failed_recving``), on which vLLM's scheduler
  drops the request's computed tokens and recomputes them (its default
  ``kv_load_failure_policy="recompute"``). The blocks a failed load may have
  half written are never used.
* Scheduler side: before vLLM looks a request's chunks up one by one, the
  request's keys of each KV cache group go to the manager, which asks the
  daemon about a group's keys in one round trip when vLLM first looks into
  that group; a request whose load failed is never offered a hit again.
* vLLM 0.33's sync loads (waited for within the step, ``compat.py``): a
  failed one reports its blocks as invalid, and vLLM recomputes the request
  from the first of them; hybrid models keep every load asynchronous.

With another spec (vLLM's CPU spec, a test's mock) the scheduler side is
vLLM's own, unchanged: vLLM's offloading-connector tests pass with this class
in place of ``OffloadingConnector`` (``tests/integrations/test_vllm_contract.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .compat import disable_sync_loads_for_hybrid_models, sync_load_blocks
from .manager import KVTierManager
from .spec import _ENGINE, EngineConfigs

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


class KVTierConnectorWorker(OffloadingConnectorWorker):
    """Reports failed loads instead of asserting that none fail."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed_loads: set[str] = set()
        self.failed_sync_blocks: set[int] = set()
        self._sync_loads: dict[int, list[int]] = {}  # job id -> engine blocks it writes

    def start_kv_transfers(self, metadata):
        for job_id, entry in metadata.load_jobs.items():
            blocks = sync_load_blocks(entry)
            if blocks is not None:
                self._sync_loads[job_id] = blocks
        super().start_kv_transfers(metadata)

    def register_kv_caches(self, kv_caches):
        from .spec import KVTierOffloadingSpec
        if isinstance(self.spec, KVTierOffloadingSpec):
            self.spec.check_layer_tensors(kv_caches)  # head slices need head-major tensors
        super().register_kv_caches(kv_caches)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        assert self.worker is not None
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            is_load = result.job_id in self._load_jobs
            if result.transfer_time is not None and result.transfer_size is not None and result.success:
                stats = self._connector_worker_meta.transfer_stats
                (stats.load if is_load else stats.store).record(result.transfer_size, result.transfer_time)
            self._connector_worker_meta.mark_completed(result.job_id)
            req_id = self._load_jobs.pop(result.job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)  # failed receives are finished too
                if not result.success:
                    self.failed_loads.add(req_id)
            sync_blocks = self._sync_loads.pop(result.job_id, None)
            if sync_blocks is not None and not result.success:
                # Waited for before this step's forward (``wait``), so reported in this
                # step's output, as vLLM requires of a sync load's failure.
                self.failed_sync_blocks.update(sync_blocks)
        return set(), finished_recving

    def take_failed_loads(self) -> set[str]:
        failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_failed_sync_blocks(self) -> set[int]:
        failed, self.failed_sync_blocks = self.failed_sync_blocks, set()
        return failed


class KVTierConnector(OffloadingConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        transfer = vllm_config.kv_transfer_config
        if role == KVConnectorRole.SCHEDULER and transfer.kv_load_failure_policy != "recompute":
            # vLLM's default fails the *request* when a load fails. For a shared
            # tier a failed load (evicted since the lookup, daemon restarted) is
            # an ordinary miss: recompute. The scheduler reads the policy after
            # building its connector, so setting it here takes effect.
            log.info("kvtier: kv_load_failure_policy=%r -> 'recompute' (a failed kvtier load is a miss)",
                     transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        token = _ENGINE.set(EngineConfigs(vllm_config, kv_cache_config))
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            _ENGINE.reset(token)
        if self.connector_worker is not None:
            self.connector_worker = KVTierConnectorWorker(self.connector_worker.spec, vllm_config,
                                                          kv_cache_config)
        if self.connector_scheduler is not None and isinstance(self.connector_scheduler.manager, KVTierManager):
            disable_sync_loads_for_hybrid_models(self.connector_scheduler, kv_cache_config)

    # ---- worker side ---------------------------------------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        assert isinstance(self.connector_worker, KVTierConnectorWorker)
        return KVConnectorTransferResults(finished_sending=set(finished_sending or ()),
                                          finished_recving=set(finished_recving or ()),
                                          failed_recving=self.connector_worker.take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed sync loads (vLLM 0.33); asynchronous loads fail as whole receives."""
        if not isinstance(self.connector_worker, KVTierConnectorWorker):
            return set()
        return self.connector_worker.take_failed_sync_blocks()

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._prefetch(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _prefetch(self, request: "Request", num_computed_tokens: int) -> None:
        """Hand the manager the chunks vLLM is about to ask for one by one (it
        then looks each group up in one round trip, when vLLM first asks)."""
        sched = self.scheduler
        if not isinstance(sched.manager, KVTierManager):
            return  # another spec's manager: vLLM's per-chunk lookups, unchanged
        state = sched._req_status.get(request.request_id)
        if state is None or state.transfer_jobs or request.skip_reading_prefix_cache:
            return
        state.update_offload_keys()  # idempotent; vLLM's own lookup calls it again
        for config, group in zip(sched.config.kv_group_configs, state.group_states):
            keys = group.offload_keys[num_computed_tokens // config.tokens_per_chunk:]
            sched.manager.expect(request.request_id, keys)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        super().update_connector_output(connector_output)
        for req_id in connector_output.failed_recving or ():
            log.warning("kvtier: load for request %s failed; vLLM recomputes it", req_id)
            if isinstance(self.scheduler.manager, KVTierManager):
                self.scheduler.manager.exclude(req_id)
