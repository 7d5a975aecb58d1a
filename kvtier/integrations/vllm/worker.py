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

log = logging.getLogger("kvtier.vllm")


class KVTierWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, namespace: Namespace, blocks_per_chunk: int,
                 socket: str | None, name: str):
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("kvtier supports models with one KV cache group")
        refs = kv_caches.group_data_refs[0]
        # The unpadded page of each layer: padding never holds KV.
        views = [kv_caches.tensors[r.tensor_idx].tensor[:, :r.page_size_bytes] for r in refs]
        self.engine_block_bytes = sum(r.page_size_bytes for r in refs)
        self.k = blocks_per_chunk
        self.engine = EngineKV(views, [0] * len(views), Client(socket, name=name, require_daemon=False),
                               namespace, block_factor=blocks_per_chunk)

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
        self.engine.submit(job_id, is_load, hashes, ids, skip)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [self._result(f) for f in self.engine.finished()]

    def _result(self, f: Finished) -> TransferResult:
        result = f.result
        if f.is_load and not result.ok and self.engine.enabled:
            log.warning("kvtier: load job %d failed (%d of %d chunks): %s; vLLM recomputes",
                        f.job_id, len(result.failed), f.engine_blocks, result.error or "evicted")
        moved = f.engine_blocks if f.is_load else result.done * self.k
        return TransferResult(f.job_id, success=result.ok or not f.is_load,
                              transfer_size=moved * self.engine_block_bytes, transfer_time=f.seconds)

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs stopped touching their blocks (preemption:
        vLLM reuses the blocks right after). Their results still come from
        ``get_finished``."""
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.engine.close()
