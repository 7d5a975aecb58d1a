#!/usr/bin/env python3
# Feeds BENCHMARKS.md sections 1 and 6.
"""Store and load bandwidth through a real kvtier daemon.

For each KV layout, block size and batch size this measures, in one run:
  store     ``client.store(new hashes, ids).wait()`` (the pool is flushed
            between reps, untimed, so every rep really copies)
  load      ``client.load(hashes, ids).wait()`` of blocks stored once
  routine   the daemon's copy routine (``KVLayout.copy``) run in this process
            on the same blocks: the copy cost without IPC or the daemon loop
  copy_     one torch ``copy_`` of the same bytes between touched buffers:
            the memory-bandwidth ceiling of this machine
Layouts: ``mla`` (one tensor, ``(num_blocks, block_bytes / 2)`` fp16: blocks are
contiguous, adjacent blocks merge into one copy) and ``flashinfer`` (one
tensor per layer, ``(num_blocks, 2, 16, heads, head_dim)``: 32 pieces per
block, which shows the per-block and per-tensor overhead).

    python scripts/bench_transfer.py            # full sweep (a few minutes)
    python scripts/bench_transfer.py --quick    # smaller sweep
"""

from __future__ import annotations

import argparse
import itertools
import os

import benchlib as bl
import torch

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.demo.daemon_proc import PrivateDaemon
from kvtier.transfer.layout import KVLayout

TOKENS = 16  # tokens per block in the flashinfer shapes (only the bytes matter)
_salt = itertools.count(1)


