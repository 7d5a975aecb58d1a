"""Remote tier settings: where the store is and how long/much it may hold.

``url`` is ``redis://HOST:PORT`` (``rediss://`` for TLS), optionally with
``USER:PASSWORD@`` (the daemon's config refuses that: credentials belong in
``remote_secret_file``), and optionally a comma-separated seed list
``redis://h1:p1,h2:p2,h3:p3`` (any reachable seed finds the whole cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote

SCHEMES = ("redis://", "rediss://")


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    secret: bytes = field(default=b"", repr=False)  # keys and authenticates values (values.py)
    password: str = field(default="", repr=False)
    username: str = ""
    tls_ca: str = ""               # CA bundle; implies TLS
    ttl_s: float = 3600.0          # every value expires this long after its last write
    budget: int = 0                # bytes this node may write per ttl_s window; 0 = no cap
    queue_bytes: int = 256 * 2**20 # write-behind bytes in flight (held in the pool meanwhile)
    timeout_s: float = 0.5         # per Redis round trip (connect, pipeline read)
    batch_bytes: int = 16 * 2**20  # one pipeline carries at most this many value bytes
    max_probes: int = 64           # lookups waiting on the remote tier; more answer locally
    max_probes_per_tenant: int = 16  # of those, one tenant's: a flood leaves 48 for the others

    @property
    def seeds(self) -> list[tuple[str, int]]:
        return parse_url(self.url)[0]

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://") or bool(self.tls_ca)

    @property
    def credentials(self) -> tuple[str, str]:
        """(username, password): explicit settings win over the URL's."""
        _, user, password = parse_url(self.url)
        return self.username or user, self.password or password

    @property
    def display(self) -> str:
        """The URL without credentials, for logs and status."""
        scheme = "rediss://" if self.tls else "redis://"
        return scheme + ",".join(f"{h}:{p}" for h, p in self.seeds)


def parse_url(url: str) -> tuple[list[tuple[str, int]], str, str]:
    """``redis://[user:pass@]h:p[,h:p...]`` -> (seeds, user, password); ValueError says why."""
    scheme = next((s for s in SCHEMES if url.startswith(s)), None)
    if scheme is None:
        raise ValueError("must start with redis:// or rediss://")
    rest = url[len(scheme):].rstrip("/")
    user = password = ""
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = cred.partition(":") if ":" in cred else ("", "", cred)
        user, password = unquote(user), unquote(password)
    seeds = []
    for item in rest.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"seed {item!r} must look like HOST:PORT")
        seeds.append((host, int(port)))
    return seeds, user, password
