#!/usr/bin/env python
# Feeds BENCHMARKS.md section 5.
"""Offload/restore GB/s through a real daemon vs a plain in-process copy_.

    python scripts/bench_swap.py [--block 2MiB] [--blocks 256] [--requests 8] [--reps 5]

The engine cache is one MLA-like tensor (num_blocks, block_bytes) in shared
memory. The baseline copies the same bytes between two touched buffers with
torch ``copy_`` in this process, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvtier.client import Client, ShmKVCache  # noqa: E402
from kvtier.pool.sizes import format_size, parse_size  # noqa: E402

import benchlib as bl  # noqa: E402


def baseline(nbytes: int, reps: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # touch both
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", default="2MiB")
    ap.add_argument("--blocks", type=int, default=256, help="engine blocks offloaded per rep")
    ap.add_argument("--requests", type=int, default=8, help="requests per offload call")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    block = parse_size(args.block)
    nbytes = block * args.blocks
    slab = max(block, 16 << 20)
    pool = -(-(nbytes + slab) // slab) * slab
    with tempfile.TemporaryDirectory() as tmp:
        proc = bl.start_daemon(os.path.join(tmp, "k.sock"), str(pool), env={**os.environ, "KVTIER_SWAP_MAX": "1.0"},
                               extra=("--slab-size", str(slab), "--log-level", "WARNING"))
        try:
            kv = ShmKVCache([(args.blocks * 2, block)], torch.uint8)
            kv.tensors[0].random_(0, 255)
            c = Client(os.path.join(tmp, "k.sock"), timeout=30, transfer_timeout=600)
            c.register_kv_cache(kv, [0], "bench|uint8|mla|bs1|tp0of1")
            per = args.blocks // args.requests
            ids = {f"r{i}": list(range(i * per, (i + 1) * per)) for i in range(args.requests)}
            off_t, rst_t = [], []
            for rep in range(args.reps + 1):
                t = time.perf_counter()
                r = c.offload(ids).wait()
                t_off = time.perf_counter() - t
                assert r.ok, r
                t = time.perf_counter()
                for i, (rid, src) in enumerate(ids.items()):
                    h = c.restore(rid, [args.blocks + b for b in src])
                    assert h.wait().ok
                t_rst = time.perf_counter() - t
                if rep:  # rep 0 warms the pool pages and the code paths
                    off_t.append(t_off)
                    rst_t.append(t_rst)
            same = torch.equal(kv.tensors[0][:args.blocks], kv.tensors[0][args.blocks:])
            c.close()
            kv.close()
        finally:
            proc.terminate()
            proc.wait()
    base = baseline(nbytes, args.reps)
    off = nbytes / statistics.median(off_t) / 1e9
    rst = nbytes / statistics.median(rst_t) / 1e9
    print(f"block {format_size(block)}, {args.blocks} blocks ({format_size(nbytes)}) per rep, "
          f"{args.requests} requests per offload, median of {args.reps} reps")
    print(f"{'path':<28}{'GB/s':>8}{'vs copy_':>10}")
    print(f"{'plain torch copy_':<28}{base:>8.2f}{1.0:>10.2f}")
    print(f"{'offload (one call)':<28}{off:>8.2f}{off / base:>10.2f}")
    print(f"{'restore (one call/request)':<28}{rst:>8.2f}{rst / base:>10.2f}")
    print(f"restored bytes identical: {same}")


if __name__ == "__main__":
    main()
