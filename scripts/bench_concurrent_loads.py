#!/usr/bin/env python3
"""Concurrent loads of one prefix through a real daemon, per ``copy_threads`` (BENCHMARKS.md 19.2).

Issue 36's target: four (eight) engines asking for the same prefix at once
should each see a load within 1.5x of a lone load's time, by default. One
daemon per ``--threads`` value runs side by side; ``--clients`` (default 8)
processes each register their own KV cache in a sealed memfd with every
daemon, as CPU engines do. One process stores the prefix (``--blocks``
blocks of ``--block`` bytes, random bytes) into every daemon first. Then per
round, for each daemon in turn (the order rotates every round) and each N in
``--n``: N processes meet at a barrier and load the whole prefix into their
cache at once. Reported per (copy_threads, N): each load's round trip as its
client saw it (p50, max; a ping's round trip is printed for scale), the
daemon's own mean time per load (its latency histogram's sum over the batch:
accepted to copied, queueing included), and both as ratios to the lone load
(N = 1) of the same daemon in the same run. Every loaded cache is compared
byte for byte with what was stored.

``--fair BIG``: fairness instead. One client loads BIG bytes (e.g. 1GiB) while
another, at a barrier just after the first sent its request, loads the small
prefix; reported: the small load's time alone and next to the big one, the
big one's time, and how often the small one finished first.

    python scripts/bench_concurrent_loads.py [--threads 1,2,4] [--n 1,2,4,8] [--rounds 5]
        [--block 64KiB] [--blocks 128] [--fair 1GiB]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

from benchlib import int_list, no_system_config, parse_size, short_size, table

LAYERS = 8  # the block spread over 8 per-layer tensors, FlashInfer layout, like a small model


def shapes(blocks: int, block: int) -> list[tuple]:
    per_layer = block // LAYERS  # (blocks, 2, 16 tokens, heads, 64) float16
    heads = per_layer // (2 * 16 * 64 * 2)
    assert heads * 2 * 16 * 64 * 2 * LAYERS == block, "block must be a multiple of 32 KiB"
    return [(blocks, 2, 16, heads, 64)] * LAYERS


def keys_of(count: int, tag: int = 0) -> list[bytes]:
    return [(tag << 32 | i).to_bytes(16, "little") for i in range(count)]


def engine(i: int, sockets: list[str], blocks: int, block: int, barriers: dict, conn) -> None:
    """Client process ``i``: one cache, one registration per daemon; loads on command."""
    import torch

    from kvtier.client import Client, Namespace, ShmKVCache

    ns = Namespace("bench-concurrent", "float16", "flashinfer", 16)
    kv = ShmKVCache(shapes(blocks, block), torch.float16)
    clients = [Client(s, name=f"engine-{i}") for s in sockets]
    for c in clients:
        c.register_kv_cache(kv, [0] * LAYERS, ns)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        daemon, n, count, tag, first = cmd  # first: this process sends its load before the barrier
        for t in kv.tensors:
            t.zero_()
        c, keys = clients[daemon], keys_of(count, tag)
        if first:
            t0 = time.perf_counter()
            handle = c.load(keys, range(count))
            barriers[n].wait()
        else:
            barriers[n].wait()
            t0 = time.perf_counter()
            handle = c.load(keys, range(count))
        result = handle.wait()
        dt, end = time.perf_counter() - t0, time.monotonic()
        t1 = time.perf_counter()
        c.ping()
        ping = time.perf_counter() - t1
        conn.send((dt, ping, result.ok, end, digest(kv, count)))  # the caches were zeroed before
    for c in clients:
        c.close()
    kv.close()


def digest(kv, count: int) -> int:
    """crc32 over the first ``count`` blocks of every tensor: equal digests, equal bytes (for this check)."""
    import zlib

    import torch
    crc = 0
    for t in kv.tensors:
        crc = zlib.crc32(t[:count].contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


def seed(sockets: list[str], blocks: int, block: int, tag: int) -> int:
    """Store ``blocks`` random blocks under ``tag`` in every daemon; their digest."""
    import torch

    from kvtier.client import Client, Namespace, ShmKVCache
    ns = Namespace("bench-concurrent", "float16", "flashinfer", 16)
    kv = ShmKVCache(shapes(blocks, block), torch.float16)
    g = torch.Generator().manual_seed(tag)
    for t in kv.tensors:
        t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float32).add_(0.5).to(t.dtype))  # no zeros
    want = digest(kv, blocks)
    for s in sockets:
        with Client(s, name="seed") as c:
            c.register_kv_cache(kv, [0] * LAYERS, ns)
            step = 4096  # per store: one message stays well under max_message
            for lo in range(0, blocks, step):
                hi = min(blocks, lo + step)
                assert c.store(keys_of(blocks, tag)[lo:hi], range(lo, hi)).wait(600).ok
    kv.close()
    return want


def daemon_load_stats(sock: str) -> tuple[int, float]:
    from kvtier.client import Client
    with Client(sock, name="stats") as c:
        lat = c.stats().get("latency", {}).get("load", {"count": 0, "sum_s": 0.0})
    return lat["count"], lat["sum_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int_list, default=[1, 2, 4], help="copy_threads of each daemon")
    p.add_argument("--n", type=int_list, default=[1, 2, 4, 8], help="loads at once")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=parse_size, default=64 << 10)
    p.add_argument("--blocks", type=int, default=128)
    p.add_argument("--fair", type=parse_size, default=0, metavar="BIG", help="fairness run with a BIG load")
    args = p.parse_args()
    from kvtier.demo.daemon_proc import PrivateDaemon

    prefix = args.blocks * args.block
    big_blocks = args.fair // args.block
    clients = 2 if args.fair else max(args.n)
    pool = 2 * (prefix + args.fair) + (64 << 20)
    daemons = [PrivateDaemon(pool_size=f"{pool >> 20}MiB", slab_size="8MiB", extra=tuple(no_system_config()),
                             env={"KVTIER_COPY_THREADS": str(t)}, timeout=600) for t in args.threads]
    sockets = [d.socket for d in daemons]
    ctx = mp.get_context("spawn")
    barriers = {n: ctx.Barrier(n) for n in ({1, 2} if args.fair else set(args.n))}
    procs, conns = [], []
    try:
        want = seed(sockets, args.blocks, args.block, 1)
        want_big = seed(sockets, big_blocks, args.block, 2) if args.fair else None
        for i in range(clients):
            a, b = ctx.Pipe()
            blocks = max(args.blocks, big_blocks) if (args.fair and i == 0) else args.blocks
            procs.append(ctx.Process(target=engine, args=(i, sockets, blocks, args.block, barriers, b)))
            procs[-1].start()
            conns.append(a)
        for c in conns:
            assert c.recv() == "ready"
        loads = []
        if args.fair:
            fair(args, conns, want, want_big, big_blocks, loads)
        else:
            spread(args, sockets, conns, want, loads)
        print(f"load average (1 min) over the run: {min(loads):.2f}-{max(loads):.2f}; {os.cpu_count()} CPUs; "
              f"{args.rounds} rounds; prefix {args.blocks} x {short_size(args.block)} = {short_size(prefix)}")
    finally:
        for c in conns:
            try:
                c.send(None)
            except OSError:  # that process is gone already (its traceback was printed)
                pass
        for pr in procs:
            pr.join(60)
        for d in daemons:
            d.stop()


def spread(args, sockets, conns, want, loads) -> None:
    times = {(t, n): [] for t in args.threads for n in args.n}  # client round trips
    inside = {(t, n): [] for t in args.threads for n in args.n}  # daemon mean per batch
    pings = []
    p50 = {(t, n): [] for t in args.threads for n in args.n}  # per batch: its loads' median round trip
    order = list(range(len(sockets)))
    for d in order:  # warm-up, untimed: each registration's first copy builds its row views
        for c in conns:
            c.send((d, 1, args.blocks, 1, False))
        assert all(c.recv()[2] for c in conns)
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for d in order[r % len(order):] + order[:r % len(order)]:
            t = args.threads[d]
            for n in args.n:
                before = daemon_load_stats(sockets[d])
                for c in conns[:n]:
                    c.send((d, n, args.blocks, 1, False))
                got = [c.recv() for c in conns[:n]]
                after = daemon_load_stats(sockets[d])
                assert all(g[2] and g[4] == want for g in got), "a load came back different from what was stored"
                times[(t, n)] += [g[0] for g in got]
                pings += [g[1] for g in got]
                inside[(t, n)].append((after[1] - before[1]) / max(1, after[0] - before[0]))
                p50[(t, n)].append(statistics.median(g[0] for g in got))
    loads.append(os.getloadavg()[0])
    rows = []
    for t in args.threads:
        lone, lone_in = statistics.median(times[(t, 1)]), statistics.median(inside[(t, 1)])
        base = statistics.median(times[(args.threads[0], 1)])
        for n in args.n:
            xs, ins = times[(t, n)], statistics.median(inside[(t, n)])
            # The same ratios within each round (this batch vs the lone load just before it), median over rounds:
            # what load from other processes does to one round cancels out of its ratio.
            rt = statistics.median(a / b for a, b in zip(p50[(t, n)], p50[(t, 1)]))
            rd = statistics.median(a / b for a, b in zip(inside[(t, n)], inside[(t, 1)]))
            rows.append([t, n, statistics.median(xs) * 1e3, max(xs) * 1e3, ins * 1e3,
                         f"{statistics.median(xs) / lone:.2f}x", f"{max(xs) / lone:.2f}x", f"{ins / lone_in:.2f}x",
                         f"{rt:.2f}x", f"{rd:.2f}x", f"{lone / base:.2f}x" if n == 1 else ""])
    print(table(["copy_threads", "N at once", "p50 ms", "max ms", "daemon mean ms", "p50 / lone", "max / lone",
                 "daemon / lone", "per-round p50 / lone", "per-round daemon / lone",
                 f"lone / lone at {args.threads[0]} thread(s)"], rows,
                "each load's round trip, N loads of the same prefix at a barrier"))
    print(f"ping round trip p50 {statistics.median(pings) * 1e3:.3f} ms")


def fair(args, conns, want, want_big, big_blocks, loads) -> None:
    rows = []
    for d in range(len(args.threads)):  # warm-up, untimed
        for i, c in enumerate(conns):
            c.send((d, 1, big_blocks if i == 0 else args.blocks, 2 if i == 0 else 1, False))
        assert all(c.recv()[2] for c in conns)
    got = {t: ([], [], [], [0]) for t in args.threads}  # small alone, small beside big, big, small first
    order = list(range(len(args.threads)))
    for r in range(args.rounds):  # daemons interleaved, the order rotating
        loads.append(os.getloadavg()[0])
        for d in order[r % len(order):] + order[:r % len(order)]:
            alone, beside, big, first = got[args.threads[d]]
            conns[1].send((d, 1, args.blocks, 1, False))  # the small load alone
            g = conns[1].recv()
            assert g[2] and g[4] == want
            alone.append(g[0])
            conns[0].send((d, 2, big_blocks, 2, True))  # the big one sends, then both meet
            conns[1].send((d, 2, args.blocks, 1, False))
            gb, gs = conns[0].recv(), conns[1].recv()
            assert gb[2] and gb[4] == want_big and gs[2] and gs[4] == want
            beside.append(gs[0])
            big.append(gb[0])
            first[0] += gs[3] < gb[3]
    loads.append(os.getloadavg()[0])
    for t, (alone, beside, big, first) in got.items():
        rows.append([t, statistics.median(alone) * 1e3, statistics.median(beside) * 1e3, max(beside) * 1e3,
                     f"{statistics.median(beside) / statistics.median(alone):.2f}x",
                     statistics.median(big) * 1e3, f"{first[0]}/{args.rounds}"])
    print(table(["copy_threads", "small alone p50 ms", "small beside big p50 ms", "max ms", "beside / alone",
                 f"big ({short_size(big_blocks * args.block)}) p50 ms", "small done first"], rows,
                "a small load sent just after another client's big one"))


if __name__ == "__main__":
    sys.exit(main())
