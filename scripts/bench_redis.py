#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 3.
"""kvtier store/load vs Redis pipelined SET/GET of the same blocks, same run.

Redis: Debian's ``redis-server`` on a Unix socket (no persistence), the
``redis`` Python client, one pipeline of N SETs (values are zero-copy
memoryviews of the engine's KV blocks) or N GETs (values copied into the
engine's KV tensor, as an engine must). kvtier: a private daemon,
``store(...).wait()`` / ``load(...).wait()`` of the same N blocks from a
single-tensor (MLA-like) cache. Both sides run the same number of client
processes at once; each reports bytes moved, the aggregate is GB/s.

Stores are real on both sides: kvtier stores new hashes and each client
flushes its own namespace between reps (untimed); Redis overwrites its keys.

redis-py switches to hiredis when the ``hiredis`` package is importable
(here: somewhat faster GETs, slower SETs of large values; see
BENCHMARKS.md); the report says which parser ran.

Needs ``redis-server`` on PATH (apt-get install redis-server) and the
``redis`` module (pip install 'kvtier[bench]'); otherwise it prints why and
exits 0.

    python scripts/bench_redis.py [--quick] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time

import benchlib as bl


def missing(args) -> str | None:
    """Why the comparison cannot run here, or None."""
    if not (args.redis_server and shutil.which(args.redis_server)):
        return f"redis-server not found ({args.redis_server or 'not on PATH'}); apt-get install -y redis-server"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "python module 'redis' missing; pip install 'kvtier[bench]' (or pip install redis)"
    return None


class RedisServer:
    """redis-server on a private Unix socket, no TCP, no persistence."""

    def __init__(self, binary: str):
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- one client process ------------------------------------------------------------------
def _kv(block: int, n: int, fill: int):
    import torch
    from kvtier.client import ShmKVCache
    kv = ShmKVCache([(n, block)], torch.uint8)
    kv.tensors[0].fill_(fill)  # touched, like a live KV cache; content does not matter to either side
    return kv


class KvtierSide:
    """One engine process: ``prep((block, n, op))`` registers a fresh cache, ``go`` runs it."""

    def __init__(self, idx: int, socket: str, threads: int):
        bl.use_threads(threads)
        self.idx, self.socket = idx, socket

    def prep(self, point) -> None:
        from kvtier.client import Client, Namespace
        self.block, self.n, self.op = point
        self.kv = _kv(self.block, self.n, self.idx + 1)
        self.ns = Namespace("bench-redis", "uint8", "mla", 16, extra=f"client{self.idx}-b{self.block}")
        self.ids = list(range(self.n))
        self.c = Client(self.socket, name=f"bench-redis-{self.idx}", timeout=60, transfer_timeout=600)
        self.c.register_kv_cache(self.kv, [0], self.ns)
        self.keys = _hashes(self.n)
        _ok(self.c.store(self.keys, self.ids).wait(), self.n)  # warm up; loads read these
        if self.op == "store":
            self.c.flush(self.ns)
        else:
            _check_roundtrip(self.kv, self.idx + 1, lambda: _ok(self.c.load(self.keys, self.ids).wait(), self.n))

    def go(self, t_end: float):
        if self.op == "store":
            fn = lambda: _ok(self.c.store(_hashes(self.n), self.ids).wait(), self.n)  # noqa: E731
            reps, busy = bl.run_until(t_end, fn, setup=lambda: self.c.flush(self.ns))
        else:
            reps, busy = bl.run_until(t_end, lambda: _ok(self.c.load(self.keys, self.ids).wait(), self.n))
        self.c.flush(self.ns)  # leave the pool empty for the next point
        self.c.close()
        self.kv.close()
        return reps * self.n * self.block, busy


class RedisSide:
    def __init__(self, idx: int, socket: str, threads: int):
        import redis
        bl.use_threads(threads)
        self.idx, self.r = idx, redis.Redis(unix_socket_path=socket)

    def prep(self, point) -> None:
        self.block, self.n, self.op = point
        self.kv = _kv(self.block, self.n, self.idx + 1)
        self.arr = self.kv.tensors[0].numpy()  # shares the KV memory
        self.keys = [f"c{self.idx}:b{self.block}:{i}".encode() for i in range(self.n)]
        self.put()  # warm up; gets read these
        if self.op == "load":
            _check_roundtrip(self.kv, self.idx + 1, self.get)

    def put(self) -> None:
        p = self.r.pipeline(transaction=False)
        for i, k in enumerate(self.keys):
            p.set(k, memoryview(self.arr[i]))  # zero-copy view of the engine block
        p.execute()

    def get(self) -> None:
        import numpy as np
        p = self.r.pipeline(transaction=False)
        for k in self.keys:
            p.get(k)
        for i, v in enumerate(p.execute()):
            self.arr[i] = np.frombuffer(v, dtype=np.uint8)  # into the engine's KV block

    def go(self, t_end: float):
        reps, busy = bl.run_until(t_end, self.put if self.op == "store" else self.get)
        self.r.delete(*self.keys)
        self.kv.close()
        return reps * self.n * self.block, busy


def _check_roundtrip(kv, fill: int, load) -> None:
    """The loaded bytes must be the stored ones: wipe the cache, load, compare."""
    kv.tensors[0].zero_()
    load()
    if not bool((kv.tensors[0] == fill).all()):
        raise RuntimeError("loaded bytes differ from stored bytes")


def _hashes(n: int) -> list[bytes]:
    raw = os.urandom(16 * n)
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]


def _ok(result, n: int) -> None:
    if not result.ok or result.done != n:
        raise RuntimeError(f"kvtier transfer failed: {result}")


# ---- driver ------------------------------------------------------------------------------
def measure_pair(pools: dict, clients: int, point, duration: float, slices: int) -> dict:
    """Aggregate GB/s per side (total bytes over the slowest client's timed
    busy time). The sides alternate in ``slices`` slices so both see the
    same background load on this shared machine."""
    moved = {k: [0, 0.0] for k in pools}
    for _ in range(slices):
        for side, pool in pools.items():
            results = pool.run(clients, point, duration / slices)
            moved[side][0] += sum(b for b, _ in results)
            moved[side][1] += max(s for _, s in results)
    return {side: bl.gbps(b, s) for side, (b, s) in moved.items()}


def sweep(args, kv_socket: str, redis_socket: str) -> list[dict]:
    rows = []
    with bl.WorkerPool(max(args.clients), KvtierSide, kv_socket, args.threads) as kvp, \
            bl.WorkerPool(max(args.clients), RedisSide, redis_socket, args.threads) as rp:
        for clients in args.clients:
            for block in args.block_sizes:
                rows += sweep_block(args, kvp, rp, clients, block)
    return rows


def sweep_block(args, kvp, rp, clients: int, block: int) -> list[dict]:
    rows = []
    n = max(1, min(args.batch, args.max_point_bytes // block))
    for op in ("store", "load"):
        got = measure_pair({"kvtier": kvp, "redis": rp}, clients, (block, n, op), args.duration, args.slices)
        k, r = got["kvtier"], got["redis"]
        rows.append({"clients": clients, "block_bytes": block, "batch": n, "op": op,
                     "kvtier_gbps": k, "redis_gbps": r, "kvtier_vs_redis": k / r})
        if args.progress:
            print(f"  {clients} clients {bl.short_size(block)} x{n} {op}: kvtier {k:.2f} "
                  f"redis {r:.2f} GB/s", flush=True)
    return rows


def render(rows: list[dict], title: str) -> str:
    body = [[r["clients"], bl.short_size(r["block_bytes"]), r["batch"], r["op"], r["kvtier_gbps"],
             r["redis_gbps"], r["kvtier_vs_redis"]] for r in rows]
    return bl.table(["clients", "block", "batch", "op", "kvtier GB/s", "redis GB/s", "kvtier/redis"], body, title)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--block-sizes", type=bl.size_list, default=None, help="default 32KiB,512KiB,2MiB")
    p.add_argument("--batch", type=int, default=64, help="blocks per call / per pipeline")
    p.add_argument("--max-point-bytes", type=bl.parse_size, default=bl.parse_size("64MiB"),
                   help="per client per call; the batch shrinks for big blocks")
    p.add_argument("--clients", type=bl.int_list, default=None, help="process counts, default 1,4")
    p.add_argument("--duration", type=float, default=None, help="seconds per point and side")
    p.add_argument("--slices", type=int, default=None, help="alternations of the two sides per point")
    p.add_argument("--pool-size", default="2GiB")
    p.add_argument("--threads", type=int, default=1, help="torch threads in clients and daemon")
    p.add_argument("--redis-server", default=shutil.which("redis-server"), help="redis-server binary")
    bl.add_json_flag(p)
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    a.block_sizes = a.block_sizes or bl.size_list("32KiB,2MiB" if a.quick else "32KiB,512KiB,2MiB")
    a.clients = a.clients or [1, 4]
    a.duration = a.duration or (0.5 if a.quick else 2.0)
    a.slices = a.slices or (1 if a.quick else 4)
    return a


def main(argv=None) -> int:
    args = parse(argv)
    why = missing(args)
    if why:
        print(f"bench_redis: skipped: {why}")
        return 0
    from kvtier.demo.daemon_proc import PrivateDaemon
    env = bl.use_threads(args.threads)
    redis_server = RedisServer(args.redis_server)
    try:
        with PrivateDaemon(args.pool_size, "16MiB", env=env) as d:
            rows = sweep(args, d.socket, redis_server.socket)
    finally:
        redis_server.stop()
    import redis.utils
    report = {"bench": "redis", "machine": bl.machine_notes(), "threads": args.threads,
              "redis_py": redis.__version__,
              "redis_parser": "hiredis" if redis.utils.HIREDIS_AVAILABLE else "pure-Python",
              "redis_server": subprocess.run([args.redis_server, "--version"], capture_output=True,
                                             text=True).stdout.strip(), "rows": rows}
    title = (f"kvtier store/load vs Redis pipelined SET/GET (aggregate over clients; redis-py "
             f"{report['redis_py']}, {report['redis_parser']} reply parser)")
    bl.emit(report, [render(rows, title)], args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
