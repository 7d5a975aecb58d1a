"""Worker side (vLLM worker process): move chunks between vLLM's KV cache and kvtier.

A thin shim over ``EngineKV``, one per KV cache group: vLLM's canonical
per-layer KV tensors are registered as they are, CPU ones adopted into shared
memory (their storage moves, so attention's views read the new memory), CUDA
ones in place over CUDA IPC (each TP rank registers its own GPU). Each layer
tensor is registered as one tensor of ``(num_blocks, page_bytes)``; one
kvtier block holds ``blocks_per_chunk`` engine blocks of every layer of its
group. On CUDA a store is fenced on the worker's stream when it is submitted
(after the forward that wrote the blocks) and a finished load makes that
stream wait for the daemon's copy before vLLM's next step reads the blocks.

Hybrid models (``groups.py``): the groups' layers are views of the same
tensors (each group has its own block ids in them), so the memory is adopted
once and each group registers its views of it in its own namespace.

TP layouts (``slices.py``): with head slices each layer is registered as
``(num_blocks * count, page / count)`` - row ``block * count + j`` is local
head ``j`` of ``block`` - and a group's part of a job becomes one transfer per
held slice (keys ``held_keys``); with replicated KV this rank stores only the
chunks it ``writes``. A job is done when all its transfers (every group,
every slice) are, and a load succeeds only when every one did.

Jobs never fail at submission: a load the daemon could not serve (evicted
since the lookup, daemon gone) comes back from ``get_finished`` with
``success=False``; the connector turns that into a failed receive so vLLM
recomputes. A store that fails only means a later miss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ...client import Client, Namespace
from ..engine_kv import EngineKV, Finished, export_groups
from .groups import GroupTransfer, split_job
from .pool_spec import KVTierSpecs
from .slices import PER_RANK, KVSlices

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Job:
    is_load: bool
    waiting: set[tuple[int, int]]        # (group position, slice) transfers still in flight
    moved: int = 0                       # bytes
    ok: bool = True
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class KVTierWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, namespaces: Namespace | list[Namespace],
                 blocks_per_chunk: int, socket: str | None, name: str,
                 slices: KVSlices | list[KVSlices] = PER_RANK):
        """``namespaces[g]``, ``slices[g]``: group ``g``'s, in ``group_data_refs`` order."""
        groups = kv_caches.group_data_refs
        namespaces = [namespaces] if isinstance(namespaces, Namespace) else list(namespaces)
        self.slices = [slices] * len(groups) if isinstance(slices, KVSlices) else list(slices)
        if len(namespaces) != len(groups) or len(self.slices) != len(groups):
            raise ValueError(f"{len(namespaces)} namespaces and {len(self.slices)} layouts "
                             f"for {len(groups)} KV cache groups")
        # The unpadded page of each layer: padding never holds KV.
        views = [[_sliced(kv_caches.tensors[r.tensor_idx].tensor, r.page_size_bytes, sl.count) for r in refs]
                 for refs, sl in zip(groups, self.slices)]
        # Bytes of one slice of one engine block, per group.
        self.group_block_bytes = [sum(r.page_size_bytes for r in refs) // sl.count
                                  for refs, sl in zip(groups, self.slices)]
        self.k = blocks_per_chunk
        caches = export_groups(views)
        # One connection for every group, a registration per group (``Client.share``).
        first = Client(socket, name=name, require_daemon=False)
        clients = [first] + [first.share() for _ in views[1:]]
        self.engines = [EngineKV(v, [0] * len(v), c, ns, block_factor=blocks_per_chunk, kv=kv)
                        for v, ns, kv, c in zip(views, namespaces, caches, clients)]
        self._jobs: dict[int, _Job] = {}
        self._done: list[TransferResult] = []   # jobs with nothing to move, or refused
        self._landed: list[tuple[int, Finished]] = []  # (group, transfer) taken from the engines by ``wait``

    @property
    def engine(self) -> EngineKV:
        """The first group's engine (a one-group model's only one)."""
        return self.engines[0]

    @property
    def engine_block_bytes(self) -> int:
        return sum(self.group_block_bytes)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """``expedited`` (vLLM 0.33): sent like any load, no priority; vLLM
        calls ``wait`` on the job at once."""
        assert isinstance(src_spec, KVTierSpecs)
        return self._submit(job_id, True, src_spec, dst_spec)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec,
                     *args, **kwargs) -> bool:
        assert isinstance(dst_spec, KVTierSpecs)
        return self._submit(job_id, False, dst_spec, src_spec)

    def _submit(self, job_id: int, is_load: bool, keys: KVTierSpecs, blocks: GPULoadStoreSpec) -> bool:
        ids = blocks.block_ids.tolist()
        sizes = blocks.group_sizes if blocks.group_sizes is not None else [len(ids)]
        indices = blocks.block_indices if len(blocks.block_indices) else [0] * len(sizes)
        if len(sizes) != len(self.engines):  # a job for another model's groups: never guess
            transfers, problems = [], [f"{len(sizes)} groups in the job, {len(self.engines)} registered"]
        else:
            transfers, problems = split_job(keys.groups, ids, sizes, indices, self.k, is_load)
        if problems and any(e.enabled for e in self.engines):
            # Never a partial chunk here (vLLM sends whole chunks, a store's first
            # one aside); refuse rather than guess which blocks go where.
            log.warning("kvtier: job %d: %s; %s", job_id, "; ".join(problems),
                        "load fails" if is_load else "those groups not stored")
        if is_load and problems:
            self._done.append(TransferResult(job_id, success=False, transfer_size=0, transfer_time=0.0))
            return True
        parts = [(t.position, j, h, b, t.skip) for t in transfers for j, (h, b) in enumerate(self._slices(is_load, t))]
        if not parts:  # nothing for this rank (replicated KV: another rank writes these chunks)
            self._done.append(TransferResult(job_id, success=True, transfer_size=0, transfer_time=0.0))
            return True
        self._jobs[job_id] = _Job(is_load, {(g, j) for g, j, *_ in parts})
        for g, j, hashes, block_ids, skip in parts:
            self.engines[g].submit((job_id, j), is_load, hashes, block_ids, skip)
        return True

    def _slices(self, is_load: bool, t: GroupTransfer) -> list[tuple[list[bytes], list[int]]]:
        """(kvtier keys, engine rows) per held slice of one group's part; stores
        keep only the chunks this rank writes."""
        sl, k = self.slices[t.position], self.k
        hashes, ids = t.hashes, t.block_ids
        if not is_load and sl.replicas > 1:
            mine = [i for i, h in enumerate(hashes) if sl.writes(h)]
            hashes, ids = [hashes[i] for i in mine], [b for i in mine for b in ids[i * k:(i + 1) * k]]
            if not hashes:
                return []
        if sl.count == 1 and sl.slices == 1:
            return [(hashes, ids)]
        flat = sl.keys(hashes, held=True)   # each chunk's held slices in turn
        if not t.skip:  # one transfer: each chunk's slices in turn, each slice its own kvtier block
            rows = np.asarray(ids, np.int64).reshape(len(hashes), 1, k)
            return [(flat, sl.engine_id(rows, np.arange(sl.count).reshape(1, -1, 1)).ravel().tolist())]
        # A load starting mid-chunk skips the same blocks of every slice: one transfer per slice.
        return [(flat[j::sl.count], [sl.engine_id(b, j) for b in ids]) for j in range(sl.count)]

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        landed, self._landed = self._landed, []
        for g, f in landed + [(g, f) for g, engine in enumerate(self.engines) for f in engine.finished()]:
            job_id, j = f.job_id
            job = self._jobs[job_id]
            job.waiting.discard((g, j))
            result = f.result
            job.moved += (f.engine_blocks if f.is_load else result.done * self.k) * self.group_block_bytes[g]
            job.seconds = max(job.seconds, f.seconds)
            if f.is_load and not result.ok:
                job.ok = False
                if self.engines[g].enabled:
                    job.errors.append(f"group {g}: {len(result.failed)} of {f.engine_blocks} "
                                      f"({result.error or 'evicted'})")
            if not job.waiting:
                del self._jobs[job_id]
                out.append(self._result(job_id, job))
        return out

    def _result(self, job_id: int, job: _Job) -> TransferResult:
        if job.errors:
            log.warning("kvtier: load job %d failed (%s); vLLM recomputes", job_id, "; ".join(job.errors))
        return TransferResult(job_id, success=job.ok or not job.is_load,
                              transfer_size=job.moved, transfer_time=job.seconds)

    def wait(self, job_ids: set[int]) -> None:
        """Block until these jobs stopped touching their blocks (preemption:
        vLLM reuses the blocks right after; vLLM 0.33's sync loads: this
        step's forward reads them right after). Their results still come from
        ``get_finished``; they are taken from the engines here, which for a
        CUDA load makes the worker's stream wait for the daemon's copy before
        the forward is queued."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for g, j in sorted(job.waiting) if job is not None else ():
                self.engines[g].wait([(job_id, j)])
        self._landed += [(g, f) for g, engine in enumerate(self.engines) for f in engine.finished()]

    def held(self, job_id: int) -> tuple[int, ...]:
        """Engine blocks the daemon may still touch for this job (() once it let go)."""
        job = self._jobs.get(job_id)
        return tuple(b for g, j in sorted(job.waiting) for b in self.engines[g].held((job_id, j))) if job else ()

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.close()


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
