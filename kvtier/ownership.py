"""May this path be trusted? One check for every place kvtier opens or serves
something another local user could have planted or could still write: the
socket directory and socket (daemon and client side), the lock file, the kept
pool and journal segments, the disk tier's directory and block files, the
remote tier's secret file, stale segments.

``distrust`` looks at a stat result the caller already has (an ``fstat`` of
the descriptor it opened without following links, or an ``lstat``) and
answers why it may not be trusted, or "" when it may: a failure as a value,
so each caller raises its own typed error (StartupError, UnfitConfig,
SecretError, UntrustedSocket) or skips the file, with its own context in
front of the reason. Nothing here follows a link or opens anything.

This module imports nothing from kvtier: every layer may use it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection

KINDS = {"regular file": stat.S_ISREG, "directory": stat.S_ISDIR, "socket": stat.S_ISSOCK}
GROUP_OTHERS_WRITE = 0o022   # directories and sockets: nobody else may write (swap what is in it)
GROUP_OTHERS_ANY = 0o077     # secrets and block files: nobody else may even read


def ours() -> frozenset[int]:
    """The daemon's own uid: what its private files must belong to."""
    return frozenset((os.geteuid(),))


def ours_or_root() -> frozenset[int]:
    """The daemon's uid or root: for what an operator may have set up for it."""
    return frozenset((os.geteuid(), 0))


def distrust(st: os.stat_result, kind: str, owners: Collection[int], *, deny: int = GROUP_OTHERS_WRITE,
             mode: int | None = None, size: int | None = None) -> str:
    """Why ``st`` may not be trusted ("" = it may).

    kind    "regular file", "directory" or "socket" (a symlink is none of them:
            callers lstat or open with O_NOFOLLOW, so a link fails here)
    owners  the uids it may belong to
    deny    permission bits it must not have (ignored when ``mode`` is given)
    mode    the exact permission bits it must have (a segment made with shm_mode)
    size    the exact size it must have, when known
    """
    if not KINDS[kind](st.st_mode):
        return f"not a {kind}"
    if st.st_uid not in owners:
        return f"belongs to uid {st.st_uid}, not to {_who(owners)}"
    bits = stat.S_IMODE(st.st_mode)
    if mode is not None:
        if bits != mode:
            return f"mode {bits:04o}, expected {mode:04o}"
    elif bits & deny:
        what = "read it" if bits & deny & 0o444 else "write to it" if bits & deny & 0o222 else "run it"
        return f"mode {bits:04o} lets group or others {what}"
    if size is not None and st.st_size != size:
        return f"{st.st_size} bytes, expected {size}"
    return ""


def _who(owners: Collection[int]) -> str:
    uids = sorted(owners)
    me = os.geteuid()
    if uids == [me]:
        return f"the daemon's user (uid {me})"
    return "uid " + " or ".join(str(u) for u in uids)
