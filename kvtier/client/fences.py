"""One Client's CUDA fences: the events it records on the engine's stream for
the daemon to wait on, and the daemon's events it opens to wait on in turn.

Both are created on first use, so a CPU engine never imports the CUDA parts.
"""

from __future__ import annotations


class Fences:
    def __init__(self) -> None:
        self.ring = None   # EventRing of the events recorded on the caller's stream
        self.cache = None  # EventCache: daemon events opened from their IPC handles

    def handle(self, event, stream) -> bytes:
        """IPC handle of the worker event the daemon must wait on (b"" = none):
        ``event`` as given, or one recorded now on ``stream``."""
        if event is not None and stream is not None:
            raise ValueError("pass either event or stream, not both")
        if event is None and stream is None:
            return b""
        if stream is not None:
            from ..transfer.events import EventRing
            self.ring = self.ring or EventRing()
            event = self.ring.record(stream)
        return event if isinstance(event, bytes) else bytes(event.ipc_handle())

    def open(self, handle: bytes, device):
        """The daemon's interprocess event for ``handle``, opened once."""
        if self.cache is None:
            from ..transfer.events import EventCache
            self.cache = EventCache(64)  # the daemon hands out up to 32 per registration
        return self.cache.open(handle, device)