def shapes(layout: str, blocks: int, block_bytes: int, layers: int) -> list[tuple]:
    """fp16 tensor shapes whose engine block is ``block_bytes`` in total."""
    if layout == "mla":
        return [(blocks, block_bytes // 2)]
    per_layer = block_bytes // layers // 2          # fp16 elements per layer per block
    hd = per_layer // (2 * TOKENS)                  # heads * head_dim
    if hd < 1 or hd * 2 * TOKENS * layers * 2 != block_bytes:
        raise ValueError(f"{block_bytes} B blocks do not split into {layers} flashinfer layers")
    d = min(hd, 128)
    return [(blocks, 2, TOKENS, hd // d, d)] * layers


def stamp(kv: ShmKVCache, n: int, salt: int) -> None:
    """Write (salt, block, tensor) into the first 8 bytes of every block of every tensor."""
    for j, t in enumerate(kv.tensors):
        rows = t.view(t.shape[0], -1)[:n].view(torch.uint8)[:, :8].view(torch.int64)
        rows.copy_((torch.arange(n) + salt * 1_000_000 + j * 1000).view(n, 1))


def stamps_ok(kv: ShmKVCache, n: int, salt: int) -> bool:
    for j, t in enumerate(kv.tensors):
        rows = t.view(t.shape[0], -1)[:n].view(torch.uint8)[:, :8].view(torch.int64)
        if not torch.equal(rows.view(-1), torch.arange(n) + salt * 1_000_000 + j * 1000):
            return False
    return True


def fresh_hashes(n: int) -> list[bytes]:
    raw = os.urandom(16 * n)
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]


class Point:
    """One (layout, block size, batch) point. Stores go through ``cs`` and
    loads through ``cl``: two clients over the same cache in two namespaces,
    so flushing the store namespace between reps keeps the loaded blocks."""

    def __init__(self, args, cs: Client, cl: Client, kv: ShmKVCache, bufs, layout: str, block: int, n: int):
        self.args, self.cs, self.cl, self.kv, self.bufs = args, cs, cl, kv, bufs
        self.layout, self.block, self.n, self.nbytes = layout, block, n, n * block
        self.ids = list(range(n))

    def run(self) -> dict:
        a = self.args
        hashes = fresh_hashes(self.n)
        self._check_roundtrip(hashes)
        t = bl.round_robin({
            "store": (self._store, lambda: self.cs.flush(self.cs.ns)),
            "load": (lambda: self._expect(self.cl.load(hashes, self.ids).wait(), self.n), None),
            "routine": (self._routine, None),
            "copy": (self._copy, None)}, a.min_time, a.min_reps, a.max_reps)
        self.cs.flush(self.cs.ns)
        self.cl.flush(self.cl.ns)
        row = {"layout": self.layout, "tensors": len(self.kv.tensors), "block_bytes": self.block,
               "batch": self.n, "bytes": self.nbytes}
        for k, times in t.items():  # best rep: the machine is shared and noisy
            row[k + "_gbps"] = bl.gbps(self.nbytes, min(times))
            row[k + "_gbps_median"] = bl.gbps(self.nbytes, bl.median(times))
            row[k + "_reps"] = len(times)
        row["store_vs_copy"] = row["store_gbps"] / row["copy_gbps"]
        row["load_vs_copy"] = row["load_gbps"] / row["copy_gbps"]
        row["store_s"], row["load_s"] = min(t["store"]), min(t["load"])
        return row

    def _store(self) -> None:
        self._expect(self.cs.store(fresh_hashes(self.n), self.ids).wait(), self.n)

    def _check_roundtrip(self, hashes) -> None:
        # Bytes stored must come back: stamp, store, wipe, load, compare.
        salt = next(_salt)
        stamp(self.kv, self.n, salt)
        self._expect(self.cl.store(hashes, self.ids).wait(), self.n)
        stamp(self.kv, self.n, 0)
        self._expect(self.cl.load(hashes, self.ids).wait(), self.n)
        if not stamps_ok(self.kv, self.n, salt):
            raise SystemExit(f"loaded bytes differ from stored bytes ({self.layout}, {self.block}, {self.n})")

    @staticmethod
    def _expect(result, n: int) -> None:
        if not result.ok or result.done != n:
            raise SystemExit(f"transfer failed: {result}")

    def _routine(self) -> None:
        pool, layout = self.bufs["pool"], self.bufs["layout"]
        layout.copy(pool, [(i * self.block, i) for i in range(self.n)], True)

    def _copy(self) -> None:
        self.bufs["dst"][:self.nbytes].copy_(self.bufs["src"][:self.nbytes])


def batches_for(args, block: int) -> list[int]:
    """Requested batch sizes capped at ``max_point_bytes``, duplicates dropped."""
    cap = max(1, args.max_point_bytes // block)
    return sorted({min(b, cap) for b in args.batches})


def connect(socket: str, kv: ShmKVCache, layout: str, block: int, role: str) -> Client:
    c = Client(socket, name=f"bench-transfer-{role}", timeout=60, transfer_timeout=600)
    c.ns = Namespace("bench-transfer", "float16", layout, TOKENS, extra=f"b{block}-{role}")
    c.register_kv_cache(kv, [0] * len(kv.tensors), c.ns)
    return c


def sweep(args, socket: str, bufs) -> list[dict]:
    rows = []
    for layout in args.layouts:
        for block in args.block_sizes:
            batches = batches_for(args, block)
            kv = ShmKVCache(shapes(layout, max(batches), block, args.layers), torch.float16)
            for t in kv.tensors:
                t.fill_(1)  # touch the engine pages once, like a live KV cache
            bufs["layout"] = KVLayout(kv.tensors, [0] * len(kv.tensors))
            cs, cl = (connect(socket, kv, layout, block, role) for role in ("store", "load"))
            try:
                for n in batches:
                    rows.append(Point(args, cs, cl, kv, bufs, layout, block, n).run())
                    if args.progress:
                        r = rows[-1]
                        print(f"  {layout} {bl.short_size(block)} x{n}: store {r['store_gbps']:.2f} "
                              f"load {r['load_gbps']:.2f} copy_ {r['copy_gbps']:.2f} GB/s", flush=True)
            finally:
                cs.close()
                cl.close()
            bufs["layout"] = None
            kv.close()
    return rows


def render(rows: list[dict], args) -> str:
    headers = ["layout", "block", "batch", "bytes", "store GB/s", "load GB/s", "routine GB/s",
               "copy_ GB/s", "store/copy_", "load/copy_", "store ms", "load ms"]
    body = [[r["layout"] + (f" x{r['tensors']}" if r["tensors"] > 1 else ""), bl.short_size(r["block_bytes"]),
             r["batch"], bl.short_size(r["bytes"]), r["store_gbps"], r["load_gbps"], r["routine_gbps"],
             r["copy_gbps"], r["store_vs_copy"], r["load_vs_copy"], r["store_s"] * 1e3, r["load_s"] * 1e3]
            for r in rows]
    return bl.table(headers, body, "Store/load through the daemon vs in-process copies (best of reps)")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sweep and pool, shorter reps")
    p.add_argument("--pool-size", default=None, help="daemon pool (default 4GiB, --quick 1GiB)")
    p.add_argument("--slab-size", default="16MiB")
    p.add_argument("--block-sizes", type=bl.size_list, default=None,
                   help="comma list, default 32KiB,128KiB,512KiB,2MiB,8MiB")
    p.add_argument("--batches", type=bl.int_list, default=None, help="comma list, default 1,4,16,64,256,1024")
    p.add_argument("--layouts", default="mla,flashinfer", type=lambda s: s.split(","))
    p.add_argument("--layers", type=int, default=32, help="tensors in the flashinfer layout")
    p.add_argument("--max-point-bytes", type=bl.parse_size, default=None,
                   help="cap on bytes per point (batch shrinks), default 256MiB, --quick 64MiB")
    p.add_argument("--min-time", type=float, default=None, help="timed seconds per measurement")
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--max-reps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads here and in the daemon")
    p.add_argument("--socket", help="use a running daemon instead of starting one")
    bl.add_json_flag(p)
    p.add_argument("--progress", action="store_true", help="print each point as it finishes")
    a = p.parse_args(argv)
    q = a.quick
    a.pool_size = a.pool_size or ("1GiB" if q else "4GiB")
    a.block_sizes = a.block_sizes or bl.size_list("32KiB,512KiB,8MiB" if q else "32KiB,128KiB,512KiB,2MiB,8MiB")
    a.batches = a.batches or bl.int_list("1,16,256" if q else "1,4,16,64,256,1024")
    a.max_point_bytes = a.max_point_bytes or bl.parse_size("64MiB" if q else "256MiB")
    a.min_time = a.min_time if a.min_time is not None else (0.1 if q else 0.3)
    return a


def main(argv=None) -> int:
    args = parse(argv)
    env = bl.use_threads(args.threads)
    biggest = max(b * n for b in args.block_sizes for n in batches_for(args, b))
    bufs = {"src": torch.ones(biggest, dtype=torch.uint8), "dst": torch.ones(biggest, dtype=torch.uint8),
            "pool": torch.ones(biggest, dtype=torch.uint8)}  # all touched: no first-fault cost
    if args.socket:
        rows = sweep(args, args.socket, bufs)
    else:
        with PrivateDaemon(args.pool_size, args.slab_size, env=env) as d:
            rows = sweep(args, d.socket, bufs)
    report = {"bench": "transfer", "machine": bl.machine_notes(), "pool_size": args.pool_size,
              "slab_size": args.slab_size, "threads": args.threads, "rows": rows}
    bl.emit(report, [render(rows, args)], args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
