#!/usr/bin/env python3
"""Store, load and lookup round trips of one Client through a real daemon: two checkouts, interleaved.

Feeds BENCHMARKS.md section 11.1 (did splitting ``Client`` into a
``Connection`` and registrations cost a round trip anything?). Each checkout
(``--tree NAME=PATH``, e.g. a ``git worktree`` of the commit before a change
and one of the commit after) gets a worker process that imports kvtier from
that path only and runs its own private daemon from it; the workers then run
batches in turn (A, B, B, A, A, B, ...) so both see the same load. One iteration:
store 8 new 16 KiB blocks and wait, load them into other engine blocks and
wait, look the 8 keys up (over the socket; with ``--lookup-index`` in the
daemon's shared-memory mirror, no round trip: what is left is the client's
own Python, the part the split touched most; with ``--disk`` the daemon has a
disk tier, so every load is first offered to it - the lower-tier load path
issue 31 item 4 rebuilt - and finds its blocks in RAM). Reported per operation: the
median and p90 of every call, and the median over rounds of each round's
ratio of medians to the first tree's.

    python scripts/bench_roundtrip.py --tree before=/tmp/a --tree after=/tmp/b [--rounds 8] [--calls 200]
        [--lookup-index] [--disk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

OPS = ("store", "load", "lookup")
BLOCKS = 8  # per call


def worker(tree: str, mirror: bool, disk: bool = False) -> None:
    """One checkout's side: a daemon and a client, batches on request (stdin: a call count per line)."""
    sys.path.insert(0, tree)
    import torch

    from kvtier.client import Client, Namespace, ShmKVCache
    from kvtier.demo.daemon_proc import PrivateDaemon

    assert os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["kvtier"].__file__))) == tree
    ns = Namespace("bench-roundtrip", "float16", "flashinfer", 16)
    kv = ShmKVCache([(64, 2, 16, 2, 32)] * 4, torch.float16)  # 16 KiB blocks
    n = 0
    env = {"KVTIER_LOOKUP_INDEX": "true"} if mirror else {}
    root = tempfile.mkdtemp(prefix="kvtier-bench-rt-") if disk else None  # the disk tier on under every load
    if root:
        env.update(KVTIER_DISK_PATH=root, KVTIER_DISK_SIZE="256MiB")
    with PrivateDaemon(pool_size="64MiB", slab_size="4MiB", env=env, timeout=300) as d, \
            Client(d.socket, name="bench") as c:
        c.register_kv_cache(kv, [0] * 4, ns)
        print("ready", flush=True)
        for line in sys.stdin:
            times = {op: [] for op in OPS}
            for _ in range(int(line)):
                keys = [(n * BLOCKS + i).to_bytes(16, "little") for i in range(BLOCKS)]
                n += 1
                t0 = time.perf_counter()
                assert c.store(keys, range(BLOCKS)).wait().ok
                t1 = time.perf_counter()
                assert c.load(keys, range(BLOCKS, 2 * BLOCKS)).wait().ok
                t2 = time.perf_counter()
                assert c.lookup(keys) == BLOCKS
                t3 = time.perf_counter()
                for op, dt in zip(OPS, (t1 - t0, t2 - t1, t3 - t2)):
                    times[op].append(dt)
            print(json.dumps(times), flush=True)
    kv.close()
    if root:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=200, help="iterations per batch")
    p.add_argument("--lookup-index", action="store_true", help="the daemon mirrors ready keys in shared memory")
    p.add_argument("--disk", action="store_true", help="the daemon has a disk tier (every load offered to it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    procs = {}
    for name, path in trees.items():
        env = {**os.environ, "PYTHONPATH": os.path.abspath(path)}
        procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--tree", args.tree[0],
                                        *(["--lookup-index"] if args.lookup_index else []),
                                        *(["--disk"] if args.disk else []),
                                        "--worker", os.path.abspath(path)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env, cwd=os.path.abspath(path))
    for name, proc in procs.items():
        assert proc.stdout.readline().strip() == "ready", name
    samples = {name: {op: [] for op in OPS} for name in trees}
    ratios = {name: {op: [] for op in OPS} for name in trees}
    load = [os.getloadavg()[0]]
    names = list(trees)
    base = names[0]
    for r in range(args.rounds):
        medians = {}
        for name in names[::-1] if r % 2 else names:  # interleaved, each tree first every other round
            procs[name].stdin.write(f"{args.calls}\n")
            procs[name].stdin.flush()
            got = json.loads(procs[name].stdout.readline())
            medians[name] = {op: statistics.median(got[op]) for op in OPS}
            for op in OPS:
                samples[name][op] += got[op]
        for name in names:
            for op in OPS:
                ratios[name][op].append(medians[name][op] / medians[base][op])
        load.append(os.getloadavg()[0])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait(60)
    print(f"load average (1 min) during the run: {min(load):.2f}-{max(load):.2f}; "
          f"{args.rounds} rounds x {args.calls} calls per tree and operation; "
          f"lookups {'in the shared-memory mirror' if args.lookup_index else 'over the socket'}"
          f"{'; disk tier on' if args.disk else ''}")
    print("| tree | op | median us | p90 us | median of per-round ratio to " + base + " |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        for op in OPS:
            xs = sorted(samples[name][op])
            print(f"| {name} | {op} | {statistics.median(xs) * 1e6:.1f} | {xs[int(0.9 * len(xs))] * 1e6:.1f} "
                  f"| {statistics.median(ratios[name][op]):.3f} |")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1], "--lookup-index" in sys.argv, "--disk" in sys.argv)
    else:
        main()
