"""One engine worker's KV cache on kvtier, whatever the engine and the device.

Runs in the engine's worker process. The vLLM worker and the Hugging Face
tier are thin shims over this object; it holds everything that depends on
where the KV lives rather than on which engine owns it:

* **Registration.** CPU tensors are adopted into shared memory
  (``adopt_tensors``: their storage moves, the engine's tensors and views follow) and
  handed to the daemon; CUDA tensors are registered in place over CUDA IPC
  (``CudaKVCache``: the daemon maps this device's memory, found by the GPU's
  UUID, so every TP rank registers its own device). A refusal (a daemon
  without a CUDA data path, a bad layout, memory PyTorch cannot share over
  CUDA IPC) leaves the object ``enabled=False`` with the error in
  ``refusal``: the engine runs as if kvtier were absent.
* **Fences (CUDA).** A store is fenced by an interprocess event recorded on
  the engine's stream when it is submitted, after the kernels that wrote the
  blocks: the daemon's copy waits for it. A load is fenced the same way (the
  engine is done with the destination blocks), and when it lands the
  engine's stream waits on the daemon's "copy finished" event before
  anything queued later (attention) reads the blocks. Swap messages carry no
  event, so ``offload``/``restore`` synchronise the engine's stream first.
* **Jobs.** ``submit``/``finished`` track asynchronous transfers by the
  engine's job id; ``wait`` (preemption) and ``close`` (shutdown) return only
  once the daemon stopped touching the jobs' blocks.

Failures are values: a refused or failed transfer comes back as a
``TransferResult`` with failed blocks (the engine recomputes), never an
exception on the data path.

Primitives: ``EngineKV(tensors, block_dims, client, namespace, block_factor, stream, defer, kv)``
with ``enabled``/``refusal``/``on_gpu``/``registered``, ``register_when_connected``, ``store``, ``load``, ``landed``,
``offload``, ``restore``, ``submit``, ``fail``, ``finished``, ``held``, ``wait``, ``close``;
``Finished``; ``kv_device(tensors)``; ``export_groups(groups)`` (several
registrations over one engine's memory: a hybrid model's KV cache groups).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..client import Client, KVTierError, Namespace, TransferHandle, TransferResult
from ..protocol.errors import ErrorCode
from ..transfer.specs import CannotShare

log = logging.getLogger("kvtier.engine")


@dataclass(frozen=True)
class Finished:
    """A job the daemon is done with: its blocks are the engine's again."""
    job_id: int
    is_load: bool
    result: TransferResult
    engine_blocks: int    # engine blocks the job named
    seconds: float        # from submission to completion seen


@dataclass
class _Job:
    handle: TransferHandle
    is_load: bool
    engine_blocks: int
    started: float


def kv_device(tensors: Sequence) -> str:
    """"cpu" or "cuda" for the engine's KV tensors (ValueError when mixed or neither)."""
    kinds = {t.device.type for t in tensors}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"KV tensors must all be on the CPU or all on CUDA, got {sorted(kinds)}")
    return kinds.pop()


def export_groups(groups: Sequence[Sequence]) -> list:
    """Export several lists of views of one engine's KV memory, one cache per list.

    A hybrid model's KV cache groups are views of the same tensors (each group
    uses its own block ids in them): CPU storages must move into shared
    memory once, or the second move would strand the first registration on
    memory the engine no longer uses. So every view is adopted in one call,
    and each group gets a cache over its own views of that one memfd (closing
    any of them closes the shared descriptor once). CUDA memory is registered
    in place, one cache per group."""
    groups = [list(g) for g in groups]
    flat = [t for g in groups for t in g]
    if kv_device(flat) == "cuda":
        from ..transfer.cuda import CudaKVCache
        return [CudaKVCache(g) for g in groups]
    from ..transfer.adopt import adopt_tensors
    from ..transfer.shm import ShmKVCache
    whole = adopt_tensors(flat)
    out, start = [], 0
    for g in groups:
        out.append(ShmKVCache._adopted(whole.memory, whole.tensors[start:start + len(g)],
                                       whole.offsets[start:start + len(g)]))
        start += len(g)
    return out


