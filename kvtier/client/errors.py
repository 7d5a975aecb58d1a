"""Typed client exceptions."""

from __future__ import annotations

from ..protocol.errors import ErrorCode, side_of


class KVTierError(Exception):
    """The daemon answered with an error (``code``, ``side`` at fault)."""

    def __init__(self, code: ErrorCode | int, message: str, side: str | None = None):
        try:
            code = ErrorCode(code)
        except ValueError:
            code = ErrorCode.INTERNAL
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message
        self.side = side or side_of(code)


class DaemonUnavailable(KVTierError):
    """No daemon answered within the timeout (not running, restarting, hung)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.INTERNAL, message, "daemon")
