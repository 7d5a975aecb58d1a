"""Wire messages: frozen dataclasses, one per operation.

Each class carries a stable short wire ``TAG`` (never its Python name). Field
names are the wire keys. Requests flow client -> daemon, replies daemon ->
client; every request gets exactly one reply carrying the same request id.

Primitives:
  Hello/Welcome            open a session (protocol version checked here)
  Register/Registered      export a KV cache under a namespace fingerprint
  Lookup/Hits              longest ready prefix of a hash chain
  LookupMany/HitsMany      the same for many chains (a scheduling step) at once
  Store, Load/TransferDone two-phase copies; reply when the copy finished
  Offload, Restore, Discard request swap (owned by one client, not shared)
  Cancel -> Ok             stop a transfer; its own reply then confirms it is over
  Stats/StatsReply, Flush/Flushed, Ping/Bye/Unregister -> Ok
  LookupsAnswered -> Ok    what lookup mirrors answered, for the daemon's counters
  Error                    typed failure (code, message, side at fault)

Hashes travel as one ``bytes`` of ``HASH_BYTES``-sized digests and block ids
as one ``bytes`` of little-endian int32 (see ``kvtier.protocol.arrays``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

TABLE: dict[str, type] = {}


def message(tag: str):
    """Register a frozen dataclass under a stable wire tag."""

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        if tag in TABLE:
            raise ValueError(f"duplicate wire tag {tag!r}")
        cls.TAG = tag
        TABLE[tag] = cls
        return cls

    return wrap


# ---- requests ---------------------------------------------------------------

@message("hi")
class Hello:
    version: int
    pid: int                # informational: local sessions use the kernel's pid (SO_PEERCRED)
    name: str = ""
    token: str = ""
    TAG: ClassVar[str]


@message("reg")
class Register:
    namespace: str          # fingerprint: model, dtype, layout, block size, TP
    tensors: list           # list of tensor specs (see PROTOCOL.md)
    block_factor: int = 1   # engine blocks per kvtier block
    swap_quota: int = -1    # bytes; -1 = daemon default; may only lower the operator's quota
    ticket: str = ""        # CPU caches: the hand-over ticket for the memory descriptors
    TAG: ClassVar[str]


@message("unreg")
class Unregister:
    reg: int
    TAG: ClassVar[str]


@message("lk")
class Lookup:
    reg: int
    hashes: bytes
    TAG: ClassVar[str]


@message("lkm")
class LookupMany:
    reg: int
    chains: list            # [hashes: bytes, ...], one packed hash chain per request
    TAG: ClassVar[str]


@message("st")
class Store:
    reg: int
    hashes: bytes
    blocks: bytes           # engine block ids, block_factor per hash
    event: bytes = b""      # CUDA: IPC handle of the worker's event recorded after the writes
    TAG: ClassVar[str]


@message("ld")
class Load:
    reg: int
    hashes: bytes
    blocks: bytes           # engine block ids: block_factor per hash - skip
    skip: int = 0           # engine blocks of the first kvtier block not loaded
    event: bytes = b""      # CUDA: IPC handle of the worker's event; the daemon writes after it
    prefix: bool = False    # load only the longest ready prefix (lookup + load in one round trip)
    TAG: ClassVar[str]


@message("off")
class Offload:
    reg: int
    requests: list          # [[request_id: str, blocks: bytes], ...]
    TAG: ClassVar[str]


@message("rst")
class Restore:
    reg: int
    request: str
    blocks: bytes
    TAG: ClassVar[str]


@message("disc")
class Discard:
    reg: int
    request: str
    TAG: ClassVar[str]


@message("stat")
class Stats:
    check: bool = False     # also run the pool's integrity check (O(blocks))
    TAG: ClassVar[str]


@message("flush")
class Flush:
    namespace: str = ""     # fingerprint; "" flushes every namespace
    TAG: ClassVar[str]


@message("ping")
class Ping:
    TAG: ClassVar[str]


@message("seen")
class LookupsAnswered:
    counts: list            # [[reg, lookups, keys, hits], ...] answered from lookup mirrors since the last report
    TAG: ClassVar[str]


@message("bye")
class Bye:
    TAG: ClassVar[str]


@message("cancel")
class Cancel:
    request: int            # request id of this client's store/load/offload/restore
    TAG: ClassVar[str]


# ---- replies ----------------------------------------------------------------

@message("welcome")
class Welcome:
    version: int
    client_id: int
    heartbeat_s: float
    max_message: int
    daemon_pid: int = 0     # lets a local client tell "daemon slow" from "daemon gone"
    TAG: ClassVar[str]


@message("regd")
class Registered:
    reg: int
    namespace_id: int
    block_bytes: int
    num_blocks: int          # engine blocks in the registered cache
    index: str = ""          # shm segment mirroring the namespace's ready hashes ("" = none)
    TAG: ClassVar[str]


@message("hits")
class Hits:
    hits: int
    TAG: ClassVar[str]


@message("hitsm")
class HitsMany:
    hits: bytes             # int32 per chain, in request order
    TAG: ClassVar[str]


@message("done")
class TransferDone:
    done: int               # blocks copied (store: newly stored)
    skipped: int = 0        # store: already present (dedup) or being written
    failed: bytes = b""     # int32 indices (into the request's hashes/requests)
    no_space: bool = False  # store/offload: some blocks failed for lack of room
    event: bytes = b""      # CUDA load: IPC handle of the daemon's event recorded after the copy
    TAG: ClassVar[str]


@message("stats")
class StatsReply:
    stats: dict
    TAG: ClassVar[str]


@message("flushed")
class Flushed:
    removed: int
    TAG: ClassVar[str]


@message("ok")
class Ok:
    TAG: ClassVar[str]


@message("err")
class Error:
    code: int
    message: str
    side: str = "client"
    TAG: ClassVar[str]


KiB = 1024
FRAME_BOUNDS: dict[str, int] = {
    # The largest frame each request can be while still valid, checked on the
    # frame's length before it is decoded (st, ld, off and reg carry block id
    # arrays bounded by daemon config: only max_message bounds them). A lookup
    # holds at most 65,536 16-byte hashes; lkm as many over <= 4,096 chains;
    # rst at most 262,144 bytes of ids; the rest are a few fields.
    "lk": 1024 * KiB + 4 * KiB, "lkm": 1024 * KiB + 64 * KiB, "rst": 256 * KiB + 4 * KiB,
    "hi": 64 * KiB, "unreg": 64 * KiB, "disc": 64 * KiB, "stat": 64 * KiB, "flush": 64 * KiB,
    "ping": 64 * KiB, "bye": 64 * KiB, "cancel": 64 * KiB, "seen": 64 * KiB,
}
"""Per-op frame bounds (bytes); ops not listed are bounded by ``max_message`` alone."""

REQUESTS: frozenset[type] = frozenset({
    Hello, Register, Unregister, Lookup, LookupMany, Store, Load, Offload, Restore, Discard, Stats, Flush,
    Ping, Bye, Cancel, LookupsAnswered})
"""Messages a client may send; every other tag is a reply."""

TRANSFERS: frozenset[type] = frozenset({Store, Load, Offload, Restore})
"""Requests whose copy touches the engine's blocks until their reply."""


def wire_fields(cls) -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(cls)


def as_wire_dict(msg: Any) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
