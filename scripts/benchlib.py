"""Shared helpers for the benchmark scripts: timing, tables, sizes, echo server.

Importing this module puts the repository root first on ``sys.path`` so the
scripts measure the checkout they live in, not some installed copy.

Run as a program it is the bare ZeroMQ baseline server:
``python benchlib.py echo SOCKET REPLY_BYTES`` - a ROUTER on ``ipc://SOCKET``
with the daemon's synchronous poll loop, answering every frame with
REPLY_BYTES bytes and doing nothing else.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from kvtier.pool.sizes import format_size, parse_size  # noqa: E402

GB = 1e9


# ---- timing -------------------------------------------------------------------------
def repeat(fn, min_time: float, min_reps: int = 3, max_reps: int = 1000, setup=None) -> list[float]:
    """Seconds per call of ``fn()``; runs until ``min_time`` of timed work and
    ``min_reps`` calls (at most ``max_reps``). ``setup()`` runs untimed before each."""
    times: list[float] = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < min_time):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def round_robin(cases: dict, min_time: float, min_reps: int = 3, max_reps: int = 1000) -> dict:
    """Time several cases in alternation, one rep of each per round, so all of
    them see the same background load. ``cases``: name -> (fn, setup or None).
    Runs until every case has ``min_time`` of timed work (and ``min_reps``)."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    rounds = 0
    while rounds < max_reps and (rounds < min_reps or min(sum(t) for t in times.values()) < min_time):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def pct(xs: list[float], p: float) -> float:
    """p-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def use_threads(n: int) -> dict:
    """Pin torch to ``n`` intra-op threads here; returns the env that does the
    same for a daemon subprocess. On this shared 2-core machine 2 threads make
    copies stall whenever another tenant holds a core (p90 of a 2 MiB copy_
    fell to 0.26 GB/s), so the benches default to 1 for both sides."""
    import torch
    torch.set_num_threads(n)
    return {"OMP_NUM_THREADS": str(n)}


# ---- parsing and output -------------------------------------------------------------
def size_list(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def short_size(n: int) -> str:
    return format_size(n).replace(".00 ", " ").replace(" ", "")


def machine_notes() -> dict:
    import psutil
    import torch
    return {"cpus": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "cuda": torch.cuda.is_available(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}  # other tenants share the 2 cores


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    """A Markdown table (pastes into BENCHMARKS.md as is)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = ([f"### {title}", ""] if title else []) + [line(headers)]
    out.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    out += [line(r) for r in cells]
    return "\n".join(out)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 100 else f"{c:,.0f}"
    return str(c)


def add_json_flag(p) -> None:
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the full report as JSON to PATH (tables still printed); alone: JSON on stdout only")


def emit(report: dict, tables: list[str], json_to: str | None) -> None:
    if json_to == "-":
        print(json.dumps(report, indent=1))
        return
    print("\n\n".join(tables))
    if json_to:
        with open(json_to, "w") as f:
            json.dump(report, f, indent=1)


# ---- private daemons ---------------------------------------------------------------
def no_system_config() -> list[str]:
    """Daemon flags that keep a benchmark's private daemon off the host's
    /etc/kvtier/kvtier.toml (an empty config file): defaults plus our flags only."""
    import atexit
    import tempfile
    global _EMPTY_CONFIG
    if _EMPTY_CONFIG is None:
        fd, _EMPTY_CONFIG = tempfile.mkstemp(prefix="kvtier-bench-", suffix=".toml")
        os.close(fd)
        atexit.register(os.unlink, _EMPTY_CONFIG)
    return ["--config", _EMPTY_CONFIG]


_EMPTY_CONFIG: str | None = None


def start_daemon(socket: str, pool_size, env: dict | None = None, timeout: float = 120, extra: tuple = (), *,
                 cwd: str | None = None, log_level: str | None = None, log: str | None = None, ready=None):
    """``python -m kvtier.daemon`` on ``socket`` (``extra``: more daemon flags); returns the
    Popen once the socket exists and ``ready(socket)``, when given, is true (a probe that
    raises: not yet). ``cwd``: the checkout whose kvtier runs (before/after trees: ``-m``
    puts the cwd first on the daemon's path; PYTHONPATH names it too, for what it spawns);
    ``log_level``: its ``--log-level``; ``log``: a file for its log (else a temporary one)."""
    import subprocess
    import tempfile
    if os.path.lexists(socket):  # a stale socket would read as "up" before the daemon binds
        os.unlink(socket)
    env = dict(os.environ if env is None else env, **({"PYTHONPATH": cwd} if cwd else {}))
    flags = [*no_system_config(), *(("--log-level", log_level) if log_level else ()), *extra]
    # Its log goes to a file, not a pipe nobody reads: a pipe that fills (~64 KiB of INFO
    # lines in a long benchmark) would stop the daemon mid-run.
    out = open(log, "w+") if log else tempfile.TemporaryFile(mode="w+", prefix="kvtier-bench-daemon-")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", socket,
                             "--pool-size", str(pool_size), *flags],
                            env=env, cwd=cwd or None, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + timeout
    while not (os.path.exists(socket) and _probe(ready, socket)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            out.seek(0)
            raise SystemExit(f"kvtier-daemon did not start: {out.read()[-2000:]}")
        # Callers time a start to ready: a fine poll for the socket; a probe (a client) less often.
        time.sleep(0.01 if ready is not None and os.path.exists(socket) else 0.002)
    return proc


def stop_daemon(proc, timeout: float = 120) -> float:
    """SIGTERM (it drains its copies and removes its pool), then wait: the seconds it took."""
    import signal
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout)
    return time.perf_counter() - t0


