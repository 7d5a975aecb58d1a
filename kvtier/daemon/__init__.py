"""The kvtier daemon: config, server loop, handlers, stats."""

from .config import DaemonConfig, load_config
from .server import Daemon, StartupError

__all__ = ["Daemon", "DaemonConfig", "StartupError", "load_config"]
