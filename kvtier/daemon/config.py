"""Daemon configuration: one frozen dataclass, validated in ``__post_init__``.

Precedence: defaults < config file (TOML, ``--config`` or
``/etc/kvtier/kvtier.toml``) < ``KVTIER_*`` environment < command-line flags.
Every key is named in errors so a bad config says what to fix.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import tomllib
from dataclasses import dataclass, field

from ..pool.policy import POLICIES
from ..pool.sizes import parse_size
from ..protocol.endpoints import default_socket
from ..protocol.messages import MAX_MESSAGE_BYTES

DEFAULT_CONFIG_FILE = "/etc/kvtier/kvtier.toml"
SIZE_KEYS = {"pool_size", "slab_size", "max_message", "swap_quota", "inline_copy_bytes", "pin_chunk",
             "copy_chunk_bytes", "remote_budget", "remote_queue", "disk_size"}
MOVED = {  # keys that no longer exist, and where their value belongs now
    "remote_password": "moved to remote_secret_file (password = \"...\"): the config is readable by every "
                       "engine user",
}
MAX_PERIOD_S = 86400.0  # the poll loop turns these into timeouts: inf or 1e300 would crash it
GPU_MODES = ("auto", "on", "off")
PREFAULT_MODES = ("background", "start")
GPU_COPY_METHODS = ("auto", "dma", "kernel")
DISK_WRITERS = ("process", "threads")  # disk/writer.py, or the daemon's own threads


def default_copy_threads() -> int:
    """One copy thread per core this process may run on, at most 4: concurrent
    loads then copy side by side instead of queueing behind one thread (a lone
    load runs on one thread either way; BENCHMARKS.md 19.2). More than 4 was
    not measured; set ``copy_threads`` to try."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class DaemonConfig:
    socket: str = field(default_factory=default_socket)
    tcp: str = ""                   # optional extra endpoint, e.g. tcp://127.0.0.1:7070
    token: str = ""                 # shared secret required at HELLO when set
    pool_size: int = 2 * 2**30
    slab_size: int = 64 * 2**20
    ram_fraction: float = 0.8       # refuse pools above this share of available RAM
    policy: str = "lru"
    max_message: int = MAX_MESSAGE_BYTES
    heartbeat_s: float = 1.0        # clients ping at this period
    reap_after_s: float = 5.0       # silence after which a client is reaped
    reap_interval_s: float = 0.5
    socket_mode: int = 0o660
    shm_mode: int = 0o600
    copy_threads: int = field(default_factory=default_copy_threads)  # min(4, cores)
    inline_copy_bytes: int = 512 * 2**10  # copies up to this size run on the loop thread
    copy_chunk_bytes: int = 16 * 2**20    # a cancelled copy stops within one chunk
    drain_timeout_s: float = 30.0   # SIGTERM: copies still running after this are cancelled
    lookup_index: bool = True       # mirror RAM+disk hashes in shm: clients look up without a round trip
    lookup_index_share: float = 0.0625  # /dev/shm the mirrors may take together, as a share of pool_size
    swap_quota: int | None = None   # swap bytes per registered cache (default and cap); None ("") = no cap, 0 = no swap
    swap_max: float = 0.5           # fraction of the pool usable for swap
    events: str = ""                # PUB endpoint for block events; "" = off
    gpu: str = "auto"               # CUDA data path: auto (if a GPU is visible), on (required), off
    pin_chunk: int = 16 * 2**30     # cudaHostRegister the pool in pieces of this size
    gpu_copy: str = "auto"          # auto (measure, keep the faster), dma, kernel
    log_level: str = "INFO"
    log_format: str = "text"        # "text" or "json" (one JSON object per line)
    metrics: str = ""               # Prometheus HTTP endpoint HOST:PORT; "" = off
    checksums: bool = False         # debug: crc32 per block at store, verified at load
    gc_freeze: bool = True          # freeze what each full garbage collection kept (daemon/tenure.py)
    prefault: str = "background"    # a new pool: serve once its first GiB is in (the rest behind), or "start": all first
    warm_restart: bool = False      # keep the pool and a journal of its blocks for the next daemon
    socket_group: str = ""          # group that may connect (socket chgrp); "" = daemon's
    copy_delay_s: float = 0.0       # fault injection for tests: stall before every copy chunk
    remote: str = ""                # remote tier: redis://HOST:PORT or a seed list; "" = off
    remote_secret_file: str = "/etc/kvtier/remote.secret"  # MAC key and Redis password; 0600, daemon's user
    remote_username: str = ""
    remote_tls_ca: str = ""         # CA bundle for TLS (rediss:// without it uses the system CAs)
    remote_ttl_s: float = 3600.0    # remote values expire this long after their last write
    remote_budget: int = 0          # bytes this node may write per remote_ttl_s; 0 = no cap
    remote_queue: int = 256 * 2**20 # write-behind bytes in flight (capped at pool_size / 4)
    remote_timeout_s: float = 0.5   # per remote round trip; then the lookup/load goes on locally
    disk_path: str = ""             # disk tier: a directory of the daemon's user for blocks beyond RAM; "" = off
    disk_size: int = 0              # bytes the disk tier may fill (required with disk_path); least recently used dropped first
    disk_threads: int = 4           # I/O threads of the disk tier (BENCHMARKS.md, disk tier)
    disk_timeout_s: float = 1.0     # a load waits this long for disk reads, then goes on without them
    disk_writer: str = "process"    # where block files are written: a process of their own, or "threads" (ours)
    tenants: str = ""               # users who share a cache: "team-a:alice,bob,1003; team-b:carol"
    admin_group: str = ""           # group (name or gid) whose members may flush/see every tenant
    max_connections: int = 256      # ZeroMQ connections at once (all users); more are closed
    max_connections_per_user: int = 64
    hello_deadline_s: float = 10.0  # a connection that has not said HELLO by then is closed
    max_namespaces_per_user: int = 64  # per tenant; empty, unregistered namespaces are forgotten
    tenant_share: float = 1.0       # most of the pool one tenant's blocks may hold; 1.0 = no limit
    max_copy_pieces: int = 1 << 20  # separate copies one transfer may cost (~2 us each): blocks x tensors
    max_transfers_per_user: int = 1024  # transfers in flight from one Unix user (all its connections)
    max_pieces_in_flight_per_user: int = 1 << 18  # copy pieces those transfers hold (~200 B of daemon memory each)
    max_mappings_per_user: int = 1024  # memory mappings one user's registrations hold (one per handed-over fd)
    max_mappings: int = 16384       # all users together; with the daemon's own, below vm.max_map_count
    max_handovers_per_user: int = 8  # hand-over connections of one user accepted but not answered yet
    max_queued_frames: int = 64     # frames read from one connection and not yet handled (then it waits)

    def __post_init__(self):
        def bad(key, why):
            raise ValueError(f"config {key}: {why}")

        if not self.socket:
            bad("socket", "must not be empty")
        if self.tcp and not self.tcp.startswith("tcp://"):
            bad("tcp", "must look like tcp://HOST:PORT")
        for key in ("pool_size", "slab_size", "max_message"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                bad(key, "must be a positive size")
        if self.slab_size % 256:
            bad("slab_size", "must be a multiple of 256 bytes")
        if self.pool_size < self.slab_size:
            bad("pool_size", f"must hold at least one slab ({self.slab_size} bytes)")
        if not 0 < self.ram_fraction <= 1:
            bad("ram_fraction", "must be in (0, 1]")
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {sorted(POLICIES)}")
        for key in ("heartbeat_s", "reap_after_s", "reap_interval_s"):
            if not 0 < getattr(self, key) <= MAX_PERIOD_S:
                bad(key, f"must be > 0 and at most {MAX_PERIOD_S:.0f} seconds")
        if self.reap_after_s <= self.heartbeat_s:
            bad("reap_after_s", "must exceed heartbeat_s")
        if not 1 <= self.copy_threads <= 64:
            bad("copy_threads", "must be in [1, 64]")
        if self.swap_quota is not None and (not isinstance(self.swap_quota, int) or self.swap_quota < 0):
            bad("swap_quota", "must be a size >= 0 (0: no swap), or \"\" for no cap")
        if not 0 < self.lookup_index_share <= 0.5:
            bad("lookup_index_share", "must be in (0, 0.5]")
        if not 0 <= self.swap_max <= 1:
            bad("swap_max", "must be in [0, 1]")
        for key in ("socket_mode", "shm_mode"):
            if not 0 <= getattr(self, key) <= 0o777:
                bad(key, "must be a file mode like 0o660")
        if not 4096 <= self.copy_chunk_bytes <= 2**40:
            bad("copy_chunk_bytes", "must be in [4KiB, 1TiB]")
        if not 0 <= self.drain_timeout_s <= 3600:
            bad("drain_timeout_s", "must be in [0, 3600]")
        if not 0 <= self.copy_delay_s <= 60:
            bad("copy_delay_s", "must be in [0, 60]")
        if self.prefault not in PREFAULT_MODES:
            bad("prefault", f"must be one of {', '.join(PREFAULT_MODES)}")
        if self.gpu not in GPU_MODES:
            bad("gpu", f"must be one of {', '.join(GPU_MODES)}")
        if not isinstance(self.pin_chunk, int) or self.pin_chunk <= 0:
            bad("pin_chunk", "must be a positive size")
        if self.gpu_copy not in GPU_COPY_METHODS:
            bad("gpu_copy", f"must be one of {', '.join(GPU_COPY_METHODS)}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            bad("log_level", "must be DEBUG, INFO, WARNING or ERROR")
        if self.log_format not in ("text", "json"):
            bad("log_format", "must be text or json")
        try:
            parse_tenants(self.tenants)
        except ValueError as exc:
            bad("tenants", str(exc))
        if not isinstance(self.tenant_share, (int, float)) or not 0 < self.tenant_share <= 1:
            bad("tenant_share", "must be in (0, 1] (1 = no per-tenant limit)")
        if self.admin_group and admin_gid(self.admin_group) is None:
            bad("admin_group", f"no group {self.admin_group!r}")
        for key, lo, hi in (("max_connections", 1, 1 << 20), ("max_connections_per_user", 1, 1 << 20),
                            ("max_namespaces_per_user", 1, 4096), ("max_copy_pieces", 1, 1 << 30),
                            ("max_transfers_per_user", 1, 1 << 20),
                            ("max_mappings_per_user", 1, 1 << 24), ("max_mappings", 1, 1 << 24),
                            ("max_handovers_per_user", 1, 1024), ("max_queued_frames", 1, 1 << 20),
                            ("max_pieces_in_flight_per_user", 1, 1 << 32)):
            if not isinstance(getattr(self, key), int) or not lo <= getattr(self, key) <= hi:
                bad(key, f"must be an int in [{lo}, {hi}]")
        if self.max_mappings_per_user > self.max_mappings:
            bad("max_mappings_per_user", f"must not exceed max_mappings ({self.max_mappings})")
        if not 0 < self.hello_deadline_s <= MAX_PERIOD_S:
            bad("hello_deadline_s", f"must be > 0 and at most {MAX_PERIOD_S:.0f} seconds")
        if self.metrics and metrics_address(self.metrics) is None:
            bad("metrics", "must look like HOST:PORT, e.g. 127.0.0.1:9464 (\"\" = off)")

        if self.remote:
            from ..remote.settings import parse_url
            try:
                _, user, password = parse_url(self.remote)
            except ValueError as exc:
                bad("remote", str(exc))
            if user or password:
                bad("remote", "credentials in the URL: put them in remote_secret_file (this file is "
                              "readable by every engine user)")
            if not self.remote_secret_file:
                bad("remote_secret_file", "the remote tier needs a secret file (key, and the Redis password "
                                          "if any), readable by the daemon's user only; see README, Across nodes")
        if not 0 < self.remote_ttl_s <= 365 * MAX_PERIOD_S:
            bad("remote_ttl_s", "must be > 0 and at most a year")
        if not 0 < self.remote_timeout_s <= 60:
            bad("remote_timeout_s", "must be in (0, 60]")
        if self.disk_path and (not isinstance(self.disk_size, int) or self.disk_size < 2**20):
            bad("disk_size", "must be a size of at least 1MiB when disk_path is set")
        if not 1 <= self.disk_threads <= 64:
            bad("disk_threads", "must be in [1, 64]")
        if not 0 < self.disk_timeout_s <= 60:
            bad("disk_timeout_s", "must be in (0, 60]")
        if self.disk_writer not in DISK_WRITERS:
            bad("disk_writer", f"must be one of {', '.join(DISK_WRITERS)}")
        for key in ("remote_budget", "remote_queue"):
            if getattr(self, key) < 0:
                bad(key, "must be >= 0")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_tenants(value: str) -> dict[int, str]:
    """``"team-a:alice,bob,1003; team-b:carol"`` -> {uid: tenant name}. Users
    listed nowhere are each their own tenant."""
    out: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in value.split(";"))):
        name, sep, users = part.partition(":")
        name = name.strip()
        if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{part!r}: expected NAME:USER[,USER...] (NAME letters, digits, - and _)")
        if name.startswith("uid") and name[3:].isdigit():
            raise ValueError(f"{name!r}: uid<N> is the name of a user listed nowhere; choose another")
        for user in filter(None, (u.strip() for u in users.split(","))):
            uid = _uid(user)
            if uid in out:
                raise ValueError(f"user {user!r} is in two tenants")
            out[uid] = name
    return out


