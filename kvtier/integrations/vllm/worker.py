"""Worker side (vLLM worker process): move chunks between vLLM's KV cache and kvtier.

vLLM's CPU worker allocates its KV cache itself; ``adopt_tensors`` moves the
pages under it into a named segment in place (same addresses, so attention
reads the same memory), and the daemon copies to and from those pages
directly. Each canonical layer tensor is registered as one tensor of
``(num_blocks, page_bytes)``; one kvtier block holds ``blocks_per_chunk``
engine blocks of every layer.

Jobs never fail at submission: a load the daemon could not serve (evicted
since the lookup, daemon gone) comes back from ``get_finished`` with
``success=False``; the connector turns that into a failed receive so vLLM
recomputes. A store that fails only means a later miss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ...client import Client, KVTierError, Namespace, TransferHandle
from ...transfer.adopt import adopt_tensors
from .manager import KVTierSpecs

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Job:
    handle: TransferHandle
    is_load: bool
    engine_blocks: int
    started: float


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
        self.kv = adopt_tensors(views)  # in place: vLLM's kernels keep their pointers
        self.client = Client(socket, name=name, require_daemon=False)
        self.enabled = True
        try:
            self.client.register_kv_cache(self.kv, [0] * len(views), namespace, block_factor=blocks_per_chunk)
        except KVTierError as exc:
            log.error("kvtier: worker registration refused (%s); kvtier disabled", exc)
            self.enabled = False
        self._jobs: dict[int, _Job] = {}
        self._done: list[TransferResult] = []

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
        if not self.enabled or len(ids) != len(hashes) * self.k - skip:
            # Never a partial chunk here (vLLM sends whole chunks); refuse rather
            # than guess which blocks go where: a load fails, a store is dropped.
            if self.enabled:
                log.warning("kvtier: job %d has %d blocks for %d chunks (skip %d); not transferred",
                            job_id, len(ids), len(hashes), skip)
            self._done.append(TransferResult(job_id, success=not is_load))
            return True
        op = self.client.load if is_load else self.client.store
        handle = op(hashes, ids, skip=skip) if is_load else op(hashes, ids)
        self._jobs[job_id] = _Job(handle, is_load, len(ids), time.perf_counter())
        return True

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        for job_id in [j for j, job in self._jobs.items() if job.handle.done()]:
            out.append(self._result(job_id, self._jobs.pop(job_id)))
        return out

    def _result(self, job_id: int, job: _Job) -> TransferResult:
        result = job.handle.wait()
        if job.is_load and not result.ok:
            log.warning("kvtier: load job %d failed (%d of %d chunks): %s; vLLM recomputes",
                        job_id, len(result.failed), job.engine_blocks, result.error or "evicted")
        moved = job.engine_blocks if job.is_load else result.done * self.k
        return TransferResult(job_id, success=result.ok or not job.is_load,
                              transfer_size=moved * self.engine_block_bytes,
                              transfer_time=time.perf_counter() - job.started)

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs stopped touching their blocks (preemption:
        vLLM reuses the blocks right after). Their results still come from
        ``get_finished``."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.handle.wait()

    def shutdown(self) -> None:
        for job in self._jobs.values():
            job.handle.wait()
        self._jobs.clear()
        self.client.close()
        self.kv.close()
