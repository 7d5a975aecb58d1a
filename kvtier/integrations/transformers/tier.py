"""One HF paged cache's session with kvtier: the block copies, nothing else.

Runs in the engine process, on HF's generation thread. ``attach`` registers
the paged cache tensor through ``EngineKV`` (CPU: its storage moved into shared
memory; CUDA: in place over CUDA IPC, copies fenced on HF's compute stream) so
kvtier block ids are HF block ids (rows of the allocator's ``_copy_view``).
With no daemon at attach, the cache stays in HF's own memory and nothing is
hashed, looked up or copied (``live`` is False): HF runs as without kvtier.
``register_when_connected``, called between steps, moves and registers the
cache once the client's keeper has found a daemon. The scheduler and
the offloading manager decide *what* to copy; this object does the copy and
reports the outcome as a value, never an exception: the engine then falls
back to what plain HF does (recompute).

HF hands a block to another request as soon as it is free, so a block must
not be freed while the daemon may still read or write it. Loads, offloads
and restores are waited for (the engine needs their outcome before it goes
on); blocks a failed one may still be written (``TransferHandle.held_blocks``)
are parked in ``quarantine`` until the daemon lets go of them. Stores are
not waited for: a finished request's blocks stay allocated under a holder
entry of HF's block table while the daemon reads them, and
``finished_stores`` names the holders HF may free.

Primitives: ``attach``, ``live``, ``register_when_connected``, ``prefix_keys``, ``lookup``, ``load``, ``store``, ``finished_stores``,
``offload``, ``restore``, ``swapped_requests``, ``discard``, ``discard_all``, ``release_quarantine``,
``close``.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ...client import Client, KVTierError, Namespace, TransferHandle, block_hashes
from ..engine_kv import EngineKV

if TYPE_CHECKING:
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

log = logging.getLogger("kvtier.transformers")


@dataclass
class TierCounters:
    """What the tier did for this engine (``KVTierContinuousBatchingManager.counters``)."""
    offloaded_requests: int = 0   # swapped out to kvtier instead of being soft reset
    soft_resets: int = 0          # victims kvtier took no copy of (no room, no daemon): recomputed
    restored_requests: int = 0    # swapped back in, byte-exact
    lost_swaps: int = 0           # restore failed (daemon restarted): soft reset before scheduling
    prefix_lookups: int = 0
    prefix_hits: int = 0          # requests that loaded at least one block from kvtier
    loaded_blocks: int = 0
    loaded_tokens: int = 0        # prompt tokens not prefilled thanks to kvtier
    stored_blocks: int = 0        # blocks newly copied into kvtier (already-present ones skipped)
    computed_tokens: int = 0      # tokens the model ran a forward pass on (prefill + decode)

    def as_dict(self) -> dict:
        return asdict(self)


def namespace_for(cache: "PagedAttentionCache", model_id: str, revision: str, tp_rank: int = 0,
                  tp_size: int = 1) -> Namespace:
    """Two processes share blocks only when the bytes mean the same thing: same
    weights (id and revision), dtype, page size and HF's paged layout, whose
    byte order is HF's own (so the transformers version is part of it)."""
    import transformers

    (name, allocator), = cache.cache_allocators.items()
    layout = (f"hf-paged-{name}-L{allocator.pages_per_block}-kv{allocator.num_key_value_heads}"
              f"x{allocator.head_dim}-tf{transformers.__version__}")
    model = f"{model_id}@{revision}" if revision else model_id
    return Namespace(model=model, dtype=str(cache.dtype).removeprefix("torch."), layout=layout,
                     block_size=allocator.tokens_per_page, tp_rank=tp_rank, tp_size=tp_size)


def supports(cache: "PagedAttentionCache") -> str:
    """Why this cache cannot use kvtier ("" if it can)."""
    if len(cache.cache_allocators) != 1 or "full_attention" not in cache.cache_allocators:
        return "only models whose layers all use full attention (one cache allocator) are supported"
    if cache.cache_tensor.device.type not in ("cpu", "cuda"):
        return f"paged caches on {cache.cache_tensor.device.type} are not supported (CPU and CUDA are)"
    return ""


