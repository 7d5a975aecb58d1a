"""Where an exception becomes an error reply: typed, counted, logged, sent.

The dispatch point (``dispatch.py``) and a load resumed after a lower tier's
reads (``requests.py``) answer through the same mapping: ``DaemonError`` and
``ProtocolError`` keep their code; the daemon running out of descriptors,
mappings or memory (``EMFILE``, ``ENOMEM``, ``MemoryError``) is ``EXHAUSTED``
for that request alone; anything else is a bug, logged with its traceback and
answered ``INTERNAL`` - the loop serves on.

Primitives: ``Replies(send, errors)``, ``.send(identity, req_id, reply)``,
``.error(code, message, client) -> m.Error``, ``.failure(exc, client, identity) -> m.Error``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

from ..protocol import messages as m
from ..protocol.errors import ErrorCode, ProtocolError, side_of
from ..transfer.mapping import RESOURCE_ERRNOS
from .state import DaemonError

log = logging.getLogger("kvtier.daemon")


class Replies:
    def __init__(self, send: Callable[[bytes, int, object], None], errors: Counter):
        self.send, self.errors = send, errors

    def error(self, code: ErrorCode, message: str, client) -> m.Error:
        self.errors[code.name] += 1
        log.warning("error %s to client %s: %s", code.name, client.id if client else "-", message)
        return m.Error(int(code), message, side_of(code))

    def failure(self, exc: BaseException, client, identity: bytes) -> m.Error:
        """The reply for a request that raised ``exc`` (call it in the ``except`` block: a bug's
        traceback is logged from there)."""
        if isinstance(exc, (ProtocolError, DaemonError)):
            return self.error(exc.code, exc.message, client)
        if exhausted(exc):  # out of descriptors or mappings: this request is refused, the session goes on
            return self.error(ErrorCode.EXHAUSTED, f"the daemon is out of resources: {exc}", client)
        log.exception("internal error handling a request from %r", client.id if client else identity)
        return self.error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", client)


def exhausted(exc: BaseException) -> bool:
    """A failure for want of descriptors, mappings or memory (not a bug)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS)
