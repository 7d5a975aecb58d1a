"""The daemon's GPU data path: pinned pool, one copy engine per CUDA registration.

``GpuContext`` (one per daemon, only built when CUDA is available) pins the
pool in the background, knows the local device UUIDs and picks the copy
method. ``CudaCopyEngine`` (one per registration) owns a CUDA stream and a
ring of interprocess "done" events, and runs a transfer like this:

  store: wait for the worker's event (its kernels wrote the blocks) ->
         copies GPU -> pool on the stream -> record "done" -> host waits for
         "done"; only then the job returns and the daemon commits the blocks.
  load:  wait for the worker's event (it finished with the destination
         blocks) -> copies pool -> GPU -> record "done" -> host waits; the
         reply carries that "done" event's IPC handle and the worker's stream
         waits on it before attention reads the blocks.

The worker's event is waited for on the host (polled, with a deadline), not
with ``cudaStreamWaitEvent``: an event from a worker that dies never fires,
and copies queued behind it could run after the op was reported failed and
its pool slots reused. Polling gives up cleanly, with nothing queued. The
daemon polls fences on its own thread (``fences.FenceGate`` with
``fence_fired``), so a worker whose event never fires holds no copy thread.

Each op records its own "done" event from the ring, so the handle in a reply
is not re-recorded by the next op before the worker waits on it.

Copy jobs run on the daemon's copy threads, so the control loop keeps
answering lookups while the GPU works.

Primitives: ``GpuContext(pool, chunk, method)`` with ``engine(layout, device)``,
``stats()``, ``close()``; ``CudaCopyEngine.fence_fired(handle)``,
``CudaCopyEngine.copy(pool, pairs, to_pool, cancelled) -> done event handle``;
``queue_or_drain(queue, drain)``.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from .gpu_copy import MethodChooser, RunCopier
from .copy import Cancelled
from .events import EventCache
from .mapping import local_uuids
from .pinning import PinnedPool
from .runs import Geometry

log = logging.getLogger("kvtier.gpu")
METHODS = ("auto", "dma", "kernel")
MAX_OPEN_EVENTS = 16  # imported worker events kept per registration
DONE_RING = 32        # "done" events per registration, used round robin


def queue_or_drain(queue: Callable[[], None], drain: Callable[[], None]) -> None:
    """Run ``queue`` (it queues an op's copies on a stream); if it raises part
    way, ``drain`` the stream before the error goes on.

    A failure on the 20th of 32 copies (out of memory for the kernel path's
    temporaries, a bad run) leaves the first 19 queued. The op is then
    reported failed and its pool slots or engine blocks are given back; copies
    still in flight would land on them after their new owner wrote them. So
    nothing leaves here while this op's copies may run. If the stream cannot
    even be synchronised (a sticky CUDA error: the context is lost and runs
    nothing more), the first error is what the caller sees."""
    try:
        queue()
    except BaseException:
        try:
            drain()
        except Exception as exc:  # the context is gone: nothing of this op can run any more
            log.error("after a failed copy, its stream could not be synchronised: %s", exc)
        raise


class GpuContext:
    def __init__(self, pool: torch.Tensor, chunk: int, method: str = "auto"):
        if method not in METHODS:
            raise ValueError(f"gpu copy method must be one of {METHODS}")
        torch.cuda.init()
        self.uuids = local_uuids()
        self.chunk, self.method = chunk, method
        self.chooser = MethodChooser()
        self.pinned = PinnedPool(pool, chunk)
        self.pinned.start()

    def engine(self, layout, device: int) -> "CudaCopyEngine":
        return CudaCopyEngine(self, layout, device)

    def stats(self) -> dict:
        return {"enabled": True, "devices": list(self.uuids), "copy_method": self.method,
                "pin_chunk_bytes": self.chunk, "pin_error": self.pinned.error,
                "kernel_devices": self.pinned.view_devices(),
                "throughput_gbps": self.chooser.report()}

    def close(self) -> None:
        self.pinned.close()


class CudaCopyEngine:
    def __init__(self, ctx: GpuContext, layout, device: int):
        self.ctx, self.layout, self.device = ctx, layout, device
        geometry = Geometry.of(layout)
        # A layout too scattered for runs falls back to KVLayout.copy (strided copy_, slower).
        self.runs = RunCopier(layout, geometry) if geometry is not None else None
        self.stream = torch.cuda.Stream(device=device)
        self._ring: list = [None] * DONE_RING
        self._next = 0
        self._events = EventCache(MAX_OPEN_EVENTS)
        self._lock = threading.Lock()

    def fence_fired(self, handle: bytes) -> bool:
        """Whether the worker's event ``handle`` fired (never blocks)."""
        with torch.cuda.device(self.device):
            return self._imported(handle).query()

    def copy(self, pool: torch.Tensor, pairs, to_pool: bool,
             cancelled: threading.Event | None = None) -> bytes:
        """Runs on a copy thread once the op's fence (if any) fired at the
        gate; returns (the IPC handle of this op's "done" event) once the
        bytes have really moved. A cancelled op stops before anything is queued."""
        timing = None
        with torch.cuda.device(self.device):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("cancelled before the copy was queued")
            slot, done, handle = self._done_event()

            def queue():
                nonlocal timing
                with torch.cuda.stream(self.stream):
                    if self.runs is None:
                        self.layout.copy(pool, pairs, to_pool)
                    else:
                        timing = self._copy_runs(pool, pairs, to_pool)
                    done.record(self.stream)
            queue_or_drain(queue, self.stream.synchronize)
        done.synchronize()
        if timing is not None:
            key, method, nbytes, start, end = timing
            self.ctx.chooser.record(key, method, nbytes, start.elapsed_time(end) / 1e3)
        if not handle:  # an IPC handle exists once the event was recorded
            handle = bytes(done.ipc_handle())
            with self._lock:
                self._ring[slot] = (done, handle)
        return handle

    def _done_event(self):
        """(slot, event, handle) for the next op; handle is b"" until first recorded."""
        with self._lock:
            i, self._next = self._next, (self._next + 1) % DONE_RING
            if self._ring[i] is None:
                self._ring[i] = (torch.cuda.Event(blocking=True, interprocess=True), b"")
            return (i, *self._ring[i])

    def _copy_runs(self, pool, pairs, to_pool):
        units, merged = self.runs.plan(pairs, self.ctx.chunk)
        count = sum(len(r.nbytes) for r in units)
        if not count:
            return None
        nbytes = sum(r.total for r in units)
        view = self.ctx.pinned.device_view(self.device) if self.ctx.method != "dma" else None
        key, method = None, "dma"
        if view is not None and self.ctx.method == "kernel":
            method = "kernel"
        elif view is not None:  # auto: measure both, then keep the faster per run size
            key = MethodChooser.key(to_pool, nbytes // count)
            method = self.ctx.chooser.pick(key)
        start = end = None
        if key is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
        if method == "kernel":
            self.runs.kernel(view, units, to_pool)
        else:
            self.runs.dma(pool, merged, to_pool)
        if key is None:
            return None
        end.record(self.stream)
        return key, method, nbytes, start, end

    def _imported(self, handle: bytes) -> torch.cuda.Event:
        """The worker's interprocess event, opened once per handle."""
        return self._events.open(handle, self.device)