class EngineKV:
    def __init__(self, tensors: Sequence, block_dims: Sequence[int], client: Client,
                 namespace: Namespace, block_factor: int = 1, stream=None, defer: bool = False, kv=None):
        """Export ``tensors`` and register them. ``stream``: the CUDA stream the
        engine's kernels run on (default: the device's current stream at each
        call). ``kv``: ``tensors`` already exported (``export_groups``).
        Owns ``client`` from here on (``close`` closes it).

        ``defer``: while the client has no daemon, leave the tensors where the
        engine put them (no copy into shared memory, no registration: an
        engine without a daemon runs on its own memory) and do both at the
        first ``register_when_connected`` that finds the client connected.
        Until then every transfer fails at once, as with no daemon."""
        tensors = list(tensors)
        self.on_gpu = kv_device(tensors) == "cuda"
        self.client, self.block_factor, self._stream = client, block_factor, stream
        self.device = tensors[0].device
        self.kv = None
        self._exported = kv
        self.refusal: KVTierError | None = None
        self._jobs: dict[int, _Job] = {}
        self._done: list[Finished] = []
        self._pending: tuple | None = (tensors, list(block_dims), namespace)
        if not defer or client.connected:
            self._register()

    def _register(self) -> None:
        tensors, block_dims, namespace = self._pending
        self._pending = None
        # CUDA: in place, the engine keeps owning the memory; CPU: the storage moves
        # into a sealed memfd and every view of it (the engine's layers) follows.
        self.kv = self._exported if self._exported is not None else export_groups([tensors])[0]
        try:
            self.client.register_kv_cache(self.kv, block_dims, namespace, block_factor=self.block_factor)
        except KVTierError as exc:
            self.refusal = exc
            log.error("kvtier: registration refused (%s); kvtier disabled for this cache", exc)
        except CannotShare as exc:  # memory PyTorch cannot export: the engine runs on without kvtier
            self.refusal = KVTierError(ErrorCode.BAD_ARGUMENT, str(exc), "client")
            log.error("kvtier: %s; kvtier disabled for this cache", exc)

    @property
    def registered(self) -> bool:
        """The tensors were handed to a daemon (False while ``defer`` holds them back)."""
        return self._pending is None

    def register_when_connected(self) -> bool:
        """With ``defer``: once the client is connected, export and register the
        tensors (a CPU cache's storage moves: call it where nothing reads or
        writes them, between engine steps). True once registered."""
        if self._pending is not None and self.client.connected:
            self._register()
        return self._pending is None

    @property
    def enabled(self) -> bool:
        return self.refusal is None

    @property
    def refused(self) -> str:
        """Why the daemon refused the cache ("" if it did not)."""
        return "" if self.refusal is None else str(self.refusal)


    def stream(self):
        """The engine's stream (CUDA), or None for CPU caches."""
        if not self.on_gpu:
            return None
        if self._stream is not None:
            return self._stream
        import torch
        return torch.cuda.current_stream(self.device)

    # ---- one transfer --------------------------------------------------------------------
    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferHandle:
        """Copy engine blocks into the pool. CUDA: fenced after every kernel
        queued so far on the engine's stream (those wrote the blocks)."""
        if self._unusable():
            return _refused(len(hashes), self._unusable())
        return self.client.store(hashes, block_ids, stream=self.stream())

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], skip: int = 0,
             prefix: bool = False) -> TransferHandle:
        """Copy pool blocks into engine blocks; pass the handle to ``landed``
        before the engine reads them. CUDA: the daemon writes only after the
        kernels queued so far on the engine's stream (they may still read the
        blocks' previous contents)."""
        if self._unusable():
            return _refused(len(hashes), self._unusable())
        return self.client.load(hashes, block_ids, skip, stream=self.stream(), prefix=prefix)

    def landed(self, handle: TransferHandle) -> TransferResult:
        """Wait for a transfer; for a CUDA load, the engine's stream also
        waits on the daemon's copy before anything queued after this."""
        return handle.wait_event(self.stream()) if self.on_gpu else handle.wait()

    def offload(self, tables: Mapping[str, Sequence[int]]) -> TransferHandle:
        """Swap requests' blocks out (``Client.offload``); CUDA: the engine's
        stream is synchronised first, since swap messages carry no fence."""
        if self._unusable():
            return _refused(len(tables), self._unusable(), tuple(tables))
        self._quiesce()
        return self.client.offload(dict(tables))

    def restore(self, request_id: str, block_ids: Sequence[int]) -> TransferHandle:
        """Swap a request back in (``Client.restore``); CUDA: the engine's
        stream is synchronised first (earlier kernels may still use the blocks)."""
        if self._unusable():
            return _refused(len(block_ids), self._unusable())
        self._quiesce()
        return self.client.restore(request_id, block_ids)

    def _unusable(self) -> str:
        """Why no transfer can be sent now ("" if one can)."""
        if self._pending is not None:
            return "no daemon connected yet (the cache is registered when one is)"
        return self.refused and f"kvtier disabled: {self.refused}"

    def _quiesce(self) -> None:
        if self.on_gpu:
            self.stream().synchronize()

    # ---- jobs (engines that poll) ----------------------------------------------------------
    def submit(self, job_id: int, is_load: bool, hashes: Sequence[bytes], block_ids: Sequence[int],
               skip: int = 0) -> None:
        """Start a store or load tracked by ``job_id``; never raises for the
        daemon's sake (a refused job finishes failed at the next ``finished``)."""
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight")
        started = time.perf_counter()
        handle = self.load(hashes, block_ids, skip) if is_load else self.store(hashes, block_ids)
        self._jobs[job_id] = _Job(handle, is_load, len(block_ids), started)

    def fail(self, job_id: int, is_load: bool, engine_blocks: int, why: str) -> None:
        """Report a job the engine asked for but that was never sent (bad shape)."""
        self._done.append(Finished(job_id, is_load, _failed(engine_blocks, why), engine_blocks, 0.0))

    def finished(self) -> list[Finished]:
        """Jobs done since the last call. A load's blocks are readable by
        anything queued on the engine's stream after this returns."""
        out, self._done = self._done, []
        for job_id in [j for j, job in self._jobs.items() if job.handle.done()]:
            job = self._jobs.pop(job_id)
            result = self.landed(job.handle) if job.is_load else job.handle.wait()
            out.append(Finished(job_id, job.is_load, result, job.engine_blocks,
                                time.perf_counter() - job.started))
        return out

    def held(self, job_id: int) -> tuple[int, ...]:
        """Engine blocks job ``job_id`` may still have the daemon touch (() once it let go)."""
        job = self._jobs.get(job_id)
        return job.handle.held_blocks if job is not None else ()

    def wait(self, job_ids) -> None:
        """Block until these jobs stopped touching their blocks (preemption:
        the engine reuses them right after). Results still come from ``finished``."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                job.handle.wait()

    def close(self) -> None:
        """Shutdown: every job's blocks are let go of, then the client says BYE."""
        self.wait(list(self._jobs))
        self._jobs.clear()
        self.client.close()
        if self.kv is not None:
            self.kv.close()


def _failed(count: int, why: str) -> TransferResult:
    return TransferResult(0, 0, tuple(range(count)), False, why)


def _refused(count: int, why: str, names: tuple[str, ...] = ()) -> TransferHandle:
    """A handle that is done at once with every block (request) failed: nothing was sent."""
    return TransferHandle(None, 0, count, 0.0, TransferResult(0, 0, tuple(range(count)), False, why, names), names)
