"""``KVTierHiCacheStorage``: SGLang's HiCache L3 storage on the node's kvtier pool.

Runs in each SGLang rank process (SGLang's cache controller calls it from its
prefetch and write-back threads). SGLang loads it as a dynamic backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage",
        "interface_v1": 1}'

``interface_v1`` makes SGLang hand over host-pool slots (``batch_get_v1`` /
``batch_set_v1``) instead of allocating a page tensor per page first; the
older page-tensor calls (``batch_get``/``batch_set``/``get``/``set``) work too.

The daemon must never be why SGLang stalls or fails: with no daemon the
client starts degraded, ``batch_exists`` answers 0 (a miss), gets and sets
answer False for every page, and the client reconnects by itself. A refused
registration (another block size under the same namespace) does the same,
logged once. Nothing on the data path raises.

Not supported (answered as misses, logged once): SGLang's per-pool ``*_v2``
calls, which hybrid models (Mamba/SWA state pools, DSA indexer pools) use.
``clear()`` never flushes the shared pool (other engines use it).

Primitives: ``KVTierHiCacheStorage(storage_config, kwargs)``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from ...client import Client, KVTierError
from ...transfer.specs import dtype_name
from .naming import PageIdentity, Settings, page_key
from .staging import Staging, drain_to_pool, fill_from_pool, page_starts

log = logging.getLogger("kvtier.sglang")
MAX_BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: more staging rows than this are never used at once


class KVTierHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        """SGLang's factory calls ``cls(storage_config, kwargs)``. Raises
        ValueError for settings that can never work (SGLang fails the attach);
        never for the daemon's absence."""
        self.config = storage_config
        self.settings = Settings.parse(storage_config.extra_config)
        self.client = Client(self.settings.socket, name=f"sglang-tp{storage_config.tp_rank}",
                             timeout=self.settings.timeout_s, token=self.settings.token, require_daemon=False)
        self.host_pool = None
        self.staging: Staging | None = None
        self.identity: PageIdentity | None = None
        self._off = "no host pool registered yet"  # why every call answers a miss ("" once usable)
        self._warned: set[str] = set()

    # ---- set-up --------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The host KV pool pages come from and go to: its geometry names the
        namespace, and the staging buffer is registered with the daemon."""
        super().register_mem_pool_host(mem_pool_host)
        if self.staging is not None:
            raise ValueError("kvtier: a host pool is already registered with this backend")
        cfg = self.config
        page_shape = tuple(mem_pool_host.get_data_page(0, flat=False).shape)
        self.identity = PageIdentity(
            model=cfg.model_name or "", revision=self.settings.model_revision,
            dtype=dtype_name(mem_pool_host.dtype), mla=bool(cfg.is_mla_model), layout=str(mem_pool_host.layout),
            page_size=int(mem_pool_host.page_size), page_shape=page_shape,
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            cp_rank=cfg.attn_cp_rank, cp_size=cfg.attn_cp_size,
            dcp_rank=getattr(cfg, "dcp_rank", 0), dcp_size=getattr(cfg, "dcp_size", 1),
            extra=self.settings.namespace_extra)
        page_bytes = mem_pool_host.get_data_page(0, flat=False).numel() * mem_pool_host.dtype.itemsize
        pages = max(1, min(MAX_BATCH_PAGES, (self.settings.staging_mib << 20) // page_bytes))
        self.host_pool = mem_pool_host
        self.staging = Staging(page_shape, mem_pool_host.dtype, pages)
        try:
            self.client.register_kv_cache(self.staging.kv, block_dims=[0], namespace=self.identity.namespace())
        except KVTierError as exc:  # the daemon refused this layout: SGLang runs on without L3 hits
            self._off = f"the daemon refused the registration ({exc})"
            log.error("kvtier: %s; every page is a miss", self._off)
            return
        self._off = ""
        log.info("kvtier: HiCache pages of %s in namespace %s (%d B per page, %d staging pages each way)%s",
                 cfg.model_name, self.identity.namespace().fingerprint(), page_bytes, pages,
                 "" if self.client.connected else "; no daemon yet, connecting in the background")

    def close(self) -> None:
        self._off = "closed"
        self.client.close()
        if self.staging is not None:
            self.staging.close()

    # ---- lookups -------------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading ``keys`` are in the pool (one round trip; 0 with no daemon,
        before hashing the keys: most of a no-daemon call's time was that hashing)."""
        if self._off or not keys or not self.client.connected:
            return 0
        return self._quietly(lambda: self.client.lookup([page_key(k) for k in keys]), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- zero-copy interface: host-pool slots --------------------------------------------
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        starts = self._starts(keys, host_indices, "batch_get_v1")
        if starts is None:
            return [False] * len(keys)
        pool = self.host_pool
        return self._load(keys, lambda i, row: drain_to_pool(row, pool, starts[i]))

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        starts = self._starts(keys, host_indices, "batch_set_v1")
        if starts is None:
            return [False] * len(keys)
        pool = self.host_pool
        return self._store(keys, lambda i, row: fill_from_pool(row, pool, starts[i]))

    # ---- page-tensor interface (SGLang's default without interface_v1) ------------------
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        targets = list(target_locations or [])
        if len(targets) != len(keys) or not all(self._fits(t) for t in targets):
            self._warn_once("batch_get", "batch_get needs one page-sized tensor per key; answering misses")
            return [None] * len(keys)
        ok = self._load(keys, lambda i, row: targets[i].view(-1).copy_(row.view(-1)))
        return [t if hit else None for t, hit in zip(targets, ok)]

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        values = list(values or [])
        if len(values) != len(keys) or not all(self._fits(v) for v in values):
            self._warn_once("batch_set", "batch_set needs one page-sized tensor per key; nothing stored")
            return False
        return all(self._store(keys, lambda i, row: row.view(-1).copy_(values[i].reshape(-1))))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ---- per-pool interface (hybrid models): not supported, answered as misses ----------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        self._warn_once("v2", "SGLang's per-pool (hybrid model) storage calls are not supported; misses")
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict[str, List[bool]]:
        self._warn_once("v2", "SGLang's per-pool (hybrid model) storage calls are not supported; misses")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict[str, List[bool]]:
        return self.batch_get_v2(transfers, extra_info)

    def clear(self) -> None:
        """SGLang's cache flush: the shared pool is other engines' too, so nothing is removed."""

    # ---- the two transfers ---------------------------------------------------------------
    def _store(self, keys: List[str], fill: Callable[[int, torch.Tensor], Any]) -> List[bool]:
        """Pages ``fill(i, row)`` puts into staging rows, stored under ``keys``
        chunk by chunk; True per page stored (or already in the pool)."""
        hashes = self._usable_hashes(keys)
        if hashes is None:
            return [False] * len(keys)
        st, ok = self.staging, []
        with st.store_lock:
            for c0 in range(0, len(keys), st.pages):
                n = min(st.pages, len(keys) - c0)
                for j in range(n):
                    fill(c0 + j, st.store_rows[j])
                ok += self._settled(lambda: self.client.store(hashes[c0:c0 + n], st.store_ids(n)), n)
        return ok

    def _load(self, keys: List[str], drain: Callable[[int, torch.Tensor], Any]) -> List[bool]:
        """Pages loaded into staging rows under ``keys``, each one that landed
        handed to ``drain(i, row)``; True per page loaded."""
        hashes = self._usable_hashes(keys)
        if hashes is None:
            return [False] * len(keys)
        st, ok = self.staging, []
        with st.load_lock:
            for c0 in range(0, len(keys), st.pages):
                n = min(st.pages, len(keys) - c0)
                landed = self._settled(lambda: self.client.load(hashes[c0:c0 + n], st.load_ids(n)), n)
                for j in range(n):
                    if landed[j]:
                        drain(c0 + j, st.load_rows[j])
                ok += landed
        return ok

    def _settled(self, submit: Callable, n: int) -> List[bool]:
        """Submit one transfer and wait for it: True per block done or skipped.
        The rows are free again once this returns (a done transfer is final)."""
        result = self._quietly(lambda: submit().wait(), None)
        if result is None:
            return [False] * n
        failed = set(result.failed)
        return [j not in failed for j in range(n)]

    # ---- validation and degrading ----------------------------------------------------------
    def _usable_hashes(self, keys) -> list[bytes] | None:
        """kvtier keys of ``keys``, or None when nothing can be moved (no daemon:
        no copy is made for a transfer that would fail at once; a key that is no string)."""
        if self._off or not keys or not self.client.connected:
            return None
        return self._quietly(lambda: [page_key(k) for k in keys], None)

    def _starts(self, keys, host_indices, what: str) -> list[int] | None:
        if self._off or not keys:
            return None
        starts = page_starts(host_indices, len(keys), self.host_pool.page_size)
        size, page = self.host_pool.size, self.host_pool.page_size
        if starts is None or not all(0 <= s and s + page <= size for s in starts):
            self._warn_once(what, f"{what}: host_indices must hold {len(keys)} pages of host slots; "
                                  "answering failures")
            return None
        return starts

    def _fits(self, t) -> bool:
        return (isinstance(t, torch.Tensor) and self.staging is not None and t.dtype == self.host_pool.dtype
                and t.numel() == self.staging.page_numel and t.device.type == "cpu")

    def _quietly(self, call: Callable, default):
        """A data-path call that answers ``default`` instead of raising: SGLang's
        threads must never die for kvtier's sake."""
        try:
            return call()
        except (KVTierError, TimeoutError, ValueError, TypeError) as exc:
            self._warn_once(type(exc).__name__, f"kvtier call failed ({exc}); answering a miss")
            return default

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("kvtier: %s", message)
