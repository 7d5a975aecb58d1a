"""What the daemon checks and builds before it serves: enough RAM, the pool
segment, the lookup mirrors, the CUDA data path. Each returns what it built
or raises StartupError / UnfitConfig; ``Daemon.__init__`` (server.py) calls
them in order and cleans up what was built before a failure."""

from __future__ import annotations

import logging
import os
import platform

import psutil
import torch

from ..pool import checksum
from ..pool.prefault import FIRST
from ..pool.segment import SHM_DIR, SegmentError, ShmSegment, unique_name
from ..pool.shm_index import seqlock_safe
from ..pool.sizes import format_size
from .config import DaemonConfig
from .listen import StartupError, UnfitConfig
from .lookup_index import LookupIndexes

log = logging.getLogger("kvtier.daemon")
POOL_PREFIX = "kvtier-pool."


def check_ram(config: DaemonConfig, kept: int = 0) -> None:
    avail = psutil.virtual_memory().available + kept  # a kept pool's pages are ours already
    limit = int(avail * config.ram_fraction)
    # The lookup mirrors live in /dev/shm next to the pool: their budget counts too.
    need = config.pool_size + (int(config.pool_size * config.lookup_index_share) if config.lookup_index else 0)
    if need > limit:
        raise UnfitConfig(
            f"pool size {format_size(config.pool_size)} (with lookup mirrors {format_size(need)}) exceeds "
            f"{config.ram_fraction:.0%} of available RAM ({format_size(avail)}); lower pool_size or "
            "raise ram_fraction")


def new_pool(config: DaemonConfig) -> ShmSegment:
    """The pool (``prefault = background``: its first GiB in, the rest faulting in behind:
    ``segment.background``) under a name nobody can guess (a pid-derived one was squatted by another
    user planting a file there first), created exclusively: a name that is somehow taken
    is logged and another drawn, never opened and never a failed start."""
    # A pool kept for the next daemon (warm_restart) is faulted in whole first: the next one
    # adopts blocks anywhere in it and copies without faulting.
    background = config.prefault == "background" and not config.warm_restart
    for _ in range(3):
        name = unique_name(POOL_PREFIX)
        try:
            return ShmSegment(name, config.pool_size, create=True, mode=config.shm_mode,
                              serve_after=max(FIRST, config.slab_size) if background else None)
        except SegmentError as exc:
            if not os.path.lexists(SHM_DIR + name):
                raise  # no room: the caller reports it
            log.warning("pool name %s is taken (%s): drawing another", name, exc)
    raise StartupError("three random pool names were all taken in /dev/shm")


def check_checksum() -> None:
    """Blocks' checksums run on the CPU's CRC-32C instruction; without it (or with
    CRC32C_SW_MODE=force) the same values come from a table-driven loop, slower per byte
    than the copies they guard: every disk write, disk read and warm-restart commit pays it."""
    if checksum.IMPLEMENTATION != "crc32c-hardware":
        log.warning("this CPU has no CRC-32C instruction the crc32c package can use (or "
                    "CRC32C_SW_MODE=force): blocks' checksums run in software, slower on every "
                    "disk write, disk read and warm-restart commit")


def start_lookup_indexes(config: DaemonConfig) -> LookupIndexes | None:
    if not config.lookup_index:
        return None
    if not seqlock_safe():
        log.info("lookup_index is on but this CPU (%s) lacks x86 memory ordering, which the "
                 "mirror's readers need: lookups go over the socket", platform.machine())
        return None
    # A table is sized for the blocks both tiers can hold (within the budget, which the pool sets).
    held = config.pool_size + (config.disk_size if config.disk_path else 0)
    # The remote tier is not mirrored: a lookup the tables cannot answer whole asks the daemon.
    return LookupIndexes(held, int(config.pool_size * config.lookup_index_share), ask_on_miss=bool(config.remote))


def start_gpu(pool: torch.Tensor, config: DaemonConfig):
    """The CUDA data path (pins the pool in the background), or None. CUDA code is
    imported only when a device is visible and gpu != off. With gpu = on, a missing or
    broken device raises StartupError; with auto the CPU tier runs without it."""
    if config.gpu == "off":
        return None
    if not torch.cuda.is_available():
        if config.gpu == "on":
            raise StartupError("gpu = on but no CUDA device is visible")
        return None
    from ..transfer.gpu import GpuContext
    slab = config.slab_size  # chunks of whole slabs: no block straddles two registrations
    chunk = max(slab, config.pin_chunk // slab * slab)
    try:
        ctx = GpuContext(pool, chunk, config.gpu_copy)
    except Exception as exc:  # a broken driver must not take the CPU tier down with it
        if config.gpu == "on":
            raise StartupError(f"gpu = on but CUDA failed to start: {exc}") from None
        log.error("CUDA data path disabled: %s", exc)
        return None
    log.info("CUDA data path on %d device(s); pinning the pool in %s chunks", len(ctx.uuids), format_size(chunk))
    return ctx
