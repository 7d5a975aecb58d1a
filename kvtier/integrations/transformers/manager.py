"""The entry point: HF continuous batching with kvtier as swap pool and prefix tier.

    with KVTierContinuousBatchingManager(model, model_id="org/name", revision="abc") as cb:
        outputs = cb.generate(prompts, max_new_tokens=32)
        print(cb.counters)

It is HF's ``ContinuousBatchingManager`` with one hook: when HF builds its
batch processor, the paged cache is moved into shared memory and registered
with the local kvtier daemon (a CUDA paged cache is registered in place over
CUDA IPC instead), ``KVTierOffloadingManager`` replaces HF's
offloading manager and the ``kvtier`` scheduler gets the tier. Without a
daemon everything still runs, as plain HF: swapped-out requests are soft
reset and no prefix comes from kvtier, the cache stays in HF's own memory
(moved and registered only once the client has found a daemon, between two
steps), and the client re-registers after a daemon restart.

Primitives: ``KVTierContinuousBatchingManager``, ``generate_batch``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.requests import GenerationOutput

from ...client import Client, KVTierError
from .scheduler import SCHEDULER_NAME, KVTierScheduler
from .swap import KVTierOffloadingManager
from .tier import HFKVTier, TierCounters, namespace_for, supports

log = logging.getLogger("kvtier.transformers")


class KVTierContinuousBatchingManager(ContinuousBatchingManager):
    def __init__(self, model, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None, *,
                 model_id: str | None = None, revision: str | None = None, socket: str | None = None,
                 client_name: str = "", transfer_timeout: float = 30.0, workload_hints=None) -> None:
        """``model_id``/``revision`` name the weights in kvtier's namespace
        (default: the model's ``name_or_path`` and commit hash); two processes
        share blocks only when they agree. ``socket``: the daemon's socket
        (default: kvtier's default socket)."""
        cb_config = continuous_batching_config or ContinuousBatchingConfig()
        if cb_config.scheduler_type not in ("fifo", SCHEDULER_NAME):
            log.warning("kvtier: scheduler %r replaced by %r (FIFO order)", cb_config.scheduler_type, SCHEDULER_NAME)
        cb_config.scheduler_type = SCHEDULER_NAME
        cb_config.cpu_offload_space = 0.0  # kvtier is the swap pool; HF's pinned pool cannot exist on CPU anyway
        gen_config = generation_config if generation_config is not None else model.generation_config
        super().__init__(model, gen_config, cb_config, workload_hints)
        self.model_id, self.revision = _identity(model, model_id, revision)
        self.socket, self.transfer_timeout = socket, transfer_timeout
        self.client_name = client_name or f"hf-cb-{os.getpid()}"
        self.counters = TierCounters()
        self.tier: HFKVTier | None = None

    # ---- the hook ------------------------------------------------------------------------
    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        reused = isinstance(getattr(self, "batch_processor", None), ContinuousBatchProcessor)
        processor = super()._create_batch_processor()
        if not reused:  # a new paged cache: the old tier (if any) served the previous one
            self._close_tier()
            self.tier = self._attach(processor)
        return processor

    def _attach(self, processor: ContinuousBatchProcessor) -> HFKVTier | None:
        why = supports(processor.cache)
        if not why and self.distributed_helper.tp_size > 1:
            why = "tensor parallelism is not supported (ranks would need to agree on every swap)"
        if not why and not isinstance(processor.scheduler, KVTierScheduler):
            why = f"scheduler {type(processor.scheduler).__name__} is not kvtier's"
        if why:
            log.warning("kvtier disabled for this model, running plain HF: %s", why)
            return None
        # Without a daemon the engine must not stall its start: at most 1 s for a
        # socket nobody answers; the client's keeper connects later.
        client = Client(self.socket, name=self.client_name, transfer_timeout=self.transfer_timeout,
                        require_daemon=False)
        try:
            # CUDA: HF's forward runs on its compute stream, so copies are fenced there.
            tier = HFKVTier.attach(processor.cache, client,
                                   namespace_for(processor.cache, self.model_id, self.revision),
                                   stream=processor.inputs_and_outputs.compute_stream)
        except (KVTierError, OSError, ValueError) as exc:  # refused registration, no shm: plain HF
            client.close()
            log.warning("kvtier disabled for this model, running plain HF: %s", exc)
            return None
        tier.counters = self.counters
        processor.scheduler.tier = tier
        processor.offloading_manager = KVTierOffloadingManager(
            processor.cache, processor.scheduler, tier, processor.inputs_and_outputs.compute_stream,
            self.distributed_helper)
        return tier

    # ---- lifecycle -------------------------------------------------------------------------
    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        super().stop(block=block, timeout=timeout, keep_for_next_session=keep_for_next_session,
                     hard_stop=hard_stop)
        if not keep_for_next_session and self._generation_thread is None:  # the loop has exited
            self._close_tier()

    def destroy(self) -> None:
        super().destroy()
        if self._generation_thread is None:
            self._close_tier()

    def _close_tier(self) -> None:
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def __enter__(self) -> "KVTierContinuousBatchingManager":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(block=True)
        self.destroy()

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                 record_timestamps: bool = False, timeout: float | None = None) -> list[GenerationOutput]:
        """Submit ``inputs`` and wait for all of them; outputs in input order
        (a failed request carries its ``error``). The manager must be started."""
        ids = self.add_requests([list(p) for p in inputs], max_new_tokens=max_new_tokens,
                                record_timestamps=record_timestamps)
        done: dict[str, GenerationOutput] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(done) < len(ids):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(ids) - len(done)} requests unfinished after {timeout}s")
            result = self.get_result(timeout=0.5)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not self.is_running():
                raise RuntimeError("the generation loop stopped before every request finished")
        return [done[i] for i in ids]


def generate_batch(model, inputs: Sequence[Sequence[int]], max_new_tokens: int | None = None, *,
                   generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None,
                   **manager_kwargs) -> list[GenerationOutput]:
    """One-shot ``model.generate_batch`` with kvtier: start a manager, run
    ``inputs`` to completion, stop it. ``manager_kwargs`` go to
    ``KVTierContinuousBatchingManager`` (``model_id``, ``revision``, ``socket``...)."""
    with KVTierContinuousBatchingManager(model, generation_config, continuous_batching_config,
                                         **manager_kwargs) as manager:
        return manager.generate(inputs, max_new_tokens=max_new_tokens)


def _identity(model, model_id: str | None, revision: str | None) -> tuple[str, str]:
    config = model.config
    model_id = model_id or getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not model_id:
        raise ValueError("pass model_id=...: kvtier shares blocks only between processes that name the same "
                         "weights, and this model has no name_or_path")
    return model_id, revision if revision is not None else (getattr(config, "_commit_hash", None) or "")
