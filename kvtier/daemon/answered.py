"""Lookups a client answered from its lookup mirror, added to the counters
socket lookups use, so ``kvtier status`` and the metrics count every lookup
and hit however it was answered.

A client reports, on its heartbeat, what its mirrors answered since its last
report (``LookupsAnswered``: per registration, lookups, hashes asked, hashes
hit). The report is checked whole before anything is added: each row names a
registration of the reporting client (so only its own tenant's namespaces),
with non-negative counts, hits <= keys, keys <= lookups x the largest lookup,
and lookups <= ``MAX_LOOKUPS`` per row; a bad report is a BAD_ARGUMENT error
(an unknown registration UNKNOWN_NAMESPACE) and changes no counter.

What a forged report can do: raise its own namespace's ``lookups``/``hits``/
``misses`` (and with them the pool-wide totals, which sum the namespaces),
as real lookups over the socket could, within the bound per report. It
cannot touch another tenant's rows. The same counts go to ``mirror_lookups``
/ ``mirror_hits`` too, so an operator sees which share was self-reported.

Primitives: ``check_report(client, counts, registration) -> rows``, ``add_report(rows, count)``.
"""

from __future__ import annotations

from ..protocol.errors import ErrorCode
from .ops import MAX_BLOCKS_PER_OP
from .state import DaemonError

MAX_ROWS = 256               # registrations per report (a client's caches; more is refused)
MAX_LOOKUPS = 1 << 24        # per row and report: ~16M, 200x the 76k/s one process reached


def check_report(client, counts, registration) -> list:
    """The report's rows as (bucket, lookups, keys, hits); raises DaemonError before any is added."""
    if not isinstance(counts, list) or len(counts) > MAX_ROWS:
        raise DaemonError(ErrorCode.BAD_ARGUMENT, f"counts must be a list of at most {MAX_ROWS} rows")
    rows = []
    for row in counts:
        if (not isinstance(row, list) or len(row) != 4
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, "each row is [reg, lookups, keys, hits] of integers")
        reg_id, lookups, keys, hits = row
        if not (0 <= lookups <= MAX_LOOKUPS and 0 <= hits <= keys <= lookups * MAX_BLOCKS_PER_OP):
            raise DaemonError(ErrorCode.BAD_ARGUMENT, f"counts {row[1:]} out of range: 0 <= lookups <= "
                              f"{MAX_LOOKUPS}, 0 <= hits <= keys <= lookups x {MAX_BLOCKS_PER_OP}")
        rows.append((registration(client, reg_id).ns, lookups, keys, hits))
    return rows


def add_report(rows: list, count) -> None:
    """``count``: ``BlockIndex.count`` (the index owns the counters)."""
    for ns, lookups, keys, hits in rows:
        count(ns, lookups=lookups, hits=hits, misses=keys - hits, mirror_lookups=lookups, mirror_hits=hits)
