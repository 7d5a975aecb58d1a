"""The remote tier's secret file (``remote_secret_file``): what only the
daemon's account may read.

kvtier.toml is readable by group ``kvtier``, which every engine account
joins, so nothing that lets a holder reach the store or write values other
nodes accept may live there. The secret file holds both:

    key = "64+ hex digits"    # 32+ random bytes, the same on every node
    password = "..."          # Redis AUTH / ACL password (optional)
    username = "..."          # ACL user (optional)

It must be a regular file owned by the daemon's user (or root) with no
group or other permission bits (0600 or 0400); otherwise the remote tier
refuses to start and says which rule the file broke.

Primitives: ``load_secret(path) -> RemoteSecret`` (raises ``SecretError``).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass

from ..ownership import GROUP_OTHERS_ANY, distrust, ours_or_root
from .values import MIN_SECRET_BYTES

MAX_FILE_BYTES = 64 * 1024


class SecretError(ValueError):
    """The secret file is missing, exposed or malformed; the message says which and how to fix it."""


@dataclass(frozen=True, repr=False)
class RemoteSecret:
    key: bytes
    password: str = ""
    username: str = ""

    def __repr__(self) -> str:  # never in a log or a traceback
        return "RemoteSecret(...)"


def load_secret(path: str) -> RemoteSecret:
    fix = f"(chown the daemon's user {path} && chmod 0600 {path})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise SecretError(f"remote_secret_file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        why = distrust(st, "regular file", ours_or_root(), deny=GROUP_OTHERS_ANY)
        if why:
            raise SecretError(f"remote_secret_file {path}: {why}; the remote tier stays off until only "
                              f"the daemon's user can read it {fix}")
        if st.st_size > MAX_FILE_BYTES:
            raise SecretError(f"remote_secret_file {path}: larger than {MAX_FILE_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        doc = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise SecretError(f"remote_secret_file {path}: not TOML ({exc})") from None
    unknown = set(doc) - {"key", "password", "username"}
    if unknown:
        raise SecretError(f"remote_secret_file {path}: unknown keys {sorted(unknown)}")
    try:
        key = bytes.fromhex(str(doc.get("key", "")))
    except ValueError:
        raise SecretError(f"remote_secret_file {path}: key must be hex digits") from None
    if len(key) < MIN_SECRET_BYTES:
        raise SecretError(f"remote_secret_file {path}: key must be at least {2 * MIN_SECRET_BYTES} hex digits "
                          f"({MIN_SECRET_BYTES} random bytes; make one with: openssl rand -hex 32)")
    for field in ("password", "username"):
        if not isinstance(doc.get(field, ""), str):
            raise SecretError(f"remote_secret_file {path}: {field} must be a string")
    return RemoteSecret(key, doc.get("password", ""), doc.get("username", ""))

