#!/usr/bin/env python3
# Feeds RELIABILITY.md, "Attacks tried" (no BENCHMARKS.md section).
"""Issue 21's floods against a real daemon, with the figures RELIABILITY.md
lists ("Attacks tried"): the daemon's descriptors, mappings and memory
before and during each attack, whether it is alive afterwards, and whether
a good client of another user (root here) is served byte-exact - for the
lookup flood also that client's p50 lookup over the socket.

    sudo python scripts/bench_attacks.py [--daemon-repo PATH] [--attack NAME ...]

``--daemon-repo`` runs the daemon from another checkout (e.g. the commit
before the fix) so "before" and "after" come from the same kind of run; the
attacker (``tests/daemon/flood_worker.py``, as uid 41011) and the good
client come from this checkout. Needs root (the attacker is another uid).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import psutil  # noqa: E402

from kvtier.client import Client  # noqa: E402
from kvtier.protocol import messages as m  # noqa: E402
from tests.helpers import NS, make_kv  # noqa: E402

WORKER = os.path.join(REPO, "tests", "daemon", "flood_worker.py")
ATTACKER = 41011
MiB = 2**20


class Daemon:
    def __init__(self, repo: str, env: dict, nofile: int | None = None, pool="256MiB"):
        self.dir = tempfile.mkdtemp(prefix="kvt-bench-attacks-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "kvtier.sock")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w")
        cmd = [sys.executable, "-m", "kvtier.daemon", "--socket", self.socket, "--pool-size", pool,
               "--slab-size", "4MiB"]
        if nofile:
            cmd = ["prlimit", f"--nofile={nofile}:{nofile}", *cmd]
        full = {**os.environ, "PYTHONPATH": repo, "KVTIER_SOCKET_MODE": "666", **env}
        # cwd: "python -m" puts it first on sys.path, ahead of PYTHONPATH
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full, cwd=repo)
        deadline = time.monotonic() + 60
        while not (os.path.exists(self.socket) and "kvtier-daemon pid" in self.read_log()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(self.read_log()[-2000:])
            time.sleep(0.05)

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def figures(self) -> dict:
        if self.proc.poll() is not None:
            return {"alive": False, "exit": self.proc.returncode}
        p = psutil.Process(self.proc.pid)
        with open(f"/proc/{self.proc.pid}/maps") as f:
            maps = sum(1 for _ in f)
        return {"alive": True, "fds": p.num_fds(), "maps": maps, "rss_mib": round(p.memory_info().rss / MiB, 1)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def attacker(role: str, socket: str, n: int) -> subprocess.Popen:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    return subprocess.Popen([sys.executable, WORKER, role, socket, str(ATTACKER), str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def good_client(socket: str, lookups: int = 0) -> dict:
    """Store 4 blocks, load them back byte-exact; optionally time lookups."""
    kv = make_kv(seed=5)
    hashes = [os.urandom(16) for _ in range(4)]
    out = {"served": False}
    try:
        with Client(socket, name="good", timeout=30) as c:
            c.register_kv_cache(kv, [0] * 4, NS)
            stored = c.store(hashes, [0, 1, 2, 3]).wait().ok
            want = [t[:4].clone() for t in kv.tensors]
            for t in kv.tensors:
                t[4:8].zero_()
            loaded = c.load(hashes, [4, 5, 6, 7]).wait().ok
            out["served"] = stored and loaded and all(w.equal(t[4:8]) for w, t in zip(want, kv.tensors))
            times = []
            for _ in range(lookups):
                t0 = time.perf_counter()
                c.lookup(hashes)
                times.append(time.perf_counter() - t0)
            if times:
                out["lookup_p50_ms"] = round(statistics.median(times) * 1e3, 2)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    kv.close()
    return out


def good_handovers(socket: str, tries: int = 5) -> str:
    """Hand-overs that got a ticket (fewer tries than the 8 unused tickets a user may hold)."""
    from kvtier.client.handover import hand_over
    kv = make_kv()
    ok = 0
    for _ in range(tries):
        try:
            hand_over(socket, kv.fds(), timeout=5.0)
            ok += 1
        except Exception:
            pass
    kv.close()
    return f"{ok}/{tries}"


def watchdog(d: Daemon, limit_mib: float, tripped: list) -> None:
    """Kill the daemon before it takes the machine's memory (the shared box has ~23 GiB)."""
    while d.proc.poll() is None:
        try:
            if psutil.Process(d.proc.pid).memory_info().rss > limit_mib * MiB:
                tripped.append(limit_mib)
                d.proc.kill()
                return
        except psutil.Error:
            return
        time.sleep(0.1)


