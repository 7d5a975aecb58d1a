"""Engine-side helpers for tests: KV caches with known contents, child processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from typing import Callable, Iterable

import torch

from kvtier.client import Namespace

NS = Namespace("tiny-llama", "float16", "flashinfer", 16)
# 4 layers of FlashInfer layout (num_blocks, 2, block_size, heads, head_dim): 16 KiB per block
SHAPE = (32, 2, 16, 2, 32)
LAYERS = 4


def pool_segments(pid: int) -> list[str]:
    """The daemon ``pid``'s pool segment(s) in /dev/shm: ``kvtier-pool.<pid>.<random>``."""
    import glob
    return glob.glob(f"/dev/shm/kvtier-pool.{pid}.*")


def flip_a_pool_byte(pid: int, block: torch.Tensor) -> None:
    """Bit rot inside daemon ``pid``'s pool: one byte of the stored copy of ``block``
    (found by its first 64 bytes) flipped, as a stray write would."""
    import mmap
    needle = block.numpy().tobytes()[:64]
    fd = os.open(pool_segments(pid)[0], os.O_RDWR)
    try:
        with mmap.mmap(fd, 0) as pool:
            at = pool.find(needle)
            assert at >= 0
            pool[at + 100] ^= 0xFF
    finally:
        os.close(fd)


def make_kv(shape=SHAPE, layers=LAYERS, dtype=torch.float16, seed=None):
    from kvtier.client import ShmKVCache
    kv = ShmKVCache([shape] * layers, dtype)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in kv.tensors:
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(dtype))
    return kv


def ticket_for(socket: str, kv) -> str:
    """Hand ``kv``'s memory to the daemon (as a real client does before REGISTER)."""
    from kvtier.client.handover import hand_over
    return hand_over(socket, kv.fds())


def block_bytes(kv, ids, dim=0):
    """Concatenated bytes of engine blocks ``ids`` across all layers (for equality)."""
    return [t.select(dim, i).clone() for i in ids for t in kv.tensors]


def engine_mid_transfer(socket: str, ready: str, op: str, hashes, ids, seed: int, hang_s: float) -> None:
    """Child engine: start a (slow) ``op`` ("store" or "load") of ``hashes`` into block
    ``ids``, tell the parent through the file ``ready``, then hang until it is killed."""
    from kvtier.client import Client
    kv = make_kv(seed=seed)
    c = Client(socket, name="victim")
    c.register_kv_cache(kv, [0] * 4, NS)
    getattr(c, op)(hashes, ids)
    open(ready, "w").close()
    time.sleep(hang_s)


def spawn(target, *args):
    """Run ``target(*args)`` in a fresh interpreter (spawn: no inherited state)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_wrap, args=(target, q, args))
    p.start()
    return p, q


def _wrap(target, q, args):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        q.put(("ok", target(*args)))
    except BaseException as exc:  # report to the parent, which fails the test
        import traceback
        q.put(("error", traceback.format_exc()))
        raise SystemExit(1) from exc


def until_finished(poll: Callable[[], Iterable], job_ids: set[int], timeout: float = 30.0) -> dict:
    """Call ``poll`` (an engine's finished()/get_finished()) until every job in
    ``job_ids`` reported, as an engine's step loop does: job id -> its result."""
    got, deadline = {}, time.monotonic() + timeout
    while set(got) != job_ids:
        assert time.monotonic() < deadline, f"jobs {job_ids - set(got)} never finished"
        got.update((r.job_id, r) for r in poll())
        time.sleep(0.005)
    return got
