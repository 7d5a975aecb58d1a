"""Shared fixtures: a real daemon process on a private socket, engine caches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

PROBE = "stats-probe"
# Every daemon the suite starts, in process or as a child, reads no host config:
# a node with the service installed (/etc/kvtier/kvtier.toml) runs the same suite.
os.environ["KVTIER_CONFIG"] = os.devnull
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def daemon_pythonpath() -> str:
    """What a daemon subprocess imports from: this checkout first, then whatever
    the caller's PYTHONPATH names now (a GPU node's dependencies installed with
    ``pip install --target`` are found only through it)."""
    return os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)


# The slowest files first, engine-heavy ones alternating with ones that mostly wait on
# daemons: the test runner (xdist, --dist loadfile) hands files to its workers in
# collection order, so a slow file collected late ran alone at the end (a loaded run
# spent its last 20 minutes on test_vllm.py and the benchmark smoke runs).
SLOWEST_FIRST = (
    "integrations/test_vllm_hybrid.py", "daemon/test_warm_restart.py", "integrations/test_vllm_contract_033.py",
    "daemon/test_kill_matrix.py", "integrations/test_vllm_contract.py", "daemon/test_disk_tenants.py",
    "integrations/test_vllm_tp.py", "daemon/test_disk_trust.py", "integrations/test_vllm.py",
    "e2e/test_trace_replay.py", "e2e/test_bench_peers_smoke.py", "daemon/test_transfer_finality.py",
    "e2e/test_bench_status_smoke.py", "daemon/test_share_attacks.py", "integrations/test_vllm_roles.py",
    "daemon/test_tenant_share.py", "e2e/test_bench_vllm_smoke.py", "e2e/test_bench_hf_smoke.py",
    "e2e/test_benchmarks_smoke.py", "integrations/test_transformers.py", "integrations/test_vllm_events.py",
)


def _slowness_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slowness_rank)  # stable: a file's own tests keep their order
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA; no GPU on this machine")
        for item in items:
            # The marker, not ``item.keywords``: keywords also hold every parent
            # directory name, so a checkout under .../gpu/ would skip everything.
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


class DaemonHandle:
    """What tests use of a daemon, wherever it runs."""

    socket: str

    def client(self, **kw):
        from kvtier.client import Client
        kw.setdefault("timeout", 10.0)
        return Client(self.socket, **kw)

    def stats(self, check: bool = True) -> dict:
        with self.client(heartbeat=False, name=PROBE) as c:
            s = c.stats(check)
        s["clients"] = [c for c in s["clients"] if c["name"] != PROBE]  # not the probe itself
        if check:
            assert s["integrity"] == "ok", s["integrity"]
        return s


class InProcessDaemon(DaemonHandle):
    """The daemon's composed parts in this process, its loop on a thread: no
    interpreter start or torch import (~2 s each). For every test where no
    process boundary (signals, kills, the daemon's own pid) is under test.
    Takes the same arguments as ``DaemonProc``: ``extra`` flags and ``KVTIER_*`` env."""

    def __init__(self, tmp_path, pool_size="64MiB", slab_size="4MiB", extra=(), env=None, socket=None):
        import logging
        import threading

        from kvtier.daemon.config import load_config
        from kvtier.daemon.main import FLAG_KEYS, build_parser
        from kvtier.daemon.server import Daemon
        self.socket = socket or str(tmp_path / f"kvt-{uuid.uuid4().hex[:8]}.sock")
        args = build_parser().parse_args(["--socket", self.socket, "--pool-size", pool_size,
                                          "--slab-size", slab_size, *extra])
        flags = {k: getattr(args, k) for k in FLAG_KEYS}
        config = load_config(args.config, env={"KVTIER_REAP_INTERVAL_S": "0.1", "KVTIER_CONFIG": os.devnull, **(env or {})}, flags=flags)
        self._records: list[str] = []
        self._handler = logging.Handler(logging.INFO)
        self._handler.emit = lambda r: self._records.append(self._handler.format(r))
        self._logger = logging.getLogger("kvtier")
        self._logger.addHandler(self._handler)
        if self._logger.level in (logging.NOTSET,) or self._logger.level > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self.daemon = Daemon(config)
        self._thread = threading.Thread(target=self.daemon.serve_forever, name="kvtier-daemon", daemon=True)
        self._thread.start()

    def read_log(self) -> str:
        return "\n".join(self._records)

    def stop(self, timeout=30.0) -> int:
        if self._thread.is_alive():
            self.daemon.request_stop()
            self._thread.join(timeout)
        self._logger.removeHandler(self._handler)
        return 0


class DaemonProc(DaemonHandle):
    """A kvtier-daemon subprocess; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, tmp_path, pool_size="64MiB", slab_size="4MiB", extra=(), env=None, socket=None):
        self.socket = socket or str(tmp_path / f"kvt-{uuid.uuid4().hex[:8]}.sock")
        self.log_path = tmp_path / f"daemon-{uuid.uuid4().hex[:6]}.log"
        cmd = [sys.executable, "-m", "kvtier.daemon", "--socket", self.socket,
               "--pool-size", pool_size, "--slab-size", slab_size, *extra]
        full_env = {**os.environ, "PYTHONPATH": daemon_pythonpath(), "KVTIER_REAP_INTERVAL_S": "0.1",
                    **(env or {})}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self._wait_ready()

    def _wait_ready(self, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.read_log()}")
            if os.path.exists(self.socket) and "kvtier-daemon pid" in self.read_log():
                return
            time.sleep(0.05)
        self.proc.kill()  # not left running (and holding a pool) once the test has given up on it
        self.proc.wait()
        raise RuntimeError(f"daemon did not start: {self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout=30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def daemon_factory(tmp_path):
    """``start(process=False, **kw)``: an in-process daemon, or with
    ``process=True`` a real ``kvtier-daemon`` subprocess (for signals, kills,
    pids, logs on disk)."""
    started = []

    def start(process: bool = False, **kw):
        d = (DaemonProc if process else InProcessDaemon)(tmp_path, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


@pytest.fixture
def process_daemon(daemon_factory):
    return daemon_factory(process=True)
