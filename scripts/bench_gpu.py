#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 10 and docs/GPU.md (GPU runs only).
"""Store/load throughput of the GPU data path next to plain pinned cudaMemcpyAsync.

For each copy method (dma, kernel, auto) a fresh daemon is started (``--gpu on``,
``KVTIER_GPU_COPY=<method>``) and, once its pool is pinned, this process plays
the engine: it registers CUDA KV tensors, stores ``--blocks`` blocks under fresh
hashes and loads them back into other blocks, timing each call end to end
(request, daemon copy, reply; loads include the event fence). The baseline is
one ``copy_(non_blocking=True)`` of the same number of bytes between a
contiguous CUDA buffer and ``pin_memory`` host memory, in the same run.

Cases:
  2mib        one cross-layer tensor, 2 MiB per block (contiguous blocks)
  llama8b-fa  Llama-3-8B shape, 16-token blocks, 32 per-layer FlashAttention
              tensors (2, num_blocks, 16, 8, 128) fp16: 2 MiB per block in 64
              pieces of 32 KiB
  llama8b-fi  same bytes, FlashInfer layout (num_blocks, 2, 16, 8, 128): the
              per-layer layout, 32 tensors of 64 KiB per block

The pinned-memcpy baseline is measured again right after each case (same
bytes, same process, same run), so every ratio compares neighbours. Pinning:
``cudaHostRegister`` of a shared-memory mapping in the daemon's chunks
(``PinnedPool``), seconds per GiB, next to ``cudaHostAlloc`` (``pin_memory``)
of the same size.

Usage: python scripts/bench_gpu.py [--blocks 256] [--iters 5] [--methods dma,kernel,auto]
       [--pin-gib 4] [--json] [--out results.json]
Needs a CUDA device; exits 2 without one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from kvtier.client import Client, CudaKVCache, Namespace, block_hashes  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, TOKENS = 32, 8, 128, 16


def make_case(name: str, num_blocks: int):
    """(tensors, block_dims) for ``num_blocks`` engine blocks of 2 MiB each."""
    if name == "2mib":
        return [torch.randn(num_blocks, 1 << 20, device="cuda", dtype=torch.float16)], [0]
    if name == "llama8b-fa":
        shape, dim = (2, num_blocks, TOKENS, KV_HEADS, HEAD_DIM), 1
    elif name == "llama8b-fi":
        shape, dim = (num_blocks, 2, TOKENS, KV_HEADS, HEAD_DIM), 0
    else:
        raise ValueError(name)
    return [torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(LAYERS)], [dim] * LAYERS


class Daemon:
    def __init__(self, method: str, pool_size: str, tmp: str):
        self.socket = os.path.join(tmp, f"bench-{method}.sock")
        self.log = open(os.path.join(tmp, f"daemon-{method}.log"), "w")
        # The caller's PYTHONPATH stays: dependencies installed with ``pip --target`` live there.
        path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "KVTIER_GPU_COPY": method}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.daemon", "--socket", self.socket, "--pool-size", pool_size,
             "--slab-size", "64MiB", "--gpu", "on", "--config", "/dev/null"], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"daemon failed to start; see {self.log.name}")
            time.sleep(0.1)
        with Client(self.socket, heartbeat=False) as c:  # wait until the whole pool is pinned
            while (p := c.stats()["pool"])["pinning"]:
                time.sleep(0.2)
            if p["pinned_bytes"] != p["capacity_bytes"]:
                print(f"warning: only {p['pinned_bytes']} of {p['capacity_bytes']} bytes pinned", file=sys.stderr)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def bench_case(socket: str, case: str, blocks: int, iters: int, seed: int) -> dict:
    tensors, dims = make_case(case, 2 * blocks)
    block_bytes = sum(t.select(d, 0).numel() * t.element_size() for t, d in zip(tensors, dims))
    nbytes = blocks * block_bytes
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    ns = Namespace(f"bench-{case}", "float16", case, TOKENS)
    stream = torch.cuda.current_stream()
    store_s, load_s = [], []
    with Client(socket, name=f"bench-{case}", transfer_timeout=600) as c:
        c.register_kv_cache(CudaKVCache(tensors), dims, ns)
        for it in range(iters + 1):  # iteration 0 warms up (and lets auto measure)
            hashes = block_hashes(list(range(seed + it * blocks * TOKENS, seed + (it + 1) * blocks * TOKENS)),
                                  TOKENS)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = c.store(hashes, src, stream=stream).wait()
            t1 = time.perf_counter()
            assert r.done == blocks, r
            h = c.load(hashes, dst, stream=stream)
            assert h.wait_event(stream).ok
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if it == 0:
                for t, d in zip(tensors, dims):  # the bytes really made the round trip
                    assert torch.equal(t.narrow(d, blocks, blocks), t.narrow(d, 0, blocks)), case
            else:
                store_s.append(t1 - t0)
                load_s.append(t2 - t1)
            c.flush(ns)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"block_bytes": block_bytes, "bytes": nbytes,
            "store_gbps": nbytes / med(store_s) / 1e9, "load_gbps": nbytes / med(load_s) / 1e9}


def baseline(nbytes: int, iters: int) -> dict:
    """One pinned cudaMemcpyAsync of ``nbytes`` each way, timed with CUDA events."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        times = []
        for _ in range(iters + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = nbytes / sorted(times[1:])[len(times[1:]) // 2] / 1e9
    return out


def pinning(gib: int, chunk: int = 1 << 30) -> dict:
    """Seconds per GiB to pin a shared mapping the daemon's way, and to allocate pinned memory."""
    import mmap
    from kvtier.transfer.pinning import PinnedPool
    nbytes = gib << 30
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(buf, dtype=torch.uint8)
    pool[::4096] = 0  # prefault, as the daemon does before pinning
    t0 = time.perf_counter()
    pinned = PinnedPool(pool, chunk)
    pinned.start()
    while pinned.pinning:
        time.sleep(0.001)
    register_s = time.perf_counter() - t0
    ok = pinned.complete
    pinned.close()
    del pool
    buf.close()
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    del host
    return {"gib": gib, "chunk_bytes": chunk, "complete": ok, "register_s_per_gib": register_s / gib,
            "pin_memory_alloc_s_per_gib": alloc_s / gib}


def doc_of(args, rows: list, pin: dict | None) -> dict:
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "blocks": args.blocks,
            "iters": args.iters, "pool_size": args.pool_size, "rows": rows, "pinning": pin}


def write(path: str, doc: dict) -> None:
    """Replace ``path`` whole (never a half-written file if the run is killed)."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=2)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=256, help="blocks per store/load call (2 MiB each)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--methods", default="dma,kernel,auto")
    p.add_argument("--cases", default="2mib,llama8b-fa,llama8b-fi")
    p.add_argument("--pool-size", default="4GiB")
    p.add_argument("--pin-gib", type=int, default=4, help="GiB to pin for the pinning-time row (0: skip)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="", help="also write the JSON document to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: needs a CUDA device; nothing measured", file=sys.stderr)
        return 2
    rows, seed = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            d = Daemon(method, args.pool_size, tmp)
            try:
                for case in args.cases.split(","):
                    seed += 10**7
                    r = bench_case(d.socket, case, args.blocks, args.iters, seed)
                    base = baseline(r["bytes"], args.iters)  # same bytes, right after: a neighbour
                    rows.append({"case": case, "method": method, **r, **base,
                                 "store_vs_pinned": r["store_gbps"] / base["d2h_gbps"],
                                 "load_vs_pinned": r["load_gbps"] / base["h2d_gbps"]})
                with Client(d.socket, heartbeat=False) as c:
                    gpu = c.stats()["gpu"]
                rows[-1]["daemon_measured"] = gpu.get("throughput_gbps", {})
            finally:
                d.stop()
            write(args.out, doc_of(args, rows, None))  # a run cut short keeps every finished method
    pin = pinning(args.pin_gib) if args.pin_gib else None
    doc = doc_of(args, rows, pin)
    write(args.out, doc)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"{args.blocks} blocks per call, median of {args.iters}")
    print(f"{'case':<12} {'method':<7} {'block':>8} {'store GB/s':>11} {'load GB/s':>10} "
          f"{'pinned D2H':>11} {'pinned H2D':>11} {'store/pin':>10} {'load/pin':>9}")
    for r in rows:
        print(f"{r['case']:<12} {r['method']:<7} {r['block_bytes'] >> 10:>6}Ki {r['store_gbps']:>11.1f} "
              f"{r['load_gbps']:>10.1f} {r['d2h_gbps']:>11.1f} {r['h2d_gbps']:>11.1f} "
              f"{r['store_vs_pinned']:>9.0%} {r['load_vs_pinned']:>9.0%}")
    if pin:
        print(f"pinning {pin['gib']} GiB in {pin['chunk_bytes'] >> 20} MiB chunks: "
              f"{pin['register_s_per_gib']:.3f} s/GiB (cudaHostRegister); "
              f"pin_memory allocation {pin['pin_memory_alloc_s_per_gib']:.3f} s/GiB")
    for r in rows:
        if r.get("daemon_measured"):
            print(f"daemon copy-only GB/s after {r['method']}: {json.dumps(r['daemon_measured'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
