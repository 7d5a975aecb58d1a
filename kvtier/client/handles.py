"""Handles for asynchronous store/load/offload/restore.

A handle is done only when the daemon can no longer touch the transfer's
engine blocks: its reply arrived (done, failed or cancelled), the request
never left this process, or the daemon process is confirmed dead. When the
transfer outlives ``transfer_timeout`` the handle sends CANCEL and keeps
waiting for that confirmation (one copy chunk plus a round trip); until
then ``held_blocks`` still names the blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol import messages as m
from ..protocol.arrays import unpack_ids

if TYPE_CHECKING:
    from .channel import Channel

LIVENESS_SLICE_S = 0.25  # while waiting, how often the daemon's process is checked


@dataclass(frozen=True)
class TransferResult:
    done: int                     # blocks copied (store: newly stored; offload: requests)
    skipped: int                  # store: already in the pool (dedup)
    failed: tuple[int, ...]       # indices into the call's hashes / requests
    no_space: bool = False        # some blocks failed for lack of room
    error: str = ""               # why everything failed (timeout, daemon gone)
    names: tuple[str, ...] = ()   # offload: the request ids, in call order

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed_requests(self) -> tuple[str, ...]:
        """Offload: request ids that were not offloaded (soft-reset those).
        Empty for store/load results, which carry no request names."""
        return tuple(self.names[i] for i in self.failed if i < len(self.names))


class TransferHandle:
    """Poll with ``done()``, block with ``wait()``. A store's source blocks (and
    a load's destination blocks) must not be reused until the handle is done:
    ``held_blocks`` names them and is empty once they are free again."""

    def __init__(self, channel: "Channel | None", req_id: int, count: int, deadline: float,
                 result: TransferResult | None = None, names: tuple[str, ...] = (),
                 blocks: tuple[int, ...] = (), open_event=None):
        self._channel, self._req_id, self._count = channel, req_id, count
        self._deadline, self._result, self._names = deadline, result, names
        self._blocks = blocks
        self._cancelled = False
        self._event = b""  # CUDA load: the daemon's "copy finished" event
        self._open_event = open_event  # CUDA: handle -> the daemon's event, opened once

    @property
    def held_blocks(self) -> tuple[int, ...]:
        """Engine block ids the daemon may still read (store) or write (load)."""
        return () if self.done() else self._blocks

    def wait_event(self, stream=None) -> TransferResult:
        """``wait()``, then make ``stream`` (default: the current CUDA stream)
        wait on the daemon's copy before anything queued after this reads
        the blocks. A no-op fence for CPU caches."""
        result = self.wait()
        if self._event and self._open_event is not None:
            import torch
            stream = stream if stream is not None else torch.cuda.current_stream()
            stream.wait_event(self._open_event(self._event, stream.device))
        return result

    def done(self) -> bool:
        if self._result is None:
            self._resolve(self._channel.poll_reply(self._req_id, 0.0))
            self._check()
        return self._result is not None

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until final. Past ``transfer_timeout`` the transfer is cancelled
        and every block reported failed once the daemon confirmed it stopped.
        ``timeout`` bounds this call only: TimeoutError if not final by then
        (the blocks stay held)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            now = time.monotonic()
            until = now + LIVENESS_SLICE_S
            if not self._cancelled:
                until = min(until, self._deadline)
            if end is not None:
                until = min(until, end)
            self._resolve(self._channel.poll_reply(self._req_id, max(0.0, until - now)))
            if self._result is None:
                self._check(liveness=True)
            if self._result is None and end is not None and time.monotonic() >= end:
                raise TimeoutError(f"transfer not finished within {timeout}s (blocks still held)")
        return self._result

    def _check(self, liveness: bool = False) -> None:
        """Past the deadline: cancel once. Daemon dead: nothing can touch the blocks."""
        if not self._cancelled and time.monotonic() >= self._deadline:
            self._cancelled = True
            self._channel.cancel(self._req_id)
        if (liveness or self._cancelled) and self._channel.session.daemon.gone():
            self._channel.abandon(self._req_id)
            self._result = failed_all(self._count, "daemon exited", self._names)

    def _resolve(self, reply) -> None:
        if reply is None:
            return
        if isinstance(reply, m.TransferDone):
            self._event = reply.event
            self._result = TransferResult(reply.done, reply.skipped,
                                          tuple(unpack_ids(reply.failed).tolist()), reply.no_space,
                                          names=self._names)
        elif self._cancelled:
            self._result = failed_all(self._count, f"timed out, cancelled: {reply}", self._names)
        else:  # error reply or transport failure
            self._result = failed_all(self._count, str(reply), self._names)


def failed_all(count: int, error: str, names: tuple[str, ...] = ()) -> TransferResult:
    return TransferResult(0, 0, tuple(range(count)), False, error, names)
