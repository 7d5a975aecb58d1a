"""Where the daemon listens. Shared by daemon, client and CLI (no I/O)."""

from __future__ import annotations

import os

ENV_SOCKET = "KVTIER_SOCKET"


def default_socket() -> str:
    """``$KVTIER_SOCKET``, else ``/run/kvtier/kvtier.sock`` when that directory
    exists (systemd RuntimeDirectory), else ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``,
    else ``~/.kvtier/kvtier.sock``. Never a directory under world-writable
    /tmp: whoever creates it first would own the daemon's socket."""
    if os.environ.get(ENV_SOCKET):
        return os.environ[ENV_SOCKET]
    if os.path.isdir("/run/kvtier"):
        return "/run/kvtier/kvtier.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "kvtier", "kvtier.sock")
    return os.path.join(os.path.expanduser("~"), ".kvtier", "kvtier.sock")


def endpoint(socket: str) -> str:
    """ZeroMQ endpoint for a socket path or an explicit ``tcp://``/``ipc://`` URL."""
    if socket.startswith(("tcp://", "ipc://")):
        return socket
    return "ipc://" + socket