def _uid(user: str) -> int:
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ValueError(f"no user {user!r}") from None


def admin_gid(group: str) -> int | None:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def metrics_address(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); None if malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    return host.strip("[]"), int(port)


def _coerce(key: str, value, source: str):
    """Convert a raw value from a file/env/flag to the field's type."""
    fields = {f.name: f for f in dataclasses.fields(DaemonConfig)}
    if key in MOVED:
        raise ValueError(f"{source}: config {key}: {MOVED[key]}")
    if key not in fields:
        raise ValueError(f"{source}: unknown config key {key!r}")
    kind = fields[key].type
    try:
        if kind == "int | None" and value in ("", None):
            return None  # unset: "" in a file, as for every key that can be off
        if key in SIZE_KEYS and kind in ("int", "int | None"):
            return parse_size(value)
        if key.endswith("_mode"):
            return int(value, 8) if isinstance(value, str) else int(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: config {key}: {exc}") from None


def load_config(path: str | None = None, env: dict | None = None, flags: dict | None = None) -> DaemonConfig:
    values: dict = {}
    env = os.environ if env is None else env
    # KVTIER_CONFIG names the file for the daemon run by hand, and lets a test
    # suite on a node with an installed service ignore that service's file.
    file = path or env.get("KVTIER_CONFIG") or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    if file:
        try:
            with open(file, "rb") as f:
                raw = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"config file {file}: {exc}") from None
        except RecursionError:  # tomllib recurses per nesting level; at SIGHUP this would kill the loop
            raise ValueError(f"config file {file}: nested too deeply") from None
        for key, value in raw.items():
            if key in MOVED and value in ("", None):
                continue  # an older shipped config's empty default: nothing moves, nothing to refuse
            values[key] = _coerce(key, value, file)
    for key in MOVED:  # a unit's Environment= is no secret either
        if env.get("KVTIER_" + key.upper()):
            _coerce(key, env["KVTIER_" + key.upper()], "KVTIER_" + key.upper())
    for key in (f.name for f in dataclasses.fields(DaemonConfig)):
        name = "KVTIER_" + key.upper()
        if env.get(name):
            values[key] = _coerce(key, env[name], name)
    for key, value in (flags or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, "--" + key.replace("_", "-"))
    return DaemonConfig(**values)
