"""Who owns what: tenants, admins, and namespace keys.

A namespace belongs to the tenant of the client that created it: its Unix
user, or the sharing group the operator declared for that user (config
``tenants``). The index keys namespaces by ``tenant SEP fingerprint``, so
two tenants that send the same fingerprint get two disjoint namespaces:
lookups, loads, stores and swap of one never see the other's blocks.
Admins (root, the daemon's own user, members of ``admin_group``) may flush
and see every tenant; remote (TCP) sessions are tenant ``remote`` and may
not register memory at all.

Across nodes (the remote tier) a namespace is known by its tenant's name
only when the operator named that tenant in ``tenants``: ``uid<N>`` means
nothing on another node, so an unnamed user's blocks stay on this node.

Primitives: ``identify(peer, config) -> (tenant, admin)``, ``cluster_names(config)``;
the key format itself (``SEP``, ``ns_key``, ``split_key``) is the pool's: kvtier/pool/keys.py.
"""

from __future__ import annotations

import os

from ..pool.keys import split_key
from .config import DaemonConfig, admin_gid, parse_tenants
from .peers import Peer

REMOTE = "remote"


def identify(peer: Peer | None, config: DaemonConfig) -> tuple[str, bool]:
    if peer is None:
        return REMOTE, False
    tenant = parse_tenants(config.tenants).get(peer.uid, f"uid{peer.uid}")
    gid = admin_gid(config.admin_group) if config.admin_group else None
    admin = peer.uid in (0, os.geteuid()) or (gid is not None and gid in peer.groups)
    return tenant, admin


def cluster_names(config: DaemonConfig):
    """For the remote tier: namespace key -> its name across nodes (the key, for a
    tenant the operator named), or None (the tenant is ``uid<N>``: local only)."""
    named = frozenset(parse_tenants(config.tenants).values())

    def name(key: str) -> str | None:
        return key if split_key(key)[0] in named else None
    return name
