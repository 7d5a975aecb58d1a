"""Handles for asynchronous store/load/offload/restore."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol import messages as m
from ..protocol.arrays import unpack_ids

if TYPE_CHECKING:
    from .client import Client


@dataclass(frozen=True)
class TransferResult:
    done: int                     # blocks copied (store: newly stored)
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
        """Offload: request ids that were not offloaded (soft-reset those)."""
        return tuple(self.names[i] for i in self.failed)


class TransferHandle:
    """Poll with ``done()``, block with ``wait()``. A store's source blocks (and
    a load's destination blocks) must not be reused until the handle is done:
    ``held_blocks`` names them and is empty once they are free again."""

    def __init__(self, client: "Client | None", req_id: int, count: int, deadline: float,
                 result: TransferResult | None = None, names: tuple[str, ...] = (),
                 blocks: tuple[int, ...] = ()):
        self._client, self._req_id, self._count = client, req_id, count
        self._deadline, self._result, self._names = deadline, result, names
        self._blocks = blocks
        self._event = b""  # CUDA load: the daemon's "copy finished" event

    @property
    def held_blocks(self) -> tuple[int, ...]:
        """Engine block ids the daemon may still read (store) or write (load)."""
        return () if self.done() else self._blocks

    def wait_event(self, stream=None) -> TransferResult:
        """``wait()``, then make ``stream`` (default: the current CUDA stream)
        wait on the daemon's copy before anything queued after this reads
        the blocks. A no-op fence for CPU caches."""
        result = self.wait()
        if self._event:
            import torch
            stream = stream if stream is not None else torch.cuda.current_stream()
            stream.wait_event(self._client.open_event(self._event, stream.device))
        return result

    def done(self) -> bool:
        if self._result is None:
            self._resolve(self._client._poll_reply(self._req_id, 0.0))
        return self._result is not None

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until finished; on timeout every block is reported failed."""
        if self._result is None:
            deadline = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
            reply = self._client._poll_reply(self._req_id, max(0.0, deadline - time.monotonic()))
            self._resolve(reply)
            if self._result is None:
                if timeout is not None and time.monotonic() < self._deadline:
                    raise TimeoutError(f"transfer not finished within {timeout}s")
                self._client._abandon(self._req_id)
                self._result = failed_all(self._count, "timeout waiting for the daemon", self._names)
        return self._result

    def _resolve(self, reply) -> None:
        if reply is None:
            return
        if isinstance(reply, m.TransferDone):
            self._event = reply.event
            self._result = TransferResult(reply.done, reply.skipped,
                                          tuple(unpack_ids(reply.failed).tolist()), reply.no_space,
                                          names=self._names)
        else:  # error reply or transport failure
            self._result = failed_all(self._count, str(reply), self._names)


def failed_all(count: int, error: str, names: tuple[str, ...] = ()) -> TransferResult:
    return TransferResult(0, 0, tuple(range(count)), False, error, names)
