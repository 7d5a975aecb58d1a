"""Prometheus exposition of the daemon's stats snapshot (``metrics = "HOST:PORT"``).

prometheus_client's HTTP server answers scrapes on its own thread. The
collector therefore never touches daemon state: it turns the latest published
snapshot (``stats()`` output, replaced whole by the loop every 0.5 s) into
metric families at scrape time. Everything is prefixed ``kvtier_``.

Namespace series are labelled with every tenant's fingerprints and names, so
the endpoint is for operators: a scrape from a local user who is not one
(operators.py: root, the daemon's user, ``admin_group``) is answered 403
and gets nothing. Peers on other machines are the network's to allow.
"""

from __future__ import annotations

from typing import Callable

import logging
import socket
import threading
from wsgiref.simple_server import make_server

from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from .config import metrics_address
from .operators import tcp_peer_uid

log = logging.getLogger("kvtier.daemon")
FORBIDDEN = (b"HTTP/1.0 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
             b"kvtier metrics show every tenant: root, the daemon's user and admin_group only\n")

POOL_GAUGES = (  # stats key under "pool", metric name, help
    ("capacity_bytes", "pool_capacity_bytes", "Pool bytes in whole slabs (what blocks can use)."),
    ("used_bytes", "pool_used_bytes", "Bytes held by blocks (prefix cache and swap)."),
    ("free_bytes", "pool_free_bytes", "Bytes available for new blocks."),
    ("waste_bytes", "pool_waste_bytes", "Bytes lost to slab rounding."),
    ("faulting_bytes", "pool_faulting_bytes", "Bytes of slabs whose pages are not in yet (prefault = background)."),
    ("slabs", "pool_slabs", "Slabs carved so far."),
    ("free_slabs", "pool_free_slabs", "Slabs not assigned to a size class."),
    ("blocks", "pool_blocks", "Ready prefix-cache blocks."),
)
NAMESPACE_COUNTERS = (  # stats key per namespace, metric name, help
    ("lookups", "lookups", "Lookup calls."),
    ("hits", "hits", "Blocks found by lookups (longest ready prefix, disk tier included)."),
    ("disk_hits", "disk_hits", "Of those, blocks found in the disk tier after the RAM prefix ended."),
    ("misses", "misses", "Blocks looked up and not found."),
    ("mirror_lookups", "mirror_lookups", "Of the lookups, those clients answered from the lookup mirror (reported)."),
    ("mirror_hits", "mirror_hits", "Of the hits, those found by clients in the lookup mirror (reported)."),
    ("stored", "blocks_stored", "Blocks committed by stores."),
    ("loaded", "blocks_loaded", "Blocks copied out by loads."),
    ("evicted", "blocks_evicted", "Blocks evicted to make room."),
)
TRANSFER_KINDS = ("store", "load", "offload", "restore")
REMOTE_COUNTERS = (  # stats key under "remote", metric name, help
    ("remote_hits", "remote_hits", "Blocks found in the remote tier by lookups (after the local prefix)."),
    ("probe_skipped", "remote_probes_skipped", "Lookups answered locally without asking (tier unavailable)."),
    ("fetched", "remote_blocks_fetched", "Blocks fetched from the remote tier and verified."),
    ("fetched_bytes", "remote_fetched_bytes", "Bytes fetched from the remote tier."),
    ("fetch_failed", "remote_fetch_failed", "Blocks a load asked for that were missing or bad remotely."),
    ("corrupt", "remote_corrupt", "Remote values rejected as damaged: torn or checksum mismatch."),
    ("forged", "remote_forged",
     "Remote values rejected as not this cluster's: bad MAC, or another block's or namespace's value."),
    ("probe_late", "remote_probes_late", "Lookups answered locally because the store did not answer in time."),
    ("probe_over_share", "remote_probes_over_share",
     "Lookups answered locally because their tenant held its share of probe slots (max_probes_per_tenant)."),
    ("fetch_cancelled", "remote_fetch_cancelled", "Blocks not fetched because their load was cancelled."),
    ("written", "remote_blocks_written", "Blocks written behind to the remote tier."),
    ("written_bytes", "remote_written_bytes", "Bytes written behind to the remote tier."),
    ("write_skipped", "remote_write_skipped", "Committed blocks not written (tier unavailable)."),
    ("queue_full", "remote_queue_full", "Committed blocks not written (write-behind queue full)."),
    ("budget_skipped", "remote_budget_skipped", "Committed blocks not written (byte budget spent)."),
    ("errors", "remote_errors", "Remote calls that failed (unreachable, timed out)."),
)


