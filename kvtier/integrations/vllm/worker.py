"""Worker side (vLLM worker process): move chunks between vLLM's KV cache and kvtier.

A thin shim over ``EngineKV``: vLLM's canonical per-layer KV tensors are
registered as they are, CPU ones adopted into shared memory (their storage
moves, so attention's views read the new memory), CUDA ones in place over CUDA
IPC (each TP rank registers its own GPU). Each layer tensor is registered as
one tensor of ``(num_blocks, page_bytes)``; one kvtier block holds
``blocks_per_chunk`` engine blocks of every layer. On CUDA a store is fenced
on the worker's stream when it is submitted (after the forward that wrote the
blocks) and a finished load makes that stream wait for the daemon's copy
before vLLM's next step reads the blocks.

TP layouts (``slices.py``): with head slices each layer is registered as
``(num_blocks * count, page / count)`` - row ``block * count + j`` is local
head ``j`` of ``block`` - and a job becomes one transfer per held slice
(keys ``held_keys``); with replicated KV this rank stores only the chunks it
``writes`` and a job with none finishes at once. A job is done when all its
transfers are, and a load succeeds only when every one did.

Jobs never fail at submission: a load the daemon could not serve (evicted
since the lookup, daemon gone) comes back from ``get_finished`` with
``success=False``; the connector turns that into a failed receive so vLLM
recomputes. A store that fails only means a later miss.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ...client import Client, Namespace
from ..engine_kv import EngineKV, Finished
from .manager import KVTierSpecs
from .slices import PER_RANK, KVSlices

log = logging.getLogger("kvtier.vllm")


class KVTierWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, namespace: Namespace, blocks_per_chunk: int,
                 socket: str | None, name: str, slices: KVSlices = PER_RANK):
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("kvtier supports models with one KV cache group")
        refs = kv_caches.group_data_refs[0]
        self.slices = slices
        # The unpadded page of each layer: padding never holds KV.
        views = [_sliced(kv_caches.tensors[r.tensor_idx].tensor, r.page_size_bytes, slices.count) for r in refs]
        self.engine_block_bytes = sum(r.page_size_bytes for r in refs) // slices.count  # one slice
        self.k = blocks_per_chunk
        self.engine = EngineKV(views, [0] * len(views), Client(socket, name=name, require_daemon=False),
                               namespace, block_factor=blocks_per_chunk)
        self._parts: dict[int, list[Finished | None]] = {}   # job -> its transfers' results so far
        self._done_now: list[TransferResult] = []           # jobs with nothing for this rank to move

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    *args, **kwargs) -> bool:
        assert isinstance(src_spec, KVTierSpecs)
        ids = dst_spec.block_ids.tolist()
        skip = int(dst_spec.block_indices[0]) % self.k if len(dst_spec.block_indices) else 0
        return self._submit(job_id, True, src_spec.hashes, ids, skip)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec,
                     *args, **kwargs) -> bool:
        assert isinstance(dst_spec, KVTierSpecs)
        return self._submit(job_id, False, dst_spec.hashes, src_spec.block_ids.tolist(), 0)

    def _submit(self, job_id: int, is_load: bool, hashes: list[bytes], ids: list[int], skip: int) -> bool:
        if self.engine.enabled and len(ids) != len(hashes) * self.k - skip:
            # Never a partial chunk here (vLLM sends whole chunks); refuse rather
            # than guess which blocks go where: a load fails, a store is dropped.
            log.warning("kvtier: job %d has %d blocks for %d chunks (skip %d); not transferred",
                        job_id, len(ids), len(hashes), skip)
            self.engine.fail(job_id, is_load, len(ids), "blocks do not make whole chunks")
            return True
        parts = self._transfers(is_load, hashes, ids, skip)
        if not parts:  # replicated KV: another rank writes every chunk of this store
            self._done_now.append(TransferResult(job_id, success=True))
            return True
        if len(parts) == 1:
            self.engine.submit(job_id, is_load, *parts[0], skip)
            return True
        self._parts[job_id] = [None] * len(parts)
        for j, (part_hashes, part_ids) in enumerate(parts):
            self.engine.submit((job_id, j), is_load, part_hashes, part_ids, skip)
        return True

    def _transfers(self, is_load: bool, hashes: list[bytes], ids: list[int],
                   skip: int) -> list[tuple[list[bytes], list[int]]]:
        """(kvtier keys, engine rows) per held slice; stores keep only the chunks this rank writes."""
        sl, k = self.slices, self.k
        if not is_load and sl.replicas > 1:
            mine = [i for i, h in enumerate(hashes) if sl.writes(h)]
            hashes, ids = [hashes[i] for i in mine], [b for i in mine for b in ids[i * k:(i + 1) * k]]
            if not hashes:
                return []
        if sl.count == 1 and sl.slices == 1:
            return [(hashes, ids)]
        keys = [sl.held_keys(h) for h in hashes]
        return [([ks[j] for ks in keys], [sl.engine_id(b, j) for b in ids]) for j in range(sl.count)]

    def get_finished(self) -> list[TransferResult]:
        out, self._done_now = self._done_now, []
        for f in self.engine.finished():
            if not isinstance(f.job_id, tuple):
                out.append(self._result(f.job_id, [f]))
                continue
            job_id, j = f.job_id
            parts = self._parts[job_id]
            parts[j] = f
            if all(p is not None for p in parts):
                del self._parts[job_id]
                out.append(self._result(job_id, parts))
        return out

    def _result(self, job_id: int, parts: list[Finished]) -> TransferResult:
        is_load = parts[0].is_load
        ok = all(f.result.ok for f in parts)
        if is_load and not ok and self.engine.enabled:
            bad = [f.result for f in parts if not f.result.ok]
            log.warning("kvtier: load job %d failed (%d of %d chunks): %s; vLLM recomputes", job_id,
                        max(len(r.failed) for r in bad), parts[0].engine_blocks, bad[0].error or "evicted")
        moved = sum(f.engine_blocks if is_load else f.result.done * self.k for f in parts)
        return TransferResult(job_id, success=ok or not is_load, transfer_size=moved * self.engine_block_bytes,
                              transfer_time=max(f.seconds for f in parts))

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs stopped touching their blocks (preemption:
        vLLM reuses the blocks right after). Their results still come from
        ``get_finished``."""
        self.engine.wait([part for j in job_ids
                          for part in ([(j, i) for i in range(len(self._parts[j]))] if j in self._parts else [j])])

    def shutdown(self) -> None:
        self.engine.close()


def _sliced(tensor, page_bytes: int, count: int):
    """A layer's ``(num_blocks, page)`` int8 view as ``count`` rows per block, one per local head.

    Rows of one block must be adjacent: the view needs an unpadded page (block
    stride == page bytes) when ``count`` > 1."""
    view = tensor[:, :page_bytes]
    if count == 1:
        return view
    if tensor.stride(0) != page_bytes or tensor.stride(1) != 1 or page_bytes % count:
        raise ValueError(f"head slices need unpadded, contiguous pages (stride {tensor.stride()}, "
                         f"page {page_bytes}, {count} heads)")
    return view.as_strided((tensor.shape[0] * count, page_bytes // count), (page_bytes // count, 1))