def release(clients=(), daemons=(), caches=()) -> None:
    """End a benchmark's engines in order: clients closed (their transfers cancelled), then
    the private daemons stopped, then the engines' KV caches closed (no daemon maps them)."""
    for c in clients:
        c.close()
    for d in daemons:
        d.stop()
    for kv in caches:
        kv.close()


def _probe(ready, socket: str) -> bool:
    try:
        return ready is None or bool(ready(socket))
    except Exception:  # noqa: BLE001 - bound but not serving yet
        return False


def answers_stats(socket: str, timeout: float = 60) -> bool:
    """A ``ready`` probe: the daemon's loop answers a client (HELLO, then stats)."""
    from kvtier.client import Client
    with Client(socket, name="probe", timeout=timeout) as c:
        c.stats()
    return True


# ---- client processes -------------------------------------------------------------
class WorkerPool:
    """``count`` spawned client processes, started once and reused per point.

    Each builds ``factory(index, *fargs)`` (an object with ``prep(arg)`` and
    ``go(t_end) -> result``). ``run(k, arg, duration)`` preps the first ``k``,
    waits until all are ready, then lets them run until the same wall-clock
    deadline and returns their results.
    """

    def __init__(self, count: int, factory, *fargs):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(count)]
        self.procs = [ctx.Process(target=_pool_worker, args=(i, factory, fargs, q, self.out), daemon=True)
                      for i, q in enumerate(self.cmds)]
        for p in self.procs:
            p.start()
        self._collect(count)

    def run(self, k: int, arg, duration: float) -> list:
        for q in self.cmds[:k]:
            q.put(("prep", arg))
        self._collect(k)
        t_end = time.time() + duration
        for q in self.cmds[:k]:
            q.put(("go", t_end))
        return self._collect(k, duration)

    def _collect(self, k: int, extra: float = 0.0) -> list:
        got = [self.out.get(timeout=600 + extra) for _ in range(k)]
        for _i, r in got:
            if isinstance(r, tuple) and r and r[0] == "error":
                self.close()
                raise SystemExit(f"client process failed:\n{r[1]}")
        return [r for _i, r in sorted(got, key=lambda x: x[0])]

    def close(self) -> None:
        for q, p in zip(self.cmds, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.terminate()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pool_worker(i, factory, fargs, cmds, out) -> None:
    import traceback
    try:
        obj = factory(i, *fargs)
        out.put((i, "up"))
        while (cmd := cmds.get()) is not None:
            op, arg = cmd
            if op == "prep":
                obj.prep(arg)
                out.put((i, "ready"))
            else:
                out.put((i, obj.go(arg)))
    except BaseException:
        out.put((i, ("error", traceback.format_exc())))


def quit_engine(proc) -> None:
    """Stop an engine process driven over its stdin (scripts/vllm_engine.py, peers_engine.py):
    ask it to quit, kill it if it has not within a minute."""
    import subprocess
    if proc.poll() is None:
        try:
            proc.stdin.write('{"op": "quit"}\n')
            proc.stdin.flush()
            proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def run_until(t_end: float, fn, setup=None, min_reps: int = 2) -> tuple[int, float]:
    """Call ``fn`` until the wall clock passes ``t_end``; (reps, timed seconds)."""
    busy, reps = 0.0, 0
    while time.time() < t_end or reps < min_reps:
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        busy += time.perf_counter() - t0
        reps += 1
    return reps, busy


# ---- bare ZeroMQ baseline -----------------------------------------------------------
def echo_server(socket_path: str, reply_bytes: int) -> None:
    import zmq
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 100_000)
    router.setsockopt(zmq.RCVHWM, 100_000)
    router.bind("ipc://" + socket_path)
    reply = b"r" * reply_bytes
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:  # the same shape as the daemon's loop: poll, drain a bounded batch
        if dict(poller.poll(500)):
            for _ in range(256):
                try:
                    ident, _frame = router.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                router.send_multipart([ident, reply], zmq.NOBLOCK)


class EchoServer:
    """The echo server in a subprocess; ``with EchoServer(path, n): ...``."""

    def __init__(self, socket_path: str, reply_bytes: int):
        import subprocess
        self.socket = socket_path
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "echo", socket_path,
                                      str(reply_bytes)])
        deadline = time.monotonic() + 30
        while not os.path.exists(socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("echo server did not start")
            time.sleep(0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)
        if os.path.exists(self.socket):
            os.unlink(self.socket)


class BareClient:
    """A DEALER doing one synchronous round trip per call, like ``Client._call``."""

    def __init__(self, socket_path: str, frame_bytes: int):
        import zmq
        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect("ipc://" + socket_path)
        self.frame = os.urandom(frame_bytes)

    def call(self) -> None:
        self.sock.send(self.frame)
        if not self.sock.poll(10_000):
            raise TimeoutError("echo server did not answer")
        self.sock.recv()

    def close(self) -> None:
        self.sock.close(0)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "echo":
    echo_server(sys.argv[2], int(sys.argv[3]))