def flood(role: str, n: int, repo: str, env: dict, nofile=None, lookups=0, settle=0.0,
          rss_limit_mib: float = 4096) -> dict:
    d = Daemon(repo, env, nofile)
    tripped: list = []
    threading.Thread(target=watchdog, args=(d, rss_limit_mib, tripped), daemon=True).start()
    try:
        row = {"attack": role, "before": d.figures()}
        if lookups:
            row["good_quiet"] = good_client(d.socket, lookups)
        a = attacker(role, d.socket, n)
        line = a.stdout.readline()
        row["attacker"] = json.loads(line) if line else {"died": a.stderr.read()[-1500:]}
        time.sleep(settle)
        row["during"] = d.figures()
        row["good_during"] = good_client(d.socket, lookups)
        if role == "handovers":  # the good client's own hand-overs while the flood holds the slots
            row["good_handovers"] = good_handovers(d.socket)
        row["during_after_good"] = d.figures()
        try:
            out, err = a.communicate("done\n", timeout=900)
            row["attacker_end"] = [json.loads(x) for x in out.splitlines()]
        except subprocess.TimeoutExpired:
            a.kill()
        row["after"] = d.figures()
        row["good_after"] = good_client(d.socket)
        row["log_bytes"] = len(d.read_log())
        if tripped:
            row["killed_at_rss_mib"] = tripped[0]
        return row
    finally:
        d.stop()


def mirror_cycles(repo: str, cycles: int = 6) -> dict:
    d = Daemon(repo, {"KVTIER_LOOKUP_INDEX": "true"})
    try:
        kv = make_kv(shape=(64, 32), layers=1, seed=1)  # 64-byte blocks
        peak = 0
        with Client(d.socket, name="cycler", timeout=30) as c:
            for i in range(cycles):
                c.register_kv_cache(kv, [0], f"tiny-{i}")
                peak = max(peak, sum(os.path.getsize(f) for f in glob.glob(f"/dev/shm/kvtier-ix.{d.proc.pid}.*")))
                c.channel.call(m.Unregister(c.registration.reg))
                time.sleep(0.6)  # a reap pass forgets the empty namespace
                size = sum(os.path.getsize(f) for f in glob.glob(f"/dev/shm/kvtier-ix.{d.proc.pid}.*"))
                peak = max(peak, size)
        kv.close()
        return {"attack": "mirror cycles", "cycles": cycles, "shm_mib_after": round(size / MiB, 1),
                "shm_mib_peak": round(peak / MiB, 1), "figures": d.figures(), "good": good_client(d.socket)}
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--daemon-repo", default=REPO)
    ap.add_argument("--window", type=int, default=8, help="lookups: unanswered frames at most (0: no limit)")
    ap.add_argument("--attack", action="append",
                    choices=["registrations", "transfers", "handovers", "lookups", "mirrors"])
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: the attacker runs as another uid")
    repo = os.path.abspath(args.daemon_repo)
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# daemon from {repo} ({commit})", flush=True)
    for name in args.attack or ["registrations", "transfers", "handovers", "lookups", "mirrors"]:
        if name == "registrations":  # 64 connections x 64 registrations x 16 descriptors
            row = flood(name, 64, repo, {})  # the unit has LimitNOFILE=65536; this inherits ours
        elif name == "transfers":
            row = flood(name, 750, repo, {}, settle=2.0)
        elif name == "handovers":
            row = flood(name, 64, repo, {}, settle=1.0)
        elif name == "lookups":
            row = flood(name, args.window, repo, {}, lookups=300, settle=1.0)
        else:
            row = mirror_cycles(repo)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
