#!/usr/bin/env python3
# Feeds BENCHMARKS.md section 11.
"""Is the daemon responsive while a real TP=2 vLLM CPU engine fills the cores? (issue 26 item 6)

    python scripts/bench_status_under_load.py [--rounds 3] [--phase-s 20] [--json PATH]   (~6 min)

The report behind it: "while an idle TP=2 vLLM CPU engine's workers kept both
cores busy, ``kvtier status`` took ~65 s and the daemon dropped the engine's
scheduler connection as 'silent for 6.2 s'". This script starts a private
kvtier daemon (log level INFO, so every reap is logged) and one vLLM 0.32 CPU
engine (``scripts/vllm_engine.py``, a random tiny Llama, TP=2, kvtier's
connector on that daemon, each rank's OpenMP team bound to its own core:
``VLLM_CPU_OMP_THREADS_BIND=0|1``), then measures, phase after phase:

* ``kvtier status --json`` as a fresh process (interpreter start, imports,
  one STATS round trip: what a user typing it waits), and the STATS round
  trip alone from a client in this process (the daemon's share of it);
* a lookup round trip of 128 keys from a client registered in this process.

Phases, each ``--phase-s`` seconds, the order rotating every round:

* ``engine idle``       - the engine alive with nothing to do;
* ``engine generating`` - a thread keeps ``generate`` calls going through it;
* ``engine stopped``    - every engine process SIGSTOPped (no CPU; its
  sessions stay open): the baseline interleaved with the two above;

plus ``no engine`` before the engine starts and after it quits, and
``engine starting`` (from launching it until it is ready: vLLM loading,
its KV caches allocated, adopted into memfds and registered). Each phase
also records the CPU the engine's processes used (100% = one core) and the
load average. At the end: the daemon's log lines that reaped or dropped a
client, and whether the engine's clients were all still connected.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

import benchlib as bl

from kvtier.client import Client, Namespace, ShmKVCache
from kvtier.demo.daemon_proc import PrivateDaemon

sys.path.insert(0, os.path.join(bl.REPO, "client"))
import vllm_offline as ex  # noqa: E402

ENGINE = os.path.join(bl.REPO, "scripts", "vllm_engine.py")
KEYS = 128
NS = Namespace("bench-status", "uint8", "flat", 16)


class Engine:
    """``vllm_engine.py --tp N`` on the daemon's socket; ``call(op)`` -> its JSON answer."""

    def __init__(self, model: str, socket: str, tp: int, bind: str, log_path: str):
        env = ex.engine_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND=bind)
        cmd = [sys.executable, ENGINE, "--model", model, "--tp", str(tp), "--block-size", "32",
               "--max-model-len", "1024", "--kvtier", "--socket", socket]
        self.log = log_path
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log_path, "w"), text=True, env=env)
        self.lock = threading.Lock()
        self.ready: dict | None = None
        self.up = threading.Event()  # set once READY came (or the engine exited)
        threading.Thread(target=self._wait_ready, daemon=True).start()

    def _wait_ready(self) -> None:
        try:
            self.ready = self._read("READY ")
        finally:
            self.up.set()

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        raise RuntimeError(f"engine exited; log {self.log}:\n" + open(self.log).read()[-3000:])

    def call(self, op: str, **kw) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            return self._read("RESULT ")

    def processes(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_all(self, sig: int) -> None:
        for p in self.processes():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        self.signal_all(signal.SIGCONT)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class Generator:
    """Keeps ``generate`` calls going through the engine while ``on``."""

    def __init__(self, engine: Engine):
        self.engine, self.on, self.stop = engine, threading.Event(), False
        self.calls = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        rng = random.Random(5)
        while not self.stop:
            if not self.on.wait(0.2):
                continue
            prompts = [[rng.randrange(1, 500) for _ in range(256)] for _ in range(4)]
            self.engine.call("generate", prompts=prompts, max_tokens=16)
            self.calls += 1


def cpu_seconds(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def status_once(socket: str) -> tuple[float, int]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "status", "--socket", socket, "--json",
                        "--timeout", "120"], capture_output=True, text=True, env={**os.environ})
    return time.perf_counter() - t, r.returncode


def phase(name: str, seconds: float, socket: str, client: Client, engine: Engine | None,
          until: threading.Event | None = None) -> dict:
    """``kvtier status`` and 20 lookups, alternating, for ``seconds`` (or until ``until`` is set)."""
    keys = [os.urandom(16) for _ in range(KEYS)]
    procs = engine.processes() if engine is not None else []
    cpu0, wall0, load0, began = cpu_seconds(procs), time.monotonic(), os.getloadavg()[0], time.time()
    status, stats, lookups, failures = [], [], [], 0
    over = until.is_set if until is not None else lambda: time.monotonic() - wall0 >= seconds
    while not over():
        s, rc = status_once(socket)
        status.append(s)
        failures += rc != 0
        t = time.perf_counter()
        client.stats()
        stats.append(time.perf_counter() - t)
        for _ in range(20):
            t = time.perf_counter()
            client.lookup(keys)
            lookups.append(time.perf_counter() - t)
    wall = time.monotonic() - wall0
    cpu1 = cpu_seconds(engine.processes()) if engine is not None else {}  # a starting engine forks its workers
    return {"phase": name, "began": began, "ended": time.time(), "status_s": status, "stats_s": stats, "lookup_s": lookups, "status_failures": failures,
            "engine_cpu_pct": 100 * sum(c - cpu0.get(pid, 0.0) for pid, c in cpu1.items()) / wall,
            "load": (load0, os.getloadavg()[0])}


