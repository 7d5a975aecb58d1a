"""Interprocess CUDA events, both sides of the fences.

The engine records one interprocess event per client on its stream
(``record_on``): re-recording it before the daemon waits only makes the
daemon wait for later work, never for less. Events received as IPC handles
are opened once and kept in an ``EventCache`` (bounded, least recently used
out): the daemon's copy engine caches the workers' events, the client caches
the daemon's "copy finished" events.

Primitives: ``record_on(stream, event)``, ``EventCache(limit).open(handle, device)``.
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
