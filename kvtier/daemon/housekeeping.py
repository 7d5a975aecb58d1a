"""Operations side of the daemon: supervisor notifications, SIGHUP reload,
the stats snapshot behind Prometheus metrics, transfer latencies, and the
garbage collector's tenure (SIGUSR1 audits it).

Everything here runs on the poll-loop thread except the metrics HTTP server,
which only ever reads ``self.snapshot``: a dict built fresh by ``stats()`` and
replaced whole (one attribute store), never mutated after publication.

Primitives: ``Housekeeping(config, notifier, reloader, stats)``, ``.config``
(the live config, replaced on reload), ``.start_metrics()``, ``.tick()``,
``.request_reload()``, ``.request_gc_audit()``, ``.tenure`` (``tenure.Tenure``), ``.stop()``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from .config import DaemonConfig
from .latency import LatencyHistograms
from .logs import apply_logging
from .notify import Notifier
from .tenure import Tenure

log = logging.getLogger("kvtier.daemon")

# Keys a SIGHUP may change in place: they are read afresh on every use. The
# rest shape the pool, the sockets or the metrics server and need a restart.
RELOADABLE = ("log_level", "log_format", "heartbeat_s", "reap_after_s", "reap_interval_s",
              "swap_quota")
SNAPSHOT_PERIOD_S = 0.5


class Housekeeping:
    def __init__(self, config: DaemonConfig, notifier: Notifier | None,
                 reloader: Callable[[], DaemonConfig] | None, stats: Callable[[], dict]):
        self.config = config
        self.notifier = notifier or Notifier({})
        self.reloader = reloader
        self.stats = stats
        self.latency = LatencyHistograms()
        self.snapshot: dict | None = None   # read by the metrics thread
        self.metrics_server = None
        self._reload_pending = False
        self._audit_pending = False
        self.tenure = Tenure()  # installed by the daemon's process (main.py): the collector is per process
        self._next_snapshot = 0.0

    def start_metrics(self) -> None:
        """Serve Prometheus metrics if configured (before READY: a bad port fails startup)."""
        if not self.config.metrics:
            return
        from .metrics import serve_metrics  # prometheus_client only when metrics are on
        from .operators import is_operator
        self.notifier.status(f"starting metrics on {self.config.metrics}")
        self.snapshot = self.stats()
        self.metrics_server = serve_metrics(self.config.metrics, lambda: self.snapshot, is_operator(self.config))
        log.info("metrics on http://%s/metrics", self.metrics_server.address)

    def notify_ready(self) -> None:
        self.notifier.ready(f"serving on {self.config.socket}")
        log.info("ready: serving on %s (from another terminal: kvtier status)", self.config.socket)

    def tick(self) -> float:
        """Called once per loop turn; returns seconds until it next needs to run."""
        now = time.monotonic()
        if self._reload_pending:
            self._reload_pending = False
            self.reload()
        if self._audit_pending:
            self._audit_pending = False
            self.tenure.audit()  # logs what it found
        due = self.notifier.watchdog_tick(now)
        if self.metrics_server is not None:
            if now >= self._next_snapshot:
                self.snapshot = self.stats()  # one attribute store: readers see old or new
                self._next_snapshot = now + SNAPSHOT_PERIOD_S
            due = min(due, self._next_snapshot - now)
        return max(0.0, due)

    def request_gc_audit(self) -> None:
        """Signal-safe (SIGUSR1): audit the garbage collector's frozen objects at the next turn."""
        self._audit_pending = True

    def stop(self) -> None:
        self.notifier.stopping()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    # ---- SIGHUP -------------------------------------------------------------------
    def request_reload(self) -> None:
        """Signal-safe: the loop applies the reload at its next turn."""
        self._reload_pending = True

    def reload(self) -> None:
        """Re-read config file + environment; apply the reloadable keys, log the rest."""
        self.notifier.reloading()
        try:
            if self.reloader is None:
                raise ValueError("this daemon was started without a config source")
            fresh = self.reloader()
            changed = {k: getattr(fresh, k) for k in RELOADABLE
                       if getattr(fresh, k) != getattr(self.config, k)}
            self.config = dataclasses.replace(self.config, **changed)  # validates the combination
        except ValueError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self.notifier.ready(f"serving on {self.config.socket} (last reload failed)")
            return
        ignored = [f.name for f in dataclasses.fields(DaemonConfig)
                   if f.name not in RELOADABLE and getattr(fresh, f.name) != getattr(self.config, f.name)]
        apply_logging(self.config.log_level, self.config.log_format)
        log.info("reload: changed %s; ignored until restart %s",
                 ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "nothing",
                 ", ".join(ignored) or "nothing")
        self.notifier.ready(f"serving on {self.config.socket}")
