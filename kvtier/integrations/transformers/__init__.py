"""Hugging Face transformers continuous batching on kvtier (``pip install kvtier[transformers]``).

Two features for every HF process on the node:

- **shared swap pool**: when the paged cache is full, the requests HF preempts
  are swapped out to kvtier and restored byte-exact later, instead of being
  recomputed ("soft reset"); HF's own CPU pool needs pinned memory, which a
  CPU-only machine does not have.
- **shared prefix tier**: finished requests' full blocks are stored in
  kvtier; a prompt whose prefix any HF process computed before loads those
  blocks instead of prefilling them.

    from kvtier.integrations.transformers import KVTierContinuousBatchingManager

    with KVTierContinuousBatchingManager(model, model_id="org/name") as cb:
        outputs = cb.generate(prompts, max_new_tokens=32)

Primitives: ``KVTierContinuousBatchingManager``, ``generate_batch``,
``TierCounters``; the parts: ``KVTierScheduler`` (``scheduler_type="kvtier"``),
``KVTierOffloadingManager``, ``HFKVTier``.
"""

from .manager import KVTierContinuousBatchingManager, generate_batch
from .scheduler import SCHEDULER_NAME, KVTierScheduler
from .swap import KVTierOffloadingManager
from .tier import HFKVTier, TierCounters

__all__ = ["HFKVTier", "KVTierContinuousBatchingManager", "KVTierOffloadingManager", "KVTierScheduler",
           "SCHEDULER_NAME", "TierCounters", "generate_batch"]