class HFKVTier:
    def __init__(self, engine: EngineKV, cache: "PagedAttentionCache", namespace: Namespace):
        self.engine, self.client, self.cache, self.namespace = engine, engine.client, cache, namespace
        (self.allocator,) = cache.cache_allocators.values()
        self.page_size = self.allocator.tokens_per_page
        self.counters = TierCounters()
        self._swapped: dict[str, int] = {}  # request id -> blocks kvtier holds for it
        self.quarantine: list[tuple[TransferHandle, list[int]]] = []
        self.stores: list[tuple[TransferHandle, str]] = []  # in flight, and the block-table entry holding its blocks
        self._holders = itertools.count()

    @classmethod
    def attach(cls, cache: "PagedAttentionCache", client: Client, namespace: Namespace,
               stream=None) -> "HFKVTier":
        """Register ``cache``'s tensor (same tensor objects, same bytes: HF's
        views follow and outputs do not change); block ids are rows of ``_copy_view``.
        With no daemon connected, only once one is (``register_when_connected``).
        ``stream``: HF's compute stream on CUDA (None: the current stream).
        Raises KVTierError when the daemon refuses it."""
        allocator = next(iter(cache.cache_allocators.values()))
        flat = cache.cache_tensor.reshape(-1).view(torch.uint8)
        if flat.data_ptr() != cache.cache_tensor.data_ptr():
            raise ValueError("HF's cache tensor is not contiguous: cannot register it")
        rows = flat.numel() // allocator.bytes_per_block
        engine = EngineKV([flat[: rows * allocator.bytes_per_block].view(rows, -1)], [0], client, namespace,
                          stream=stream, defer=True)
        if engine.refusal is not None:
            engine.close()
            raise engine.refusal
        return cls(engine, cache, namespace)

    @property
    def live(self) -> bool:
        """A daemon holds this cache's registration now: worth hashing, looking up, copying."""
        return self.engine.registered and self.engine.enabled and self.client.connected

    def register_when_connected(self) -> None:
        """Between steps (HF reads and writes no block): a daemon the client
        found since ``attach`` gets the cache (moved into shared memory first)."""
        if not self.engine.registered and self.engine.register_when_connected():
            log.info("kvtier: daemon connected; the paged cache is registered now")

    # ---- prefix tier ---------------------------------------------------------------
    def prefix_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """kvtier keys of the full blocks of ``tokens`` (same in every process)."""
        return block_hashes(tokens, self.page_size)

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.counters.prefix_lookups += 1
        return self.client.lookup(keys) if keys and self.live else 0

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Copy pool blocks into engine blocks; the number of *leading* blocks
        that arrived (a prefix is only usable up to its first hole)."""
        handle = self.engine.load(keys, block_ids)
        result = self.engine.landed(handle)
        self._park(handle, block_ids)
        loaded = min(result.failed) if result.failed else len(keys)
        if loaded:
            self.counters.prefix_hits += 1
            self.counters.loaded_blocks += loaded
            self.counters.loaded_tokens += loaded * self.page_size
        return loaded

    def store(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> str | None:
        """Start copying completed engine blocks into the pool, without waiting.
        Returns the name of a new, empty holder entry while the daemon may
        still read ``block_ids``: the caller moves those blocks' references
        there (so HF neither frees nor reuses them) and frees the holder once
        ``finished_stores`` names it. None: nothing is being read any more."""
        if not keys or not self.live:
            return None
        handle = self.engine.store(keys, block_ids)
        if handle.done():  # failed at once (no daemon) or already answered
            self._stored(handle)
            return None
        holder = f"kvtier-store:{next(self._holders)}"
        self.stores.append((handle, holder))
        return holder

    def finished_stores(self, wait: bool = False) -> list[str]:
        """Holders whose store the daemon no longer reads (with ``wait``: all of
        them, once each is final); the caller frees their blocks."""
        done, pending = [], []
        for handle, holder in self.stores:
            if wait or handle.done():
                self._stored(handle)
                done.append(holder)
            else:
                pending.append((handle, holder))
        self.stores = pending
        return done

    def _stored(self, handle: TransferHandle) -> None:
        self.counters.stored_blocks += handle.wait().done

    # ---- request swap --------------------------------------------------------------
    def offload(self, tables: Mapping[str, Sequence[int]]) -> set[str]:
        """Swap out several requests at once; the ids kvtier took. The copy has
        finished on return, so HF may hand their blocks to other requests."""
        tables = {rid: list(ids) for rid, ids in tables.items() if ids}
        if not tables:
            return set()
        if not self.live:  # no daemon: nothing to send, HF soft-resets them
            self.counters.soft_resets += len(tables)
            return set()
        result = self.engine.offload(tables).wait()
        if result.error:  # no reply (timeout, daemon gone): a record may exist anyway, drop it by name
            for rid in result.failed_requests:
                self._discard_quietly(rid)
        taken = set(tables) - set(result.failed_requests)
        for rid in taken:
            self._swapped[rid] = len(tables[rid])
        self.counters.offloaded_requests += len(taken)
        self.counters.soft_resets += len(tables) - len(taken)
        return taken

    def swapped_requests(self) -> list[str]:
        return list(self._swapped)

    def swapped_blocks(self, request_id: str) -> int:
        """Blocks kvtier holds for a swapped request (0 if none)."""
        return self._swapped.get(request_id, 0)

    def restore(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """Copy a swapped request back into ``block_ids`` (as many as were
        offloaded). False: the swap is gone (daemon restarted or missing) and
        the request must be recomputed."""
        self._swapped.pop(request_id)
        handle = self.engine.restore(request_id, block_ids)
        result = self.engine.landed(handle)
        self._park(handle, block_ids)
        if result.ok:
            self.counters.restored_requests += 1
            return True
        self.counters.lost_swaps += 1
        self._discard_quietly(request_id)
        log.info("kvtier: swap of %s lost (%s); recomputing it", request_id, result.error or "failed")
        return False

    def discard(self, request_id: str) -> None:
        if self._swapped.pop(request_id, None) is not None:
            self._discard_quietly(request_id)

    def discard_all(self) -> None:
        for rid in list(self._swapped):
            self.discard(rid)

    def _discard_quietly(self, request_id: str) -> None:
        try:
            self.client.discard(request_id)
        except KVTierError:
            pass  # unknown to the daemon: nothing is held for it

    # ---- blocks a failed transfer may still write --------------------------------------
    def _park(self, handle: TransferHandle, block_ids: Sequence[int]) -> None:
        held = set(handle.held_blocks)
        if held:
            self.quarantine.append((handle, [b for b in block_ids if b in held]))

    def is_parked(self, block_id: int) -> bool:
        return any(block_id in ids for _, ids in self.quarantine)

    def release_quarantine(self) -> list[int]:
        """Parked blocks the daemon has let go of since; the caller frees them."""
        free, keep = [], []
        for handle, ids in self.quarantine:
            (keep.append((handle, ids)) if handle.held_blocks else free.extend(ids))
        self.quarantine = keep
        return free

    def close(self) -> None:
        self.finished_stores(wait=True)  # let the last stores commit rather than cancel them
        self.discard_all()
        self.engine.close()

