#!/usr/bin/env python
# Feeds RELIABILITY.md, the soak rows (no BENCHMARKS.md section).
"""Bounded-time soak of one kvtier daemon under clients that get SIGKILLed.

    python scripts/soak.py [--seconds 60] [--clients 4] [--seed 1] [--json]

Starts a private daemon, then runs ``--clients`` engine workers
(scripts/soak_worker.py) that store, look up, load (verifying every byte),
offload, restore (verifying) and discard. At random moments a worker is
SIGKILLed (sometimes within its first 0.2 s, before or during HELLO) and a
new one takes its slot; workers also finish on their own with BYE (half of
them without closing their KV cache, as engines that just exit do).

At the end: every worker is stopped (half killed, half BYE), the daemon must
reap them all, pass its integrity check, hold no swap and only committed
prefix blocks (and nothing after a flush), no dead worker's /dev/shm segment
may remain, and the daemon's anonymous RSS (outside the shared pool) should
not have grown. Exit status 0 only if mismatches, failures and leaks are 0.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import psutil

import benchlib  # scripts/ is on sys.path when run as a script; it puts the checkout first
import soak_worker
from benchlib import REPO

from kvtier.client import Client
from kvtier.pool.segment import pid_of

MiB = 2**20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kill-every", type=float, default=0.5, help="mean seconds between kills")
    p.add_argument("--pool-size", default="32MiB")
    p.add_argument("--slab-size", default="1MiB")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    return p.parse_args(argv)


def anon_rss(pid: int) -> int:
    """Resident bytes outside shared mappings (RssAnon): heap, stacks, private maps.
    statm's 'shared' counts file and shmem pages, so the pool is excluded."""
    mi = psutil.Process(pid).memory_info()
    return mi.rss - mi.shared


def start_daemon(args, tmp: str) -> tuple[subprocess.Popen, str, str]:
    sock, log = os.path.join(tmp, "kvtier.sock"), os.path.join(tmp, "daemon.log")
    proc = benchlib.start_daemon(sock, args.pool_size, {**os.environ, "KVTIER_REAP_INTERVAL_S": "0.1"}, 60,
                                 ("--slab-size", args.slab_size), cwd=REPO, log=log)
    return proc, sock, log


class Supervisor:
    """Keeps ``n`` workers running; kills and replaces them. Never touches ZeroMQ,
    so forking workers from it is safe."""

    def __init__(self, sock: str, n: int, rng: random.Random):
        self.ctx = mp.get_context("fork")
        self.sock, self.rng = sock, rng
        self.stop = self.ctx.RawValue("b", 0)
        self.stats = [self.ctx.RawArray("q", len(soak_worker.STATS)) for _ in range(n)]
        self.procs: list = [None] * n
        self.pids: list[int] = []
        self.early: dict[int, float] = {}  # slot -> when to kill its fresh worker
        self.kills = self.early_kills = self.clean_exits = 0
        self.failures: list[str] = []
        for slot in range(n):
            self.spawn(slot)

    def spawn(self, slot: int) -> None:
        p = self.ctx.Process(target=soak_worker.main, daemon=True,
                             args=(self.sock, slot, self.stats[slot], self.stop, self.rng.randrange(2**31)))
        p.start()
        self.procs[slot] = p
        self.pids.append(p.pid)

    def kill(self, slot: int) -> None:
        p = self.procs[slot]
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
            self.kills += 1
        p.join()

    def reap_exited(self) -> None:
        for slot, p in enumerate(self.procs):
            if p.exitcode is None:
                continue
            if p.exitcode == 0:
                self.clean_exits += 1
            else:
                self.failures.append(f"worker pid {p.pid} exited with {p.exitcode}")
            self.spawn(slot)

    def tick(self, now: float) -> None:
        """One random kill; a third of the time also kill the replacement early."""
        slot = self.rng.randrange(len(self.procs))
        self.kill(slot)
        self.spawn(slot)
        if self.rng.random() < 0.33:
            self.early[slot] = now + self.rng.uniform(0.0, 0.2)

    def kill_early(self, now: float) -> None:
        for slot, when in list(self.early.items()):
            if now >= when:
                del self.early[slot]
                self.kill(slot)
                self.early_kills += 1
                self.spawn(slot)

    def finish(self) -> None:
        """Half of the workers are killed, the others asked to say BYE."""
        self.stop.value = 1
        for slot, p in enumerate(self.procs):
            if self.rng.random() < 0.5:
                self.kill(slot)
            else:
                p.join(20)
                if p.exitcode is None:
                    self.failures.append(f"worker pid {p.pid} did not stop")
                    self.kill(slot)
                elif p.exitcode == 0:
                    self.clean_exits += 1
                else:
                    self.failures.append(f"worker pid {p.pid} exited with {p.exitcode}")

    def totals(self) -> dict:
        return {name: sum(s[i] for s in self.stats) for i, name in enumerate(soak_worker.STATS)}


