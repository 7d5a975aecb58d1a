"""Codec: message objects <-> single ZeroMQ frames. Does no I/O.

A frame is a msgpack array ``[tag, request_id, body]`` where ``tag`` is the
message's wire tag, ``request_id`` an unsigned 64-bit integer chosen by the
client, and ``body`` a map of field name -> value. Unknown body keys are
ignored (forward compatibility); missing required keys and wrong types raise
``ProtocolError(BAD_MESSAGE)``; an unknown tag raises ``UNKNOWN_OP``.

Sizes are checked before anything is copied or decoded (``check_size``):
the frame against ``max_message``, then a large frame against its op's own
bound (``messages.FRAME_BOUNDS``), read from the frame's first bytes
(``peek``). A 16 MiB lookup used to be copied and decoded whole (~10 ms of
the daemon's loop each) before its hash count was refused.

Primitives: ``encode(msg, request_id) -> bytes``,
``decode(frame) -> (request_id, msg)``, ``check_size(frame, max_bytes)``,
``peek(frame) -> (tag, request_id) | None``, ``error_reply(exc) -> Error``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError
from .messages import FRAME_BOUNDS, MAX_MESSAGE_BYTES, TABLE, Error, as_wire_dict

# Annotation string -> accepted Python types after msgpack decoding.
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "str": (str,), "bytes": (bytes,), "bool": (bool,),
    "float": (float, int), "list": (list,), "dict": (dict,),
}
_U64 = (1 << 64) - 1
PEEK_BYTES = 64          # array header + a tag (<= 32 chars) + a uint64 request id fit in this
PEEK_ABOVE = min(FRAME_BOUNDS.values())  # smaller frames are within every op's bound: no peek


def encode(msg: Any, request_id: int) -> bytes:
    tag = getattr(type(msg), "TAG", None)
    if tag is None or TABLE.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    if not _is_u64(request_id):  # the peer would reject the frame; fail at the sender
        raise ValueError(f"request_id must be an unsigned 64-bit integer, got {request_id!r}")
    return msgpack.packb([tag, request_id, as_wire_dict(msg)], use_bin_type=True)


def check_size(frame, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """TOO_LARGE for a frame over ``max_bytes`` (request id 0) or over its op's
    bound (with the request id); reads at most ``PEEK_BYTES`` of it."""
    n = len(frame)
    if n > max_bytes:
        raise _err(ErrorCode.TOO_LARGE, f"frame of {n} bytes exceeds {max_bytes}")
    if n > PEEK_ABOVE:
        head = peek(frame)
        bound = FRAME_BOUNDS.get(head[0]) if head is not None else None
        if bound is not None and n > bound:
            raise _err(ErrorCode.TOO_LARGE, f"a {head[0]!r} frame is at most {bound} bytes, got {n}", head[1])


def peek(frame) -> tuple[str, int] | None:
    """(tag, request_id) from the first bytes of a frame, or None when they do
    not read as ``[str, uint64, ...`` (the full decode then says what is wrong)."""
    try:
        u = msgpack.Unpacker(raw=False)
        u.feed(bytes(memoryview(frame)[:PEEK_BYTES]))
        if u.read_array_header() != 3:
            return None
        tag, request_id = u.unpack(), u.unpack()
    except Exception:  # msgpack raises several unrelated types (OutOfData for a long tag)
        return None
    return (tag, request_id) if isinstance(tag, str) and _is_u64(request_id) else None


def decode(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[int, Any]:
    """Decode one frame (bytes or any buffer). Raises ProtocolError carrying
    ``request_id`` (0 if unknown)."""
    check_size(frame, max_bytes)
    try:
        obj = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise _err(ErrorCode.BAD_MESSAGE, f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise _err(ErrorCode.BAD_MESSAGE, "frame must be [tag, request_id, body]")
    tag, request_id, body = obj
    if not _is_u64(request_id):
        raise _err(ErrorCode.BAD_MESSAGE, "request_id must be an unsigned 64-bit integer")
    if not isinstance(tag, str):
        raise _err(ErrorCode.BAD_MESSAGE, "tag must be a string", request_id)
    cls = TABLE.get(tag)
    if cls is None:
        raise _err(ErrorCode.UNKNOWN_OP, f"unknown op {tag[:32]!r}", request_id)
    if not isinstance(body, dict):
        raise _err(ErrorCode.BAD_MESSAGE, f"{tag}: body must be a map", request_id)
    return request_id, cls(**_fields(cls, body, request_id))


def _fields(cls, body: dict, request_id: int) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING:
                raise _err(ErrorCode.BAD_MESSAGE, f"{cls.TAG}: missing field {f.name!r}", request_id)
            continue
        value = body[f.name]
        ok = _TYPES[f.type]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            raise _err(ErrorCode.BAD_MESSAGE,
                       f"{cls.TAG}.{f.name}: expected {f.type}, got {type(value).__name__}", request_id)
        out[f.name] = float(value) if f.type == "float" else value
    return out


def error_reply(exc: ProtocolError) -> Error:
    return Error(code=int(exc.code), message=exc.message, side=exc.side)


def _is_u64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64


def _err(code: ErrorCode, message: str, request_id: int = 0) -> ProtocolError:
    return ProtocolError(code, message, request_id)
