"""The ``stats`` document: what ``kvtier status --json`` prints.

Keys are stable; new keys may be added, existing ones keep their meaning.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

from ..protocol.messages import PROTOCOL_VERSION
from ..pool import checksum
from ..pool.entry import NATIVE
from ..pool.index import STAT_KEYS
from .sessions import operator_quota
from .state import NO_CAP
from ..pool.keys import split_key

class StatsSource(Protocol):
    """What the document is read from: the daemon's parts (stats looks down at
    them; the daemon composes them and hands itself over as this)."""
    index: object
    sessions: object
    swap: object
    guard: object
    housekeeping: object
    gpu: object
    remote: object
    disk: object
    lookup_indexes: object
    warm: object
    listener: object
    config: object
    counters: dict
    errors: dict
    started: float


def _client_row(d: StatsSource, c) -> dict:
    """One session and its caches. A quota is bytes, 0 no swap, None no cap;
    the session's ``swap_quota`` is the smallest of its caches' (the
    operator's default before it registers one)."""
    caches = [{"id": r.id, "namespace": split_key(r.ns.key)[1], "swap_quota": _quota(r.swap_quota),
               "swap_bytes": d.swap.cache_bytes(c.id, r.id)} for r in c.regs.values() if not r.closing]
    quota = min((r.swap_quota for r in c.regs.values() if not r.closing), default=operator_quota(d.config))
    return {"id": c.id, "pid": c.pid, "uid": c.uid, "tenant": c.tenant, "name": c.name,
            "connected_s": round(time.time() - c.connected, 3),
            "namespaces": sorted({split_key(r.ns.key)[1] for r in c.regs.values()}),
            "inflight": len(c.ops), "swap_bytes": d.swap.owner_bytes(c.id),
            "swap_quota": _quota(quota), "swap_requests": d.swap.owner_requests(c.id), "caches": caches}


def _quota(q: int | float) -> int | None:
    return None if q == NO_CAP else q


def daemon_stats(d: StatsSource, viewer=None) -> dict:
    """The document, built fresh from the daemon's parts (never mutated later).

    ``viewer`` is the asking client: unless it is an admin it sees only its
    tenant's namespaces and clients (pool-wide figures are for everyone);
    None is the operator (metrics, status notifications), who sees all."""
    everything = viewer is None or viewer.admin
    namespaces = []
    for ns in d.index.namespaces_matching():
        tenant, fingerprint = split_key(ns.key)
        if not everything and tenant != viewer.tenant:
            continue
        blocks = ns.ready_blocks()
        row = {"id": ns.id, "fingerprint": fingerprint, "block_bytes": ns.block_bytes,
               "blocks": blocks, "bytes": blocks * ns.block_bytes,
               "writing": ns.writing_blocks()}
        row.update({k: ns.stats[k] for k in STAT_KEYS})
        if everything:
            row["tenant"] = tenant
        namespaces.append(row)
    totals = {k: sum(n[k] for n in namespaces) for k in STAT_KEYS}
    lookups_blocks = totals["hits"] + totals["misses"]
    totals["hit_rate"] = totals["hits"] / lookups_blocks if lookups_blocks else 0.0
    for k in ("store_bytes", "load_bytes", "stores", "loads", "offload_bytes", "restore_bytes",
              "offloads", "restores", "requests", "reaped", "cancelled", "stats_withheld"):
        totals[k] = d.counters[k]
    clients = [_client_row(d, c) for c in d.sessions.clients.values() if everything or c.tenant == viewer.tenant]
    return {
        "version": PROTOCOL_VERSION, "pid": os.getpid(),
        "uptime_s": round(time.time() - d.started, 3), "socket": d.config.socket,
        "pool": {**d.index.capacity(),
                 "blocks": sum(n["blocks"] for n in namespaces),
                 "evictions": d.index.evictions, "policy": d.config.policy,
                 "checksum": checksum.IMPLEMENTATION,
                 "index": "compiled" if NATIVE else "python",  # pool/entry.py: which build of the index runs
                 **_pin_stats(d.gpu)},
        "swap": {"bytes": d.swap.total_bytes, "max_bytes": d.swap.max_bytes,
                 "pinned_slab_bytes": d.swap.pinned_slab_bytes,
                 "requests": len(d.swap.records)},
        "namespaces": namespaces, "clients": clients, "totals": totals,
        "errors": dict(d.errors),
        "connections": {"open": len(d.guard.conns), "cut": d.guard.counters["connections_cut"]},
        "latency": d.housekeeping.latency.snapshot(),
        "gc": d.housekeeping.tenure.stats(),
        "gpu": d.gpu.stats() if d.gpu is not None else {"enabled": False},
        "remote": d.remote.stats(None if everything else viewer.tenant) if d.remote is not None else {"enabled": False},
        "disk": d.disk.stats(None if everything else viewer.tenant) if d.disk is not None else {"enabled": False},
        "tenants": _tenant_stats(d.index, None if everything else viewer.tenant),
        "lookup_index": _mirror_stats(d.lookup_indexes),
        "warm_restart": d.warm.stats() if d.warm is not None else {"enabled": False},
        "events": {"enabled": d.listener.pub is not None, "published": d.counters["events_published"],
                   "dropped": d.counters["events_dropped"],
                   "dropped_messages": d.counters["event_messages_dropped"]},
        "flushes": {"started": d.counters["flushes"], "pending": d.flushes.unanswered,
                    "turns": d.counters["flush_turns"],  # loop turns that freed flushed blocks
                    "longest_turn_ms": d.counters["flush_longest_turn_us"] / 1e3,
                    "longest_turn_cpu_ms": d.counters["flush_longest_turn_cpu_us"] / 1e3,
                    # files of flushed namespaces still to drop (hidden from every reader already)
                    "disk_hidden": d.disk.dindex.hidden if d.disk is not None else 0},
    }


def _tenant_stats(index, tenant: str | None) -> dict:
    """Pool bytes (READY + being stored) per tenant and the share they are held to;
    a tenant that is not an admin sees its own row only."""
    shares = index.tenants
    rows = {t: {"bytes": b, "at_share": shares.at_share[t], "own_evictions": shares.own_evictions[t]}
            for t, b in shares.usage(index).items() if tenant is None or t == tenant}
    return {"share": shares.share, "limit_bytes": shares.limit, "tenants": rows}


def _mirror_stats(mirrors) -> dict:
    if mirrors is None:
        return {"enabled": False}
    return {"enabled": True, "tables": mirrors.tables, "bytes": mirrors.bytes,
            "budget_bytes": mirrors.budget, "refused": mirrors.refused}


def _pin_stats(gpu) -> dict:
    """How much of the pool is registered for DMA (0/False without a GPU)."""
    pinned = gpu.pinned if gpu is not None else None
    return {"pinned_bytes": pinned.pinned_bytes if pinned else 0,
            "pinning": bool(pinned and pinned.pinning)}
