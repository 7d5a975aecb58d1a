"""``kvtier-daemon``: parse flags, load config, run the loop until SIGTERM.

Exit codes: 0 clean stop, 1 cannot start (socket taken, metrics port, shared
memory), 2 a configuration that cannot work (invalid value - the message names
the key - or a pool larger than RAM allows); systemd does not restart on 2. SIGHUP re-reads the config file
and environment and applies the keys that are safe to change live.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys

import torch

from ..console import print_or_pipe_closed
from .config import load_config
from .logs import setup_logging
from .notify import Notifier
from .server import Daemon, StartupError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvtier-daemon", description="Node-local KV-cache tier daemon.")
    p.add_argument("--config", help="TOML config file (default /etc/kvtier/kvtier.toml if present)")
    p.add_argument("--socket", help="Unix socket path or tcp:// endpoint (env KVTIER_SOCKET)")
    p.add_argument("--pool-size", dest="pool_size", help="pool size: bytes, 512MiB, 2GiB")
    p.add_argument("--slab-size", dest="slab_size", help="slab size (largest block size)")
    p.add_argument("--ram-fraction", dest="ram_fraction", type=float,
                   help="refuse pools above this fraction of available RAM (0.8)")
    p.add_argument("--policy", help="eviction policy: lru or fifo")
    p.add_argument("--tcp", help="also listen on tcp://HOST:PORT")
    p.add_argument("--events", help="publish block events on this endpoint (ipc path or tcp://)")
    p.add_argument("--gpu", choices=("auto", "on", "off"),
                   help="CUDA data path: auto (when a GPU is visible), on (fail without one), off")
    p.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", dest="log_format", help="text or json (one object per line)")
    p.add_argument("--metrics", help='serve Prometheus metrics on HOST:PORT ("" = off)')
    p.add_argument("--remote", help='remote tier: redis://HOST:PORT or redis://H1:P1,H2:P2 ("" = off)')
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    return p


FLAG_KEYS = ("socket", "pool_size", "slab_size", "ram_fraction", "policy", "tcp", "events", "log_level",
             "log_format", "metrics", "gpu", "remote")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The parser is garbage now, in cycles (its actions and groups point at each other), and so
    # is what imports left (crc32c's import asks importlib.metadata for its version: 10 objects
    # in cycles, by now in the oldest generation). The gc.freeze() below would keep them for
    # good (the audit's leak), so a full pass here, before the pool or an adopted index exists:
    # ~100 ms over the modules' ~174k objects, once (a young pass freed the parser only).
    gc.collect()
    flags = {k: getattr(args, k) for k in FLAG_KEYS}
    try:
        config = load_config(args.config, flags=flags)
    except ValueError as exc:
        print(f"kvtier-daemon: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        return print_or_pipe_closed(json.dumps(config.as_dict(), indent=2))
    setup_logging(config.log_level, config.log_format)
    # One OpenMP thread per copy: the copy threads (copy_threads) are the daemon's parallelism.
    # A store's gather (torch.index_select) otherwise splits over one OpenMP thread per core and
    # waits for the slowest: with CPU engines keeping the cores busy, one descheduled thread held
    # every store (BENCHMARKS.md 13.4). Loads (numpy) never used more than their copy thread.
    torch.set_num_threads(1)
    notifier = Notifier()
    try:
        # SIGHUP re-reads file and environment; the original flags still win.
        daemon = Daemon(config, notifier, reloader=lambda: load_config(args.config, flags=flags))
    except StartupError as exc:
        logging.getLogger("kvtier.daemon").error("cannot start: %s", exc)
        notifier.status(f"cannot start: {exc}")
        return exc.exit_code
    # What exists now lives as long as the daemon: torch's and the other modules' ~170k objects
    # and, after a warm restart, the adopted index. Frozen, CPython's full collections stop
    # walking them: a full pass over a started daemon's objects took 1.02 s (load 10) before,
    # 0 after. No collection first: what start-up left as garbage is bounded and freed never.
    gc.freeze()
    if daemon.config.gc_freeze:  # and what each full collection finds alive from now on (tenure.py)
        daemon.housekeeping.tenure.install()
    daemon.install_signals()
    signal.signal(signal.SIGHUP, daemon.request_reload)
    daemon.serve_forever(ready=daemon.notify_ready)
    # The daemon has released everything it holds (its shutdown joined its threads, closed
    # its sockets, kept or unlinked its segments). What normal interpreter exit would add
    # is a final garbage collection over torch's object graph: 1-8 s on a busy node, during
    # which a systemd restart or a test waiting for the exit is held. Skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
