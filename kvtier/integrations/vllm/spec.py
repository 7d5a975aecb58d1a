"""``KVTierOffloadingSpec``: vLLM's offloading spec, built once per process.

vLLM hands the spec an ``OffloadingConfig``; the namespace also needs facts
only the full engine config has (model revision, hash algorithm, the
unpadded page size per layer), so ``KVTierConnector`` passes its configs in
while vLLM builds the spec. The stock ``OffloadingConnector`` cannot report a
failed load (it asserts success), so the spec refuses to run under it
rather than risk vLLM reading blocks a failed load never wrote.

``kv_connector_extra_config`` keys read here (all optional):
``kvtier_socket`` (default: ``$KVTIER_SOCKET`` or the standard path),
``kvtier_events`` (the daemon's block event endpoint, its ``events``
setting: lets the engine's KV events report evictions as they happen; the
daemon lets only operators read it), and vLLM's own ``block_size`` /
``blocks_per_chunk`` (tokens or engine blocks per kvtier block).
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from .naming import EngineIdentity

_ENGINE: contextvars.ContextVar["EngineConfigs | None"] = contextvars.ContextVar("kvtier_vllm_engine",
                                                                                default=None)


@dataclass(frozen=True)
class EngineConfigs:
    vllm_config: Any
    kv_cache_config: Any


class KVTierOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        engine = _ENGINE.get()
        if engine is None:
            raise RuntimeError(
                "KVTierOffloadingSpec must be loaded by KVTierConnector: set kv_connector="
                "'KVTierConnector' and kv_connector_module_path='kvtier.integrations.vllm' (the stock "
                "OffloadingConnector cannot report failed loads)")
        if len(config.groups) != 1:
            raise NotImplementedError("kvtier supports models with one KV cache group "
                                      f"(this model has {len(config.groups)})")
        vc = engine.vllm_config
        group = config.groups[0]
        self.identity = EngineIdentity(
            model=vc.model_config.model, revision=vc.model_config.revision,
            cache_dtype=config.model.dtype,
            kv_layout=f"vllm-{config.kv_cache_layout or vc.cache_config.get_resolved_kv_cache_layout()}"
                      + ("-canonical" if config.canonical_layout else ""),
            tokens_per_block=group.tokens_per_block, blocks_per_chunk=self.blocks_per_chunk,
            tp_size=config.parallel.tp_size, pp_size=config.parallel.pp_size, group_id=group.group_id,
            hash_algo=vc.cache_config.prefix_caching_hash_algo, hash_seed=os.environ.get("PYTHONHASHSEED"))
        self.engine_block_bytes = _unpadded_block_bytes(engine.kv_cache_config, group.group_id)
        self.socket = self.extra_config.get("kvtier_socket") or None
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import KVTierManager
            self.identity.warn_if_unshareable()
            namespace = self.identity.namespace(0)
            self._manager = KVTierManager(namespace, self.engine_block_bytes, self.blocks_per_chunk, self.socket,
                                          name=f"vllm-scheduler-{self.config.engine_id}"[:64],
                                          events=self._events(namespace))
        return self._manager

    def _events(self, namespace):
        from .events import DaemonFeed, TierEvents
        # vLLM drains take_events only when it publishes KV events.
        enabled = self.kv_events_config.enable_kv_cache_events
        endpoint = self.extra_config.get("kvtier_events") or None
        feed = DaemonFeed(endpoint, namespace.fingerprint()) if enabled and endpoint else None
        return TierEvents(enabled, feed)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import KVTierWorker
            rank = self.config.parallel.rank
            self._worker = KVTierWorker(kv_caches, self.identity.namespace(rank), self.blocks_per_chunk,
                                        self.socket, name=f"vllm-worker{rank}-{self.config.engine_id}"[:64])
        return self._worker


def _unpadded_block_bytes(kv_cache_config, group_id: int) -> int:
    """Bytes of one engine block over the group's layers, as the worker registers them."""
    group = kv_cache_config.kv_cache_groups[group_id]
    spec = group.kv_cache_spec
    total = 0
    for name in group.layer_names:
        layer = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        total += layer.unpadded_page_size_bytes
    return total