DISK_COUNTERS = (  # stats key under "disk", metric name, help
    ("written", "disk_blocks_written", "Blocks written to the disk tier."),
    ("written_bytes", "disk_written_bytes", "Bytes written to the disk tier (payload)."),
    ("recycled", "disk_blocks_recycled", "Writes that overwrote a file evicted for them (no new file, no unlink)."),
    ("read", "disk_blocks_read", "Blocks read back from the disk tier and verified."),
    ("read_bytes", "disk_read_bytes", "Bytes read back from the disk tier."),
    ("dropped", "disk_blocks_dropped", "Disk blocks dropped, oldest first, to stay within disk_size."),
    ("rejected", "disk_blocks_rejected", "Disk files that failed verification at read (deleted)."),
    ("scan_rejected", "disk_files_rejected_at_start", "Files the start-up scan deleted (torn, foreign, not ours)."),
    ("enospc", "disk_enospc", "Writes that found the disk full."),
    ("eio", "disk_eio", "Disk operations that failed with EIO or EROFS."),
    ("timed_out", "disk_load_timeouts", "Blocks whose read missed disk_timeout_s (the load went on without them)."),
    ("fail_fast", "disk_fail_fast", "Blocks not read because a read was stuck on the disk."),
)


class SnapshotCollector:
    """A custom collector over ``get_snapshot()``; no state of its own."""

    def __init__(self, get_snapshot: Callable[[], dict | None]):
        self.get_snapshot = get_snapshot

    def describe(self):
        return []  # families depend on the snapshot; skip describe-time collection

    def collect(self):
        s = self.get_snapshot()
        if not s:
            return
        yield from self._pool(s)
        yield from self._namespaces(s["namespaces"])
        yield from self._traffic(s)
        yield from self._latency(s.get("latency", {}))
        yield from self._remote(s.get("remote", {}))  # remote tier hook
        yield from self._disk(s.get("disk", {}))  # disk tier hook
        yield from self._tenants(s.get("tenants", {}))
        yield from self._events(s.get("events", {}))
        yield from self._gc(s.get("gc", {}))

    @staticmethod
    def _gc(g):
        if not g:
            return
        yield CounterMetricFamily("kvtier_gc_full_collections", "Full garbage collections since start "
                                  "(counted with gc_freeze on).", value=g["full_passes"])
        yield GaugeMetricFamily("kvtier_gc_longest_full_seconds", "The longest full garbage collection "
                                "(it holds the thread that ran it; with gc_freeze on).",
                                value=g["longest_full_ms"] / 1e3)

    @staticmethod
    def _events(e):
        if not e.get("enabled"):
            return
        yield CounterMetricFamily("kvtier_events_published", "Block events sent on the event socket.",
                                  value=e["published"])
        yield CounterMetricFamily("kvtier_events_dropped", "Block events not sent: a subscriber was "
                                  "EVENTS_HWM messages behind (its messages are never queued beyond that).",
                                  value=e["dropped"])

    @staticmethod
    def _pool(s):
        pool = s["pool"]
        for key, name, doc in POOL_GAUGES:
            yield GaugeMetricFamily("kvtier_" + name, doc, value=pool[key])
        yield GaugeMetricFamily("kvtier_swap_bytes", "Bytes held for swapped-out requests.",
                                value=s["swap"]["bytes"])
        yield GaugeMetricFamily("kvtier_clients", "Connected clients.", value=len(s["clients"]))
        yield GaugeMetricFamily("kvtier_uptime_seconds", "Seconds since the daemon started.",
                                value=s["uptime_s"])
        yield CounterMetricFamily("kvtier_evictions", "Blocks evicted from the pool.",
                                  value=pool["evictions"])

    @staticmethod
    def _namespaces(namespaces):
        size = GaugeMetricFamily("kvtier_namespace_bytes", "Bytes of ready blocks per namespace.",
                                 labels=["namespace", "tenant"])
        blocks = GaugeMetricFamily("kvtier_namespace_blocks", "Ready blocks per namespace.",
                                   labels=["namespace", "tenant"])
        counters = [(key, CounterMetricFamily("kvtier_" + name, doc, labels=["namespace", "tenant"]))
                    for key, name, doc in NAMESPACE_COUNTERS]
        for ns in namespaces:
            # Two tenants may use one fingerprint: the tenant keeps their series apart.
            label = [ns["fingerprint"], ns.get("tenant", "")]
            size.add_metric(label, ns["bytes"])
            blocks.add_metric(label, ns["blocks"])
            for key, family in counters:
                family.add_metric(label, ns[key])
        yield size
        yield blocks
        for _, family in counters:
            yield family

    @staticmethod
    def _traffic(s):
        t = s["totals"]
        yield CounterMetricFamily("kvtier_requests", "Requests decoded.", value=t["requests"])
        yield CounterMetricFamily("kvtier_stores", "Store operations completed.", value=t["stores"])
        yield CounterMetricFamily("kvtier_loads", "Load operations completed.", value=t["loads"])
        yield CounterMetricFamily("kvtier_clients_reaped", "Clients reaped (died or went silent).",
                                  value=t["reaped"])
        moved = CounterMetricFamily("kvtier_transfer_bytes", "Bytes copied, by operation.", labels=["op"])
        for kind in TRANSFER_KINDS:
            moved.add_metric([kind], t.get(kind + "_bytes", 0))
        yield moved
        errors = CounterMetricFamily("kvtier_errors", "Error replies and failures, by code.", labels=["code"])
        for code, n in sorted(s["errors"].items()):
            errors.add_metric([code], n)
        yield errors

    @staticmethod
    def _latency(latency):
        family = HistogramMetricFamily("kvtier_transfer_seconds",
                                       "Transfer latency from request to copy completion.", labels=["op"])
        for kind, h in sorted(latency.items()):
            buckets = [(repr(float(b)), c) for b, c in zip(h["bounds"], h["cumulative"])]
            buckets.append(("+Inf", h["count"]))
            family.add_metric([kind], buckets, sum_value=h["sum_s"])
        yield family

    @staticmethod
    def _remote(r):
        if not r.get("enabled"):
            return
        yield GaugeMetricFamily("kvtier_remote_up", "1 when the remote tier's breaker is closed.",
                                value=1 if r["state"] == "closed" else 0)
        yield GaugeMetricFamily("kvtier_remote_queued_bytes", "Write-behind bytes waiting (held in the pool).",
                                value=r["queued_bytes"])
        for key, name, doc in REMOTE_COUNTERS:
            yield CounterMetricFamily("kvtier_" + name, doc, value=r[key])
        yield from _backlog("remote", r, "evicted, backlog_full, budget, rejected, error, too_large")


    @staticmethod
    def _tenants(t):
        if not t:
            return
        yield GaugeMetricFamily("kvtier_tenant_share", "tenant_share: most of the pool one tenant may hold "
                                "(1 = no limit).", value=t["share"])
        size = GaugeMetricFamily("kvtier_tenant_bytes", "Pool bytes per tenant (stored and being stored).",
                                 labels=["tenant"])
        full = CounterMetricFamily("kvtier_tenant_at_share", "Stores that found their tenant at its share.",
                                   labels=["tenant"])
        own = CounterMetricFamily("kvtier_tenant_own_evictions", "Blocks a tenant at its share evicted of "
                                  "its own.", labels=["tenant"])
        for name, row in sorted(t["tenants"].items()):
            size.add_metric([name], row["bytes"])
            full.add_metric([name], row["at_share"])
            own.add_metric([name], row["own_evictions"])
        yield size
        yield full
        yield own

    @staticmethod
    def _disk(d):
        if not d.get("enabled"):
            return
        yield GaugeMetricFamily("kvtier_disk_used_bytes", "Bytes of block files in the disk tier.",
                                value=d["used_bytes"])
        yield GaugeMetricFamily("kvtier_disk_capacity_bytes", "disk_size.", value=d["capacity_bytes"])
        yield GaugeMetricFamily("kvtier_disk_blocks", "Blocks in the disk tier.", value=d["blocks"])
        per = GaugeMetricFamily("kvtier_disk_namespace_bytes", "Disk tier bytes per namespace.",
                                labels=["namespace", "tenant"])
        for n in d["namespaces"]:
            per.add_metric([n["fingerprint"], n.get("tenant", "")], n["bytes"])
        yield per
        for key, name, doc in DISK_COUNTERS:
            yield CounterMetricFamily("kvtier_" + name, doc, value=d[key])
        yield from _backlog("disk", d, "evicted, backlog_full, over_share, too_long, failed")


