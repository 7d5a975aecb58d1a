"""``KVTierOffloadingSpec``: vLLM's offloading spec, built once per process.

vLLM hands the spec an ``OffloadingConfig``; the namespace also needs facts
only the full engine config has (model revision, hash algorithm, the
unpadded page size per layer), so ``KVTierConnector`` passes its configs in
while vLLM builds the spec. The stock ``OffloadingConnector`` cannot report a
failed load (it asserts success), so the spec refuses to run under it
rather than risk vLLM reading blocks a failed load never wrote.

Every KV cache group vLLM offloads (``config.groups``: one for most models,
several for hybrid ones) becomes a ``TierGroup`` with its own namespace and
TP layout; sliding-window, chunked-local and Mamba groups are "windowed"
(vLLM looks their chunks up one by one, from the end).

``kv_connector_extra_config`` keys read here (all optional):
``kvtier_socket`` (default: ``$KVTIER_SOCKET`` or the standard path),
``kvtier_events`` (the daemon's block event endpoint, its ``events``
setting: lets the engine's KV events report evictions as they happen; the
daemon lets only operators read it), ``kvtier_tp_layout`` (``"shared"``,
the default: TP sizes share blocks and MLA is stored once where the layout
allows, ``slices.py``; ``"per-rank"``: one namespace per TP rank and size,
as before - the baseline of ``scripts/bench_tp_pool.py``), and vLLM's own
``block_size`` / ``blocks_per_chunk`` (tokens or engine blocks per kvtier block).
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass, replace
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from .groups import TierGroup
from .naming import EngineIdentity
from .slices import KVSlices, plan

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
        vc = engine.vllm_config
        group = config.groups[0]
        for g in config.groups:
            _check_offloadable(engine.kv_cache_config, g.group_id)
        tp_layout = self.extra_config.get("kvtier_tp_layout", "shared")
        if tp_layout not in ("shared", "per-rank"):
            raise ValueError(f"kvtier_tp_layout must be 'shared' or 'per-rank', not {tp_layout!r}")
        self._layouts = [_LayoutFacts.of(vc, engine.kv_cache_config, g.group_id, config.kv_cache_layout)
                         for g in config.groups]
        if tp_layout == "per-rank":
            self._layouts = [replace(f, replicated=False, head_major=False) for f in self._layouts]
        self.windowed = [_windowed(engine.kv_cache_config, g.group_id) for g in config.groups]
        self._group_layers = [engine.kv_cache_config.kv_cache_groups[g.group_id].layer_names for g in config.groups]
        self.slices = self.slices_of(0)
        self.identity = EngineIdentity(
            model=vc.model_config.model, revision=vc.model_config.revision,
            cache_dtype=config.model.dtype,
            kv_layout=f"vllm-{config.kv_cache_layout or vc.cache_config.get_resolved_kv_cache_layout()}"
                      + ("-canonical" if config.canonical_layout else ""),
            tokens_per_block=group.tokens_per_block, blocks_per_chunk=self.blocks_per_chunk,
            tp_size=config.parallel.tp_size, pp_size=config.parallel.pp_size, group_id=group.group_id,
            hash_algo=vc.cache_config.prefix_caching_hash_algo, hash_seed=os.environ.get("PYTHONHASHSEED"),
            kv_slices=self.slices.tag() if self.slices.shared else "")
        self.socket = self.extra_config.get("kvtier_socket") or None
        self.kv_role = getattr(vc.kv_transfer_config, "kv_role", None)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from .manager import KVTierManager
            self.identity.warn_if_unshareable()
            groups = self.tier_groups(rank=0)
            self._manager = KVTierManager(groups, self.blocks_per_chunk, self.socket,
                                          name=f"vllm-scheduler-{self.config.engine_id}"[:64],
                                          events=self._events(groups), kv_role=self.kv_role)
        return self._manager

    def tier_groups(self, rank: int) -> list[TierGroup]:
        """The offloaded groups as worker ``rank`` stores them (the scheduler
        looks up as rank 0; its stand-in block is one slice of an engine block)."""
        out = []
        for g, facts, windowed in zip(self.config.groups, self._layouts, self.windowed):
            sl = self.slices_of(rank, facts)
            ident = replace(self.identity, group_id=g.group_id, tokens_per_block=g.tokens_per_block,
                            kv_slices=sl.tag() if sl.shared else "")
            out.append(TierGroup(g.group_id, ident.namespace(rank), sum(p // sl.count for p in facts.pages),
                                 windowed, sl))
        return out

    def _events(self, groups: list[TierGroup]):
        from .events import DaemonFeed, TierEvents
        # vLLM drains take_events only when it publishes KV events.
        enabled = self.kv_events_config.enable_kv_cache_events
        endpoint = self.extra_config.get("kvtier_events") or None
        feeds = ({g.group_idx: DaemonFeed(endpoint, g.namespace.fingerprint()) for g in groups}
                 if enabled and endpoint else None)
        return TierEvents(enabled, feeds, {g.group_idx: g.slices for g in groups})

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from .worker import KVTierWorker
            groups = self.tier_groups(self.config.parallel.rank)
            self._worker = KVTierWorker(kv_caches, [g.namespace for g in groups], self.blocks_per_chunk,
                                        self.socket,
                                        name=f"vllm-worker{self.config.parallel.rank}-{self.config.engine_id}"[:64],
                                        slices=[g.slices for g in groups])
        return self._worker

    def slices_of(self, rank: int, facts: "_LayoutFacts | None" = None) -> KVSlices:
        """How worker ``rank`` cuts a chunk of a group (default: the first) into kvtier blocks (``slices.py``)."""
        f = facts or self._layouts[0]
        return plan(self.config.parallel.tp_size, rank % self.config.parallel.tp_size, f.total_kv_heads,
                    f.replicated, f.head_major)

    def check_layer_tensors(self, kv_caches: dict) -> None:
        """Worker side, before ``get_worker``: head slices need each head's
        bytes of a block contiguous (``[blocks, heads, ...]``, heads outermost)
        and, with several heads per rank, unpadded blocks.
        vLLM's CPU attention lays KV out so; if this worker's tensors are not,
        it falls back to the per-rank layout (its blocks are never shared; a
        hit another engine stored fails to load here and vLLM recomputes)."""
        checked = []
        for f, layers in zip(self._layouts, self._group_layers):
            tensors = [kv_caches[n] for n in layers if n in kv_caches]
            if f.head_major and not all(_heads_outermost(t, f.local_kv_heads) for t in tensors):
                import logging
                logging.getLogger("kvtier.vllm").error(
                    "kvtier: KV tensors are not head-major %s; this worker uses the per-rank layout",
                    sorted({tuple(t.shape) for t in tensors}))
                f = replace(f, replicated=False, head_major=False)
            checked.append(f)
        self._layouts = checked
        self.slices = self.slices_of(0)
        self.identity = replace(self.identity, kv_slices=self.slices.tag() if self.slices.shared else "")


@dataclass(frozen=True)
class _LayoutFacts:
    """What decides the TP layout, known alike to the scheduler and every worker."""
    pages: tuple[int, ...]     # unpadded page bytes of each layer of the group, on one rank
    total_kv_heads: int
    local_kv_heads: int
    replicated: bool           # every TP rank holds identical bytes (MLA)
    head_major: bool           # head slices are possible (see slices.py)

    @classmethod
    def of(cls, vc, kv_cache_config, group_id: int, kv_cache_layout: str | None) -> "_LayoutFacts":
        group = kv_cache_config.kv_cache_groups[group_id]
        spec = group.kv_cache_spec
        layers = [spec.kv_cache_specs[n] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
                  for n in group.layer_names]
        pc = vc.parallel_config
        tp = pc.tensor_parallel_size
        # No context parallelism (it shards tokens, not heads) and one TP group per PP stage.
        plain = (pc.decode_context_parallel_size == 1 and pc.prefill_context_parallel_size == 1
                 and pc.world_size == tp * pc.pipeline_parallel_size)
        total = vc.model_config.get_total_num_kv_heads()
        replicated = (plain and all(type(s) is MLAAttentionSpec for s in layers)
                      and getattr(kv_cache_config, "kv_tp_replicas", 1) == tp)
        local = {getattr(s, "num_kv_heads", 0) for s in layers}
        head_major = (plain and not replicated and current_platform.is_cpu()
                      and (kv_cache_layout or "LBHNC") == "LBHNC"
                      and all(isinstance(s, AttentionSpec) and not isinstance(s, MLAAttentionSpec)
                              and not s.kv_quant_mode.is_per_token_head for s in layers)
                      and local == {max(1, total // tp)}
                      and all(s.unpadded_page_size_bytes % s.num_kv_heads == 0 for s in layers))
        return cls(tuple(s.unpadded_page_size_bytes for s in layers), total, local.pop() if len(local) == 1 else 0,
                   replicated, head_major)


def _heads_outermost(t, heads: int) -> bool:
    """``t`` is ``[blocks, heads, ...]`` with each head's rest contiguous (and
    the blocks unpadded when a rank holds several heads: its heads are then
    cut into rows of one view)."""
    if t.dim() < 3 or t.shape[1] != heads:
        return False
    inner = 1
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:]))):
        if stride != inner:
            return False
        inner *= size
    return t.stride(1) == inner and (heads == 1 or t.stride(0) == heads * inner)


def _check_offloadable(kv_cache_config, group_id: int) -> None:
    """Attention KV only: a Mamba / linear-attention state is not a run of token blocks."""
    spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
    specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    odd = sorted({type(s).__name__ for s in specs if not isinstance(s, AttentionSpec)})
    if odd:
        raise NotImplementedError(f"kvtier offloads attention KV only; KV cache group {group_id} holds {odd}")


def _windowed(kv_cache_config, group_id: int) -> bool:
    """True unless the group is full attention (vLLM then looks its chunks up as a prefix)."""
    spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return not all(isinstance(s, FullAttentionSpec) for s in spec.kv_cache_specs.values())
    return not isinstance(spec, FullAttentionSpec)
