"""Pages on their way between SGLang's host KV pool and the daemon.

Runs in each SGLang rank process. The daemon copies only from memory it was
handed as a sealed memfd. SGLang's host pool cannot be that memory:

* its default allocator maps anonymous memory (no descriptor to hand over),
  and its ``shm`` allocator's memfd is created without ``MFD_ALLOW_SEALING``,
  so it can never be sealed against shrinking, which the daemon requires;
* on GPU nodes the pool is pinned (``cudaHostRegister``), and moving its
  storage into a memfd (``adopt_tensors``) is refused for pinned memory;
* the pool keeps raw pointer tables of its own memory for its transfer
  kernels (``k_data_ptrs``); moving the storage would leave them pointing at
  freed memory.

So each backend owns a small sealed buffer (``Staging``): a store copies the
host pool's pages into its store rows and the daemon copies them into the
pool; a load goes the other way. That is one memory copy per page in the
SGLang process on top of the daemon's, chunk by chunk (at most
``pages_per_direction`` pages in flight each way). Loads and stores have rows
of their own, so SGLang's prefetch and write-back threads never wait on each
other.

A page's bytes are SGLang's own page format: ``host_pool.get_data_page(i,
flat=False)`` (a view in the host layout's order) written as one row, read
back with ``host_pool.set_from_flat_data_page`` - the same bytes SGLang's
file backend persists.

Primitives: ``Staging(page_shape, dtype, pages_per_direction)`` with ``kv``,
``load_rows``/``store_rows``, ``load_ids(n)``/``store_ids(n)``, ``close``;
``fill_from_pool``, ``drain_to_pool``, ``page_starts``.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch


class Staging:
    def __init__(self, page_shape: Sequence[int], dtype: torch.dtype, pages_per_direction: int):
        from ...transfer.shm import ShmKVCache
        if pages_per_direction < 1:
            raise ValueError("pages_per_direction must be at least 1")
        self.page_shape = tuple(int(n) for n in page_shape)
        self.pages = pages_per_direction
        # One tensor, one row per page: rows [0, n) for loads, [n, 2n) for stores.
        self.kv = ShmKVCache([(2 * self.pages, *self.page_shape)], dtype)
        rows = self.kv.tensors[0]
        self.load_rows, self.store_rows = rows[:self.pages], rows[self.pages:]
        self.load_lock, self.store_lock = threading.Lock(), threading.Lock()

    @property
    def page_numel(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n

    def load_ids(self, n: int) -> list[int]:
        return list(range(n))

    def store_ids(self, n: int) -> list[int]:
        return list(range(self.pages, self.pages + n))

    def close(self) -> None:
        self.load_rows = self.store_rows = None
        self.kv.close()


def page_starts(host_indices: torch.Tensor, pages: int, page_size: int) -> list[int] | None:
    """First host slot of each of ``pages`` pages, or None when ``host_indices``
    does not hold exactly ``pages`` pages of slots."""
    if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or host_indices.is_floating_point():
        return None
    if host_indices.numel() != pages * page_size:
        return None
    return host_indices[::page_size].tolist()


def fill_from_pool(row: torch.Tensor, host_pool, start: int) -> None:
    """Copy the host pool's page at slot ``start`` into a staging row (one copy)."""
    row.copy_(host_pool.get_data_page(start, flat=False).reshape(row.shape))


def drain_to_pool(row: torch.Tensor, host_pool, start: int) -> None:
    """Copy a staging row into the host pool's page at slot ``start``."""
    host_pool.set_from_flat_data_page(start, row.view(-1))