def _backlog(tier: str, d: dict, reasons: str):
    """A lower tier's write backlog: what waits, and what was never written and why."""
    yield GaugeMetricFamily(f"kvtier_{tier}_backlog_blocks", "Committed blocks waiting for the write-behind queue.",
                            value=d["backlog_blocks"])
    lost = CounterMetricFamily(f"kvtier_{tier}_not_written", f"Committed blocks never written to the {tier} tier, "
                               f"by tenant and why ({reasons}).", labels=["tenant", "why"])
    for tenant, whys in d["not_written"].items():
        for why, n in whys.items():
            lost.add_metric([tenant, why], n)
    yield lost


class MetricsServer:
    def __init__(self, httpd, thread):
        self.httpd, self.thread = httpd, thread
        host, port = httpd.server_address[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class OperatorsOnly(ThreadingWSGIServer):
    """Answers a local peer that is not an operator with 403 before reading its request."""
    allow: Callable[[int], bool] = staticmethod(lambda uid: False)
    refused: set

    def verify_request(self, request, client_address) -> bool:
        uid = tcp_peer_uid(client_address, request.getsockname())
        if uid is None or self.allow(uid):
            return True
        if uid not in self.refused:  # once per uid: a scraper retrying must not flood the log
            self.refused.add(uid)
            log.warning("metrics scrape from uid %d refused (not root, the daemon's user or admin_group)", uid)
        try:
            request.sendall(FORBIDDEN)
        except OSError:
            pass
        return False


def serve_metrics(address: str, get_snapshot: Callable[[], dict | None],
                  allow: Callable[[int], bool]) -> MetricsServer:
    """Start the HTTP exposition thread; raises OSError when the port is taken.
    ``allow(uid)``: may a local peer of that uid read them."""
    host, port = metrics_address(address)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    ProcessCollector(registry=registry)  # RSS, CPU, fds: the usual process_* series
    server = type("Server", (OperatorsOnly,), {"allow": staticmethod(allow), "refused": set()})
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server.address_family = info[0]
    httpd = make_server(info[4][0], port, make_wsgi_app(registry), server, handler_class=_SilentHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="kvtier-metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
