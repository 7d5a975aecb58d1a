"""Error codes shared by the daemon and the client.

Every failure that crosses the wire is an ``ErrorCode`` plus a message and the
side at fault (``"client"`` when the request was wrong, ``"daemon"`` when the
daemon failed to serve a valid request). Codes are stable wire values.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    BAD_MESSAGE = 1        # undecodable frame, wrong types, missing fields
    UNKNOWN_OP = 2         # tag not in the codec's table
    BAD_ARGUMENT = 3       # well-formed but invalid values (ids out of range...)
    NO_SPACE = 4           # pool full (only for ops that cannot report it as a value)
    UNKNOWN_NAMESPACE = 5  # registration / namespace id not known to this client
    INTERNAL = 6           # daemon bug; the daemon keeps serving
    VERSION_MISMATCH = 7   # HELLO with a protocol version the daemon cannot speak
    NOT_CONNECTED = 8      # request before HELLO, or from a reaped client
    TOO_LARGE = 9          # frame over the maximum message size
    UNAUTHORIZED = 10      # bad or missing token at HELLO
    SHUTTING_DOWN = 11     # daemon is draining; retry against the next daemon
    CANCELLED = 12         # transfer stopped (client cancel, reap, drain); nothing committed
    OVER_LIMIT = 13        # a per-user cap (in-flight transfers, mappings, hand-overs) is reached; retry later
    EXHAUSTED = 14         # the daemon ran out of descriptors or memory serving this; nothing done, retry later
    NO_GPU = 15            # a CUDA cache sent to a daemon without a CUDA data path


CLIENT_FAULT = frozenset({
    ErrorCode.BAD_MESSAGE, ErrorCode.UNKNOWN_OP, ErrorCode.BAD_ARGUMENT,
    ErrorCode.UNKNOWN_NAMESPACE, ErrorCode.VERSION_MISMATCH,
    ErrorCode.NOT_CONNECTED, ErrorCode.TOO_LARGE, ErrorCode.UNAUTHORIZED, ErrorCode.OVER_LIMIT,
})


def side_of(code: ErrorCode) -> str:
    return "client" if code in CLIENT_FAULT else "daemon"


class ProtocolError(Exception):
    """A message could not be decoded or validated.

    Raised by the codec; the daemon turns it into an error reply. ``request_id``
    is the offending frame's id when it could be read, else 0, so the error
    reply still reaches the caller waiting on that id.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id

    @property
    def side(self) -> str:
        return side_of(self.code)
