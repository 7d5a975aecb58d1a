"""Starting the disk tier: check ``disk_path`` is the daemon's own, then compose.

A disk_path is refused (the daemon does not start) when it is not a
directory, is a symlink, belongs to another user, or when another user
could write it or replace it (it or a parent directory is writable by
others without the sticky bit, or a parent belongs to a user other than
root and the daemon's). A directory that does not exist is created 0700.
The block files themselves are 0600 and read only when owned by the
daemon's user (``io.check_file``).

Primitives: ``check_dir(path) -> str`` (the absolute path; ValueError says why),
``open_disk(config, pool, index, crcs, journal, pool_name) -> DiskBridge | None`` (attached below ``index``).
"""

from __future__ import annotations

import logging
import os
import stat

from ..ownership import distrust, ours, ours_or_root
from ..pool.sizes import format_size
from .bridge import DiskBridge
from .format import TMP_DIR
from .index import DiskIndex
from .io import DiskIO

log = logging.getLogger("kvtier.disk")
QUEUE_BYTES = 256 * 2**20  # write-behind held in the pool at most (and a quarter of the pool)
# Committed blocks beyond it wait in per-tenant backlogs naming at most the pool's size of blocks.


def check_dir(path: str) -> str:
    root = os.path.abspath(path)
    if not os.path.lexists(root):
        try:
            os.mkdir(root, 0o700)
        except OSError as exc:
            raise ValueError(f"disk_path {root}: cannot create it: {exc}") from None
    why = distrust(os.lstat(root), "directory", ours())
    if why:  # an lstat: a symlink is refused too
        raise ValueError(f"disk_path {root}: {why} (chown it to the daemon's user, chmod 700 it)")
    parent = os.path.dirname(root)
    while True:
        pst = os.stat(parent)
        if pst.st_mode & 0o002 and not pst.st_mode & stat.S_ISVTX:
            raise ValueError(f"disk_path {root}: parent {parent} is writable by every user (no sticky bit): "
                             "another user could replace the directory")
        why = distrust(pst, "directory", ours_or_root(), deny=0)  # a sticky /tmp is fine (above)
        if why:
            raise ValueError(f"disk_path {root}: parent {parent}: {why}, who could replace the directory")
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    tmp = os.path.join(root, TMP_DIR)
    if not os.path.lexists(tmp):
        os.mkdir(tmp, 0o700)
    why = distrust(os.lstat(tmp), "directory", ours(), deny=0)
    if why:
        raise ValueError(f"disk_path {root}: {tmp} is not the daemon's directory ({why})")
    return root


def open_disk(config, pool, index, crcs: dict | None, journal=None, pool_name: str | None = None) -> DiskBridge | None:
    """The disk tier under ``index`` (attached as its lower tier), or None when ``disk_path`` is off.
    ``journal``: warm restart's, which records blocks read back like stores. ``pool_name``: the
    pool's shared memory, for the writer process (``disk_writer = "process"``; writer.py)."""
    if not config.disk_path:
        return None
    root = check_dir(config.disk_path)
    writer_pool = pool_name if config.disk_writer == "process" else None  # None: the daemon's threads write
    io = DiskIO(root, pool, config.disk_threads, pool_name=writer_pool)
    dindex = DiskIndex(config.disk_size, config.tenant_share, config.policy)  # its order follows the pool's
    bridge = DiskBridge(io, dindex, index, config.disk_timeout_s,
                        min(QUEUE_BYTES, config.pool_size // 4), crcs, backlog_bytes=config.pool_size, journal=journal)
    index.attach_lower(bridge)  # the one late link: the bridge is built over the index it extends
    log.info("disk tier %s: %s, %d read threads, writes %s, loads wait at most %.2fs; scanning its files",
             root, format_size(config.disk_size), config.disk_threads,
             "in a writer process (starting)" if writer_pool else "on the daemon's threads", config.disk_timeout_s)
    return bridge
