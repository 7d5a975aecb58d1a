"""Interprocess CUDA events for the worker side of the fences.

One event per client is enough for the worker -> daemon fence: re-recording
it before the daemon waits only makes the daemon wait for later work, never
for less. The event must outlive the daemon's use of its handle, so the
client keeps it for its whole life.

Primitives: ``record_on(stream, event)``, ``open_event(cache, handle, device)``.
"""

from __future__ import annotations

import torch

MAX_OPEN = 64  # the daemon hands out up to 32 distinct events per registration


def record_on(stream, event=None):
    """Record an interprocess event (``event`` reused when given) on ``stream``."""
    if event is None:
        event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    return event


def open_event(cache: dict, handle: bytes, device):
    """The event behind ``handle`` on ``device``, opened once and kept in ``cache``."""
    ev = cache.get(handle)
    if ev is None:
        if len(cache) >= MAX_OPEN:
            cache.pop(next(iter(cache)))
        ev = cache[handle] = torch.cuda.Event.from_ipc_handle(device, handle)
    return ev