def run(args, sock: str, daemon_pid: int) -> tuple[Supervisor, dict]:
    rng = random.Random(args.seed)
    sup = Supervisor(sock, args.clients, rng)
    t0 = time.monotonic()
    end, warm = t0 + args.seconds, t0 + args.seconds * 0.25
    rss = {}
    next_kill = t0 + rng.expovariate(1 / args.kill_every)
    while (now := time.monotonic()) < end:
        time.sleep(0.01)
        sup.reap_exited()
        sup.kill_early(now)
        if now >= next_kill:
            sup.tick(now)
            next_kill = now + rng.expovariate(1 / args.kill_every)
        if "warm" not in rss and now >= warm:
            rss["warm"] = anon_rss(daemon_pid)  # pool and index have filled by now
    sup.finish()
    return sup, rss


def check_daemon(sock: str, pids: list[int]) -> dict:
    """Wait until every worker is reaped, then audit the pool."""
    out = {}
    with Client(sock, name="soak-probe", heartbeat=False, timeout=10.0) as probe:
        t0 = time.monotonic()
        while True:
            s = probe.stats(check=True)
            left = [c for c in s["clients"] if c["name"] != "soak-probe"]
            if not left or time.monotonic() - t0 > 15:
                break
            time.sleep(0.1)
        out["reap_wait_s"] = round(time.monotonic() - t0, 2)
        out["clients_left"] = len(left)
        out["integrity"] = s["integrity"]
        out["swap_bytes"], out["swap_requests"] = s["swap"]["bytes"], s["swap"]["requests"]
        out["pool_used_bytes"] = s["pool"]["used_bytes"]
        out["prefix_bytes"] = sum(n["bytes"] for n in s["namespaces"])
        out["writing_blocks"] = sum(n["writing"] for n in s["namespaces"])
        out["evictions"], out["reaped"] = s["pool"]["evictions"], s["totals"]["reaped"]
        out["daemon_errors"] = s["errors"]
        probe.flush()  # with no client left nothing is pinned or in flight: all must go
        out["used_after_flush"] = probe.stats()["pool"]["used_bytes"]
    out["leaked_segments"] = wait_for_segments(set(pids), timeout=10.0)
    return out


