"""Namespace keys: the index keys a namespace by ``tenant SEP fingerprint``.

The pool owns the format (its per-tenant shares and the disk tier read the
owner out of a key); the daemon's tenancy builds keys with ``ns_key``.
"""

from __future__ import annotations

SEP = "\x1f"  # never in a tenant name (letters, digits, - and _)


def ns_key(tenant: str, fingerprint: str) -> str:
    return f"{tenant}{SEP}{fingerprint}"


def split_key(key: str) -> tuple[str, str]:
    """(tenant, fingerprint); a key without SEP is all tenant."""
    tenant, _, fp = key.partition(SEP)
    return tenant, fp


def owner_of(key: str) -> str:
    """The tenant whose share a namespace's blocks count against ("" without SEP: tests, tools)."""
    tenant, sep, _ = key.partition(SEP)
    return tenant if sep else ""
