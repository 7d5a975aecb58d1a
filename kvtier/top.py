"""``kvtier top``: the daemon's numbers, refreshed, with per-second rates.

Rates come from two consecutive ``stats()`` snapshots, divided by the
daemon's own uptime difference (so a slow terminal does not skew them).
Interactive use redraws the screen with ANSI codes and quits on ``q`` (the
terminal is put in cbreak mode only while stdin is a tty) or Ctrl-C;
``--iterations``/``--json`` make it scriptable: one JSON object per refresh.
"""

from __future__ import annotations

import json
import select
import signal
import sys
import termios
import threading
import time
import tty

from .pool.sizes import format_size

RATE_KEYS = ("requests", "lookups", "hits", "misses", "stored", "loaded", "evicted", "stores", "loads",
             "store_bytes", "load_bytes", "offload_bytes", "restore_bytes", "reaped")
CLEAR = "\x1b[H\x1b[J"


def rates(prev: dict | None, cur: dict) -> dict:
    """Per-second deltas of the totals; empty when there is no earlier snapshot
    of the same daemon (first refresh, or the daemon restarted in between)."""
    if prev is None or prev["pid"] != cur["pid"]:
        return {}
    dt = cur["uptime_s"] - prev["uptime_s"]
    if dt <= 0:
        return {}
    out = {k: (cur["totals"].get(k, 0) - prev["totals"].get(k, 0)) / dt for k in RATE_KEYS}
    out["errors"] = (sum(cur["errors"].values()) - sum(prev["errors"].values())) / dt
    looked = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / looked if looked else 0.0
    out["interval_s"] = dt
    return out


def latency_avg(prev: dict | None, cur: dict) -> dict:
    """Mean transfer latency (seconds) per op kind over the interval."""
    out = {}
    before = (prev or {}).get("latency", {}) if prev and prev["pid"] == cur["pid"] else {}
    for kind, h in cur.get("latency", {}).items():
        p = before.get(kind, {"count": 0, "sum_s": 0.0})
        n = h["count"] - p["count"]
        if n > 0:
            out[kind] = (h["sum_s"] - p["sum_s"]) / n
    return out


def frame_json(prev: dict | None, cur: dict) -> str:
    return json.dumps({"pid": cur["pid"], "uptime_s": cur["uptime_s"], "pool": cur["pool"],
                       "totals": cur["totals"], "clients": len(cur["clients"]),
                       "namespaces": len(cur["namespaces"]), "errors": cur["errors"],
                       "rates": rates(prev, cur), "latency_avg_s": latency_avg(prev, cur)},
                      sort_keys=True)


def render(prev: dict | None, cur: dict, interval: float) -> str:
    p, t, r = cur["pool"], cur["totals"], rates(prev, cur)
    lat = latency_avg(prev, cur)
    used = p["used_bytes"] / p["capacity_bytes"] if p["capacity_bytes"] else 0.0

    def rate(key, size=False):  # "-" until two snapshots exist
        if key not in r:
            return "-"
        return format_size(int(r[key])) + "/s" if size else f"{r[key]:.1f}/s"

    def copies(kind, blocks_key):
        avg = f"  avg {lat[kind] * 1e3:.2f} ms" if kind in lat else ""
        return f"{kind:<8} blocks {rate(blocks_key)}  bytes {rate(kind + '_bytes', True)}{avg}"

    looked = r["hits"] + r["misses"] if r else t["hits"] + t["misses"]
    hit_rate = f"{(r or t)['hit_rate']:.1%}" if looked else "-"
    lines = [
        f"kvtier top  pid {cur['pid']}  up {cur['uptime_s']:.0f}s  every {interval:g}s  (q to quit)",
        f"pool     {format_size(p['capacity_bytes'])}  used {format_size(p['used_bytes'])} ({used:.1%})  "
        f"free {format_size(p['free_bytes'])}  waste {format_size(p['waste_bytes'])}  "
        f"blocks {p['blocks']}  evictions {p['evictions']}",
        f"clients  {len(cur['clients'])}  namespaces {len(cur['namespaces'])}  "
        f"requests {rate('requests')}  errors {rate('errors')}",
        f"lookup   {rate('lookups')}  hit blocks {rate('hits')}  miss blocks {rate('misses')}  "
        f"hit rate {hit_rate}",
        copies("store", "stored"),
        copies("load", "loaded"),
        f"evict    blocks {rate('evicted')}",
        "",
        f"{'NAMESPACE':<40} {'BLOCKS':>8} {'BYTES':>12} {'HITS':>9} {'MISSES':>9} {'STORED':>9}",
    ]
    for n in cur["namespaces"]:
        lines.append(f"{n['fingerprint'][:40]:<40} {n['blocks']:>8} {format_size(n['bytes']):>12} "
                     f"{n['hits']:>9} {n['misses']:>9} {n['stored']:>9}")
    return "\n".join(lines)


def run_top(client, interval: float, iterations: int, as_json: bool, out=None) -> int:
    """Refresh until ``iterations`` frames were shown (0 = forever), q or Ctrl-C."""
    out = out or sys.stdout
    clear = CLEAR if out.isatty() and not as_json else ""
    prev, shown = None, 0
    with _Keys() as keys:
        try:
            while True:
                cur = client.stats()
                text = frame_json(prev, cur) if as_json else clear + render(prev, cur, interval)
                print(text, file=out, flush=True)
                shown += 1
                prev = cur
                if iterations and shown >= iterations:
                    return 0
                if keys.wait_for_q(interval) or keys.interrupted:
                    return 0
        except KeyboardInterrupt:  # SIGINT before _Keys took it over, or outside the main thread
            return 0


class _Keys:
    """cbreak mode on a tty stdin (restored on exit); otherwise just sleeps. Ctrl-C
    (SIGINT) sets ``interrupted`` instead of raising wherever the main thread is: a
    KeyboardInterrupt inside the client's request could leave its connection half
    done and the close that follows waiting (seen: top not exiting in 60 s at load 7)."""

    def __enter__(self):
        self.fd, self.saved, self.interrupted, self._sigint = None, None, False, None
        if threading.current_thread() is threading.main_thread():
            self._sigint = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            if sys.stdin is not None and sys.stdin.isatty():
                self.fd = sys.stdin.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)  # keys arrive unbuffered; Ctrl-C still raises
        except (OSError, ValueError, termios.error):
            self.fd = None
        return self

    def _on_sigint(self, *_) -> None:
        self.interrupted = True

    def wait_for_q(self, timeout: float) -> bool:
        """True on q; returns early (within 0.1 s) once interrupted."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and not self.interrupted:
            if self.fd is None:
                time.sleep(min(left, 0.1))
                continue
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.1))
            if ready and sys.stdin.read(1) in ("q", "Q"):
                return True
        return False

    def __exit__(self, *exc):
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
        if self.fd is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
