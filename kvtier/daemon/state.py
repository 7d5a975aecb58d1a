"""Daemon-side records: connected clients and their registered caches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..pool.index import Bucket
from ..protocol.errors import ErrorCode
from ..transfer.layout import KVLayout


MAX_PID = 1 << 22  # the kernel's PID_MAX_LIMIT: anything above is no process
NO_CAP = float("inf")  # a swap quota nobody set: only the pool-wide swap cap applies


class DaemonError(Exception):
    """An expected failure answered with a typed error reply."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def process_start(pid: int) -> float | None:
    """Creation time of ``pid`` (guards against pid reuse), None if unknown."""
    if not 0 < pid < MAX_PID:
        return None
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None


@dataclass(eq=False)
class ClientState:
    id: int
    identity: bytes
    pid: int
    name: str
    start_time: float | None          # None: pid not verifiable here (remote)
    connected: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    regs: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)   # request id -> CopyOp in flight
    peer: Any = None                  # kernel credentials (peers.Peer); None: remote (TCP)
    conn_fd: int = -1                 # the connection it said HELLO on (libzmq's descriptor)
    hung_up: bool = False             # that connection closed (reaped at the next pass)
    tenant: str = "remote"            # who owns the namespaces this client creates
    admin: bool = False               # may flush and see every tenant

    @property
    def uid(self) -> int | None:
        return self.peer.uid if self.peer is not None else None

    def process_alive(self) -> bool:
        if not 0 <= self.pid < MAX_PID:
            return False
        if self.start_time is None:
            # Remote clients (pid <= 0): the heartbeat decides. A local pid that was
            # already gone at HELLO (killed with its HELLO in flight) is dead now.
            return self.pid <= 0 or psutil.pid_exists(self.pid)
        try:
            p = psutil.Process(self.pid)
            return p.create_time() == self.start_time and p.status() != psutil.STATUS_ZOMBIE
        except (psutil.Error, ValueError, OverflowError):
            return False


@dataclass(eq=False)
class Registration:
    id: int
    client: ClientState
    ns: Bucket
    layout: KVLayout | None
    segments: list
    cuda_engine: Any = None            # CudaCopyEngine for CUDA registrations, None on the CPU
    inflight: int = 0
    closing: bool = False
    max_copy_pieces: int = 1 << 20     # the operator's cap when it registered
    swap_quota: int | float = NO_CAP   # bytes this cache may hold in swap (0: none), set once at REGISTER
