"""Daemon logging: one line per event on stderr, as text or as JSON.

Under systemd stderr goes to the journal; ``log_format = "json"`` makes each
line one JSON object (ts, level, logger, msg, pid) so log shippers need no
parsing rules. The daemon logs per client (connect, register, reap), per
error reply and per failed copy, never per block.
"""

from __future__ import annotations

import json
import logging
import sys
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def make_formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def setup_logging(level: str, fmt: str) -> None:
    """Install one stderr handler on the root logger (replacing any earlier one)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level.upper())


def apply_logging(level: str, fmt: str) -> None:
    """Change level and format of the installed handlers in place (SIGHUP)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    for h in root.handlers:
        h.setFormatter(make_formatter(fmt))
