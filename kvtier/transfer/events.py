"""Interprocess CUDA events, both sides of the fences.

The engine records its fences from a small ring of interprocess events
(``EventRing``): each transfer takes the next one, so an event the daemon
still waits on is re-recorded only ``FENCE_RING`` transfers later. With a
single event re-recorded for every transfer, an engine that keeps its GPU
busy (it queues step N+1 before step N finished) could move a pending
fence forward forever: the daemon would see it fire only when the GPU ran
dry. Re-recording never makes the daemon wait for less, only for later work.
The ring is smaller than the daemon's cache of opened events per
registration, so no handle is opened twice while in use. Events received as IPC handles
are opened once and kept in an ``EventCache`` (bounded, least recently used
out): the daemon's copy engine caches the workers' events, the client caches
the daemon's "copy finished" events.

Primitives: ``record_on(stream, event)``, ``EventRing(size).record(stream)``,
``EventCache(limit).open(handle, device)``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def record_on(stream, event=None):
    """Record an interprocess event (``event`` reused when given) on ``stream``."""
    if event is None:
        event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    return event


FENCE_RING = 8  # < the daemon's opened-event cache per registration (gpu.MAX_OPEN_EVENTS)


class EventRing:
    """Interprocess events used round robin for the fences one client sends."""

    def __init__(self, size: int = FENCE_RING):
        self._events: list = [None] * size
        self._next = 0

    def record(self, stream):
        i, self._next = self._next, (self._next + 1) % len(self._events)
        self._events[i] = record_on(stream, self._events[i])
        return self._events[i]


class EventCache:
    """Events opened from IPC handles, at most ``limit`` kept. Thread-safe."""

    def __init__(self, limit: int):
        self.limit = limit
        self._events: OrderedDict[bytes, torch.cuda.Event] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, handle: bytes, device) -> torch.cuda.Event:
        with self._lock:
            ev = self._events.get(handle)
            if ev is None:
                ev = torch.cuda.Event.from_ipc_handle(device, handle)
                self._events[handle] = ev
                while len(self._events) > self.limit:
                    self._events.popitem(last=False)
            else:
                self._events.move_to_end(handle)
            return ev
