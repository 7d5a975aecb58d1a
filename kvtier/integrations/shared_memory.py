"""Moving an engine's CPU KV tensor into memory the kvtier daemon can map.

The daemon copies blocks straight from the engine's KV tensor, so on CPU that
tensor must live in a shared segment (``ShmKVCache``). Engines that allocate
their cache themselves (Hugging Face's paged cache is one ``torch.zeros``)
call ``adopt_into_shared_memory`` once, before the first forward pass, and
point their views at the returned tensor.

Kept behind this single function on purpose: how the memory is shared (a
named POSIX segment today) can change without touching any integration.
"""

from __future__ import annotations

import torch

from ..transfer.shm import ShmKVCache


def adopt_into_shared_memory(tensor: torch.Tensor, rows: int) -> ShmKVCache:
    """A shared-memory copy of the CPU ``tensor``'s bytes, as one uint8 tensor
    of shape ``(rows, nbytes // rows)`` (``kv.tensors[0]``: one row per engine
    block, ready for ``Client.register_kv_cache(kv, [0], ...)``).

    The caller switches its views to ``kv.tensors[0]`` and drops ``tensor``;
    it must ``kv.close()`` when the engine goes away."""
    if tensor.device.type != "cpu":
        raise ValueError(f"only CPU tensors can be adopted, got {tensor.device}")
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    if rows <= 0 or flat.numel() % rows:
        raise ValueError(f"{flat.numel()} bytes do not split into {rows} equal rows")
    kv = ShmKVCache([(rows, flat.numel() // rows)], torch.uint8)
    kv.tensors[0].view(-1).copy_(flat)
    return kv
