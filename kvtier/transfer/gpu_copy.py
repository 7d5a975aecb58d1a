"""Execute copy runs between engine tensors and the pool, two ways.

``dma``: one ``copy_`` per coalesced run; between a CUDA tensor and pinned
host memory that is one ``cudaMemcpyAsync`` on the copy engine. Best for big
runs; each call costs microseconds, so small scattered pieces starve it.

``kernel``: gather/scatter kernels (``index_select`` + ``index_copy_`` over
word views) that read or write the pool through a device view of the mapped
host memory, so any number of small pieces costs a handful of launches.

Both work on any device (the CPU tests run them on CPU tensors to prove they
move the same bytes as ``KVLayout.copy``). Streams and events are the
caller's business.

Primitives: ``storage_bytes(t)``, ``RunCopier(layout, geometry)``,
``.plan(pairs, boundary)``, ``.dma(pool, plan, to_pool)``,
``.kernel(pool_view, plan, to_pool)``, ``MethodChooser``.
"""

from __future__ import annotations

import statistics
import threading

import numpy as np
import torch

from .runs import Geometry, TensorRuns, coalesce, word_bytes

KERNEL_CHUNK_BYTES = 64 << 20   # bounds the daemon's device temporaries per launch
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over ``t``'s whole storage (runs address storage bytes)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class RunCopier:
    def __init__(self, layout, geometry: Geometry):
        self.geometry = geometry
        self.engine = [storage_bytes(m) for m in layout.moved]

    def plan(self, pairs, boundary: int = 0) -> tuple[list[TensorRuns], list[TensorRuns]]:
        """(unit runs for the kernel path, coalesced runs for DMA)."""
        units = self.geometry.unit_runs(pairs)
        return units, [coalesce(r, boundary) for r in units]

    def dma(self, pool: torch.Tensor, runs: list[TensorRuns], to_pool: bool) -> None:
        for r in runs:
            eng = self.engine[r.tensor]
            for e, p, n in zip(r.engine.tolist(), r.pool.tolist(), r.nbytes.tolist()):
                src, dst = eng[e:e + n], pool[p:p + n]
                if not to_pool:
                    src, dst = dst, src
                dst.copy_(src, non_blocking=True)

    def kernel(self, pool_view: torch.Tensor, runs: list[TensorRuns], to_pool: bool) -> None:
        """``runs`` must be unit runs (one length per tensor)."""
        jobs = [self._kernel_job(pool_view, r) for r in runs if len(r.nbytes)]
        if not jobs:
            return
        # Every run start (in words, relative to its span) crosses to the device in one
        # copy: a synchronous transfer per tensor would stall the stream 2x per layer.
        starts = torch.from_numpy(np.concatenate([j[-1] for j in jobs])).to(pool_view.device)
        at = 0
        for eng_w, pool_w, words, n, _ in jobs:
            lane = torch.arange(words, device=pool_view.device, dtype=torch.int64)
            e_starts, p_starts = starts[at:at + n], starts[at + n:at + 2 * n]
            at += 2 * n
            per = max(1, KERNEL_CHUNK_BYTES // (words * eng_w.element_size()))
            for i in range(0, n, per):
                e_idx = (e_starts[i:i + per, None] + lane).reshape(-1)
                p_idx = (p_starts[i:i + per, None] + lane).reshape(-1)
                if to_pool:
                    pool_w.index_copy_(0, p_idx, eng_w.index_select(0, e_idx))
                else:
                    eng_w.index_copy_(0, e_idx, pool_w.index_select(0, p_idx))

    def _kernel_job(self, pool_view: torch.Tensor, r: TensorRuns):
        """Word views over the spans one tensor's runs touch, plus the run starts.

        Only the touched spans are indexed: small index values, and a pool of
        hundreds of GiB never becomes one huge indexed tensor."""
        run = int(r.nbytes[0])
        e_lo, p_lo = int(r.engine.min()), int(r.pool.min())
        eng = self.engine[r.tensor][e_lo:int(r.engine.max()) + run]
        pool = pool_view[p_lo:int(r.pool.max()) + run]
        w = word_bytes(r.engine, r.pool, r.nbytes[:1], np.array([eng.data_ptr(), pool.data_ptr()]))
        starts = np.concatenate([(r.engine - e_lo) // w, (r.pool - p_lo) // w])
        return _words(eng, w), _words(pool, w), run // w, len(r.nbytes), starts


def _words(b: torch.Tensor, w: int) -> torch.Tensor:
    return b[: b.numel() // w * w].view(_WORD[w])


class MethodChooser:
    """Picks the faster copy method per (direction, run-size bucket) from
    measurements: each method is tried ``trials`` times, then the one with
    the best median throughput wins. Thread-safe; pure bookkeeping."""

    def __init__(self, methods=("dma", "kernel"), trials: int = 3):
        self.methods, self.trials = tuple(methods), trials
        self._samples: dict[tuple, dict[str, list[float]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(to_pool: bool, run_bytes: int) -> tuple[str, int]:
        bucket = 1 << max(0, int(run_bytes) - 1).bit_length()  # next power of two
        return ("store" if to_pool else "load", bucket)

    def pick(self, key) -> str:
        with self._lock:
            seen = self._samples.setdefault(key, {m: [] for m in self.methods})
            for m in self.methods:
                if len(seen[m]) < self.trials:
                    return m
            return max(self.methods, key=lambda m: statistics.median(seen[m]))

    def record(self, key, method: str, nbytes: int, seconds: float) -> None:
        if seconds <= 0 or method not in self.methods:
            return
        with self._lock:
            seen = self._samples.setdefault(key, {m: [] for m in self.methods})
            seen[method] = (seen[method] + [nbytes / seconds / 1e9])[-16:]

    def report(self) -> dict:
        """{"store/32768": {"dma": GB/s, "kernel": GB/s}} medians so far."""
        with self._lock:
            return {f"{d}/{b}": {m: round(statistics.median(v), 3) for m, v in s.items() if v}
                    for (d, b), s in self._samples.items()}