def wait_for_segments(pids: set[int], timeout: float) -> list[str]:
    """Dead workers' KV segments still in /dev/shm after the daemon's sweep had time to run."""
    deadline = time.monotonic() + timeout
    while True:
        left = sorted(n for n in os.listdir("/dev/shm")
                      if n.startswith("kvtier-kv.") and pid_of(n[len("kvtier-kv"):]) in pids)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def main(argv=None) -> int:
    args = parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="kvtier-soak-")
    daemon, sock, log = start_daemon(args, tmp)
    try:
        time.sleep(0.5)
        rss = {"start": anon_rss(daemon.pid)}
        sup, more = run(args, sock, daemon.pid)
        rss.update(more)
        audit = check_daemon(sock, sup.pids)
        rss["end"] = anon_rss(daemon.pid)
    finally:
        benchlib.stop_daemon(daemon, 60)
        rc = daemon.returncode
    totals = sup.totals()
    summary = {
        "seconds": args.seconds, "clients": args.clients, "seed": args.seed,
        "workers_started": len(sup.pids), "kills": sup.kills, "early_kills": sup.early_kills,
        "clean_exits": sup.clean_exits, "operations": sum(totals[k] for k in (
            "lookups", "loads", "stores", "offloads", "restores", "discards")),
        **totals, "worker_failures": sup.failures, **audit,
        "leaks": len(audit["leaked_segments"]),
        "rss_anon_mib": {k: round(v / MiB, 1) for k, v in rss.items()},
        "rss_growth_mib": round((rss["end"] - rss.get("warm", rss["start"])) / MiB, 1),
        "daemon_exit": rc, "pool_segment_left": bool(glob.glob(f"/dev/shm/kvtier-pool.{daemon.pid}.*")),
        "daemon_log": log, "swept_segments": open(log).read().count("removed stale shared memory segment"),
        "silent_reaps": open(log).read().count("reaped (silent"),  # dead workers must go by pid
    }
    problems = verdict(summary)
    summary["ok"], summary["problems"] = not problems, problems
    print(json.dumps(summary) if args.json else render(summary))
    return 0 if not problems else 1


def verdict(s: dict) -> list[str]:
    checks = {
        "byte mismatches": s["mismatches"] == 0, "failed restores": s["restore_failed"] == 0,
        "worker failures": not s["worker_failures"], "integrity": s["integrity"] == "ok",
        "clients left": s["clients_left"] == 0,
        "reaped by heartbeat, not pid": s["reap_wait_s"] < 5.0 and s["silent_reaps"] == 0,
        "swap left": s["swap_bytes"] == s["swap_requests"] == 0,
        "pool holds more than prefix blocks": (s["pool_used_bytes"] == s["prefix_bytes"]
                                               and not s["writing_blocks"]),
        "pool not empty after flush": s["used_after_flush"] == 0, "leaked segments": s["leaks"] == 0,
        "INTERNAL errors": "INTERNAL" not in s["daemon_errors"], "daemon exit": s["daemon_exit"] == 0,
        "pool segment left": not s["pool_segment_left"], "no kills": s["kills"] > 0,
    }
    return [name for name, ok in checks.items() if not ok]


def render(s: dict) -> str:
    lines = [
        f"soak: {s['seconds']:.0f} s, {s['clients']} clients, seed {s['seed']}",
        f"  workers started {s['workers_started']}, SIGKILLed {s['kills']} ({s['early_kills']} within 0.2 s "
        f"of start), clean exits {s['clean_exits']}",
        f"  operations {s['operations']}: lookups {s['lookups']}, loads {s['loads']}, stores {s['stores']}, "
        f"offloads {s['offloads']}, restores {s['restores']}, discards {s['discards']}",
        f"  bytes verified {s['bytes_verified']} ({s['bytes_verified'] / MiB:.1f} MiB), mismatches "
        f"{s['mismatches']}, load blocks failed (evicted) {s['load_failed']}, "
        f"store no-space {s['store_no_space']}, offloads refused {s['offload_refused']}, "
        f"restores failed {s['restore_failed']}",
        f"  end: reaped in {s['reap_wait_s']} s ({s['silent_reaps']} reaped by heartbeat), clients left {s['clients_left']}, integrity {s['integrity']}, "
        f"swap {s['swap_bytes']} B, pool used {s['pool_used_bytes']} B = prefix {s['prefix_bytes']} B, "
        f"after flush {s['used_after_flush']} B, evictions {s['evictions']}",
        f"  leaks {s['leaks']} {s['leaked_segments'] or ''}(segments of exited workers swept by the "
        f"daemon: {s['swept_segments']}), daemon RSS outside the pool (MiB) "
        f"{s['rss_anon_mib']}, growth after warm-up {s['rss_growth_mib']} MiB",
        f"  daemon errors {s['daemon_errors']}, exit {s['daemon_exit']}, worker failures {s['worker_failures']}",
        "  OK" if s["ok"] else f"  FAILED: {', '.join(s['problems'])} (log {s['daemon_log']})",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