def during(log_line: str, results: list[dict]) -> str:
    """The phase a daemon log line's timestamp falls in (the log's local time)."""
    try:
        when = time.mktime(time.strptime(log_line[:19], "%Y-%m-%d %H:%M:%S")) + int(log_line[20:23]) / 1e3
    except ValueError:
        return "?"
    for p in results:
        if p["began"] <= when <= p["ended"] + 0.5:
            return p["phase"]
    return "between phases (the engine starting or quitting)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bind", default="|".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2]),
                    help="VLLM_CPU_OMP_THREADS_BIND (default: one core per rank)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--nice", type=int, default=0, help="setpriority of the daemon (the unit runs it at -5)")
    bl.add_json_flag(ap)
    args = ap.parse_args(argv)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, \
            PrivateDaemon(pool_size="256MiB", slab_size="4MiB", log_level="INFO") as d:
        if args.nice:
            os.setpriority(os.PRIO_PROCESS, d.proc.pid, args.nice)
        model = ex.make_tiny_llama(os.path.join(tmp, "model"), layers=args.layers, hidden=args.hidden)
        kv = ShmKVCache([(8, 256)], __import__("torch").uint8)
        client = Client(d.socket, name="bench-status")
        client.register_kv_cache(kv, [0], NS)
        results.append(phase("no engine (before)", args.phase_s, d.socket, client, None))
        t0 = time.monotonic()
        engine = Engine(model, d.socket, args.tp, args.bind, os.path.join(tmp, "engine.log"))
        results.append(phase("engine starting", 0, d.socket, client, engine, until=engine.up))
        start_s = time.monotonic() - t0
        gen = Generator(engine)
        try:
            if engine.ready is None:
                raise RuntimeError("engine exited; log:\n" + open(engine.log).read()[-3000:])
            engine.call("generate", prompts=[[1, 2, 3] * 80], max_tokens=4)  # warm: one request through
            clients0 = len(client.stats()["clients"])
            names = ["engine idle", "engine generating", "engine stopped"]
            for r in range(args.rounds):
                for name in names[r % 3:] + names[:r % 3]:
                    if name == "engine generating":
                        gen.on.set()
                    elif name == "engine stopped":
                        engine.signal_all(signal.SIGSTOP)
                    results.append(phase(name, args.phase_s, d.socket, client, engine))
                    gen.on.clear()
                    engine.signal_all(signal.SIGCONT)
                    with engine.lock:  # a generate in flight finishes before the next phase
                        pass
            clients1 = len(client.stats()["clients"])
        finally:
            gen.stop = True
            engine.close()
        results.append(phase("no engine (after)", args.phase_s, d.socket, client, None))
        client.close()
        kv.close()
        log = d.read_log()
    dropped = [{"line": line, "phase": during(line, results)} for line in log.splitlines()
               if "reaped" in line or "silent" in line]
    rows = []
    for name in ["no engine (before)", "engine starting", "engine idle", "engine generating", "engine stopped", "no engine (after)"]:
        ps = [p for p in results if p["phase"] == name]
        st = [s for p in ps for s in p["status_s"]]
        lk = [s for p in ps for s in p["lookup_s"]]
        rt = [s for p in ps for s in p["stats_s"]]
        rows.append([name, len(st), bl.median(st), max(st), bl.median(rt) * 1e3, max(rt) * 1e3, len(lk), bl.median(lk) * 1e3, bl.pct(lk, 99) * 1e3,
                     max(lk) * 1e3, bl.median([p["engine_cpu_pct"] for p in ps]),
                     f"{min(p['load'][0] for p in ps):.1f}-{max(p['load'][1] for p in ps):.1f}",
                     sum(p["status_failures"] for p in ps)])
    head = (f"TP={args.tp} vLLM CPU engine with kvtier (bind {args.bind!r}, started in {start_s:.0f} s, "
            f"{gen.calls} generate calls); daemon nice {args.nice}; engine clients connected "
            f"{clients0 - 1} before, {clients1 - 1} after the phases")
    tables = [bl.table(["phase", "status runs", "status median s", "status max s", "STATS round trip p50 ms",
                        "STATS max ms", "lookups", "lookup p50 ms",
                        "lookup p99 ms", "lookup max ms", "engine CPU % (median)", "load avg", "status errors"],
                       rows, head),
              "daemon log lines that reaped or dropped a client:\n"
              + ("\n".join(f"{d['line']}   <- during: {d['phase']}" for d in dropped) or "  (none)")]
    bl.emit({"phases": results, "dropped": dropped, "start_s": start_s, "args": vars(args)}, tables, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
