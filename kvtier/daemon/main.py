"""``kvtier-daemon``: parse flags, load config, run the loop until SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import load_config
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
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    return p


FLAG_KEYS = ("socket", "pool_size", "slab_size", "ram_fraction", "policy", "tcp", "events", "log_level", "gpu")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config, flags={k: getattr(args, k) for k in FLAG_KEYS})
    except ValueError as exc:
        print(f"kvtier-daemon: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config.as_dict(), indent=2))
        return 0
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        daemon = Daemon(config)
    except StartupError as exc:
        logging.getLogger("kvtier.daemon").error("cannot start: %s", exc)
        return 1
    daemon.install_signals()
    daemon.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
