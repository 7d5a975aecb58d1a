"""The vLLM releases kvtier supports (0.32, 0.33), and every difference between them kvtier bridges.

One place for version-dependent code; everything else in this package is
written against the interface both releases share. Each shim says which vLLM
change it bridges. Detection is by feature, not by version string (vLLM's CPU
build and a source checkout report their versions differently); the version
named is where the feature appeared.

Differences that need nothing here (the interface change is compatible):

* 0.33 ``OffloadingManager.lock``: held by vLLM's scheduler across a step's
  lookups and loads. kvtier's manager is entered from the scheduler thread
  only (the daemon feed is read inside ``take_events``), so vLLM's default
  no-op lock is right.
* 0.33 ``OffloadingWorker.submit_load(..., expedited=False)``: taken as a
  keyword and given no priority (kvtier sends it like any load); vLLM calls
  ``wait`` on it at once, which is what makes it finish within the step.
* 0.33 ``OffloadingManager.on_reset_flushed`` / ``config_info`` and
  ``OffloadingSpec.config_info_keys``: vLLM's defaults (kvtier's reset
  frees nothing, and it publishes no config info series).
* 0.33 ``OffloadingGroupConfig.sliding_window_size_in_chunks``: kvtier reads
  a group's attention type from the KV cache config, as on 0.32.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvtier.vllm")


def sync_load_blocks(entry) -> list[int] | None:
    """The engine blocks a load job writes if vLLM waits for it within the step, else None.

    Bridges vLLM 0.33's sync loads (``TransferJob.sync``, enabled by the
    ``sync_load_budget_bytes`` extra config key): the request already runs in
    this step's forward, so a failed load cannot be a failed *receive*; its
    blocks are reported as invalid (``get_block_ids_with_load_errors``) and
    vLLM's scheduler recomputes the request from the first of them. 0.32's
    jobs have no ``sync`` field: every load is asynchronous."""
    if not getattr(entry, "sync", False):
        return None
    return [int(b) for b in entry.dst_spec.block_ids]


def disable_sync_loads_for_hybrid_models(scheduler, kv_cache_config) -> None:
    """vLLM 0.33: no sync loads where a failed one could not be reported.

    vLLM's scheduler maps invalid block ids back to requests only for a model
    with one KV cache group (with several it raises: block ids are per
    group). A kvtier load can always fail (evicted since the lookup, daemon
    gone), so for a hybrid model every load stays asynchronous, where a
    failure is a failed receive. No-op on 0.32 (no sync loads) and where
    ``sync_load_budget_bytes`` is unset."""
    config = getattr(scheduler, "config", None)
    if not getattr(config, "sync_load_budget_bytes", 0) or len(kv_cache_config.kv_cache_groups) <= 1:
        return
    log.warning("kvtier: sync_load_budget_bytes=%d ignored: a model with %d KV cache groups "
                "loads asynchronously (vLLM cannot map a failed sync load's blocks to requests)",
                config.sync_load_budget_bytes, len(kv_cache_config.kv_cache_groups))
    scheduler.config = config._replace(sync_load_budget_bytes=0)
