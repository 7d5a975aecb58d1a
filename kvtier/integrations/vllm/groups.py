"""A model's KV cache groups as kvtier stores them, and one vLLM job split by group.

Hybrid models (sliding-window layers next to full attention: Gemma-2/3,
GPT-OSS, Mistral-style windows) have several KV cache groups. Each group has
its own engine block ids for the same tokens, and vLLM's offload key already
names the group (its last 4 bytes), so kvtier keeps one namespace per model
and group: a group's chunks are shared by every engine of the model, and a
lookup or a load in one group never sees another's bytes.

vLLM's scheduler decides, per group, which chunks a prefix hit needs and
which are worth storing (``OffloadingConnectorScheduler``): a full-attention
group is looked up as a prefix, a sliding-window group from the end, needing
only the chunks inside its window before the hit boundary; the hit it
reports is the largest that every group can serve. kvtier answers each
group's lookups for what its namespace holds and moves the chunks vLLM names,
so a hit is never larger than what every group can load, and a load that
fails in any group fails the whole request's receive (vLLM recomputes).

What a window group stores: vLLM's interface hands ``prepare_store`` the
chunks its scheduler chose, and kvtier stores exactly those. vLLM chooses
only chunks whose blocks it still holds (its sliding-window manager frees a
block once it falls out of the window, and never allocates the ones a
one-step prefill would free at once) and that some hit could need
(``reachable_block_mask``): since a later prompt may end at any chunk
boundary, and a hit there needs the window before it, every chunk vLLM
still holds is one some hit needs; ``prefix_cache_retention_interval``
narrows the boundaries vLLM keeps, and so what is stored. kvtier cannot
know better which boundaries future prompts will hit, so it adds no filter.

Pure functions over plain values (no vLLM import, no I/O): the scheduler
and every worker process agree on them. Primitives: ``TierGroup``,
``GroupTransfer``, ``split_job``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...client import Namespace
from .slices import PER_RANK, KVSlices


@dataclass(frozen=True)
class TierGroup:
    """One of the engine's KV cache groups as kvtier stores it."""
    group_idx: int              # vLLM's KV cache group id (an offload key's last 4 bytes)
    namespace: Namespace        # one per model and group, whatever the engine
    engine_block_bytes: int     # unpadded bytes of one engine block over the group's layers (one slice of it)
    windowed: bool = False      # sliding window / chunked local: vLLM looks its chunks up one by one
    slices: KVSlices = PER_RANK  # how a chunk becomes kvtier blocks across TP ranks (``slices.py``)


@dataclass(frozen=True)
class GroupTransfer:
    """The part of a vLLM job that touches one group: whole kvtier chunks."""
    position: int               # the group's position in the engine's group list
    hashes: list[bytes]
    block_ids: list[int]
    skip: int                   # engine blocks of the first chunk not moved (a load starting mid-chunk)


def split_job(hashes: Sequence[Sequence[bytes]], block_ids: Sequence[int], group_sizes: Sequence[int],
              block_indices: Sequence[int], blocks_per_chunk: int,
              is_load: bool) -> tuple[list[GroupTransfer], list[str]]:
    """Split one job into per-group transfers of whole chunks.

    ``hashes[g]``: the kvtier keys of group ``g``'s chunks, in order; the
    block ids are group after group, ``group_sizes[g]`` of them, the first at
    block index ``block_indices[g]`` of the request (vLLM's
    ``GPULoadStoreSpec``). Returns the transfers and, for each group whose
    blocks cannot be matched to chunks, why: that group is left out (the
    caller fails a load with any; a store left out is only a later miss).

    A load may start mid-chunk (the engine already holds the first blocks):
    that chunk is loaded with ``skip``. A store's first chunk may lack its
    first blocks (a sliding window freed them before the store): kvtier
    stores whole chunks only, so that chunk is left out, not half stored."""
    k = blocks_per_chunk
    if len(hashes) != len(group_sizes) or len(block_indices) != len(group_sizes):
        return [], [f"{len(hashes)} key lists for {len(group_sizes)} groups"]
    if sum(group_sizes) != len(block_ids):
        return [], [f"{len(block_ids)} blocks for group sizes {list(group_sizes)}"]
    out: list[GroupTransfer] = []
    problems: list[str] = []
    start = 0
    for g, (size, first, keys) in enumerate(zip(group_sizes, block_indices, hashes)):
        ids = list(block_ids[start:start + size])
        keys = list(keys)
        start += size
        if not keys and not ids:
            continue
        skip = int(first) % k if ids else 0
        if not is_load and skip and keys and len(ids) == len(keys) * k - skip:
            keys, ids, skip = keys[1:], ids[k - skip:], 0
        if len(ids) != len(keys) * k - skip:
            problems.append(f"group {g}: {len(ids)} blocks for {len(keys)} chunks of {k} (skip {skip})")
        elif keys:
            out.append(GroupTransfer(g, keys, ids, skip))
    return out, problems
