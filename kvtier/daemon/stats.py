"""The ``stats`` document: what ``kvtier status --json`` prints.

Keys are stable; new keys may be added, existing ones keep their meaning.
"""

from __future__ import annotations

import os
import time

from ..protocol.messages import PROTOCOL_VERSION
from ..pool.index import STAT_KEYS


class StatsMixin:
    def stats(self) -> dict:
        alloc = self.index.alloc_
        namespaces = []
        for ns in self.index.namespaces.values():
            blocks = ns.ready_blocks()
            row = {"id": ns.id, "fingerprint": ns.fingerprint, "block_bytes": ns.block_bytes,
                   "blocks": blocks, "bytes": blocks * ns.block_bytes,
                   "writing": len(ns.entries) - blocks}
            row.update({k: ns.stats[k] for k in STAT_KEYS})
            namespaces.append(row)
        totals = {k: sum(n[k] for n in namespaces) for k in STAT_KEYS}
        lookups_blocks = totals["hits"] + totals["misses"]
        totals["hit_rate"] = totals["hits"] / lookups_blocks if lookups_blocks else 0.0
        for k in ("store_bytes", "load_bytes", "stores", "loads", "offload_bytes", "restore_bytes",
                  "offloads", "restores", "requests", "reaped"):
            totals[k] = self.counters[k]
        clients = [{"id": c.id, "pid": c.pid, "name": c.name,
                    "connected_s": round(time.time() - c.connected, 3),
                    "namespaces": sorted({r.ns.fingerprint for r in c.regs.values()}),
                    "inflight": len(c.ops), "swap_bytes": self.swap.owner_bytes(c.id),
                    "swap_quota": c.swap_quota, "swap_requests": self.swap.owner_requests(c.id)}
                   for c in self.clients.values()]
        return {
            "version": PROTOCOL_VERSION, "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3), "socket": self.config.socket,
            "pool": {"capacity_bytes": alloc.capacity, "used_bytes": alloc.used_bytes,
                     "free_bytes": alloc.free_bytes, "waste_bytes": alloc.waste_bytes,
                     "slab_bytes": alloc.slab_bytes, "slabs": len(alloc.slabs),
                     "free_slabs": len(alloc.free_slabs),
                     "blocks": sum(n["blocks"] for n in namespaces),
                     "evictions": self.index.evictions, "policy": self.config.policy,
                     **self._pin_stats()},
            "swap": {"bytes": self.swap.total_bytes, "max_bytes": self.swap.max_bytes,
                     "requests": len(self.swap.records)},
            "namespaces": namespaces, "clients": clients, "totals": totals,
            "errors": dict(self.errors),
            "latency": self.latency.snapshot(),
            "gpu": self.gpu.stats() if self.gpu is not None else {"enabled": False},
            # remote tier hook
            "remote": self.remote.stats() if self.remote is not None else {"enabled": False},
        }

    def _pin_stats(self) -> dict:
        """How much of the pool is registered for DMA (0/False without a GPU)."""
        pinned = self.gpu.pinned if self.gpu is not None else None
        return {"pinned_bytes": pinned.pinned_bytes if pinned else 0,
                "pinning": bool(pinned and pinned.pinning)}
