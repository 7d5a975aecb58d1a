"""A private kvtier daemon in a subprocess, for the demo and the benchmarks.

The daemon runs as its own process (as in production) on a socket in a fresh
temporary directory, so it never collides with a system daemon. It runs the
same ``kvtier`` package as the caller (PYTHONPATH points at it; its cwd is its own directory).

Primitive: ``with PrivateDaemon(pool_size="1GiB") as d: Client(d.socket)``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

import kvtier

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvtier.__file__)))


class PrivateDaemon:
    def __init__(self, pool_size: str = "256MiB", slab_size: str = "8MiB", extra: tuple = (),
                 log_level: str = "WARNING", timeout: float = 60.0, env: dict | None = None):
        self.dir = tempfile.mkdtemp(prefix="kvtier-private-")
        self.socket = os.path.join(self.dir, "kvtier.sock")
        self.log_path = os.path.join(self.dir, "daemon.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p), **(env or {})}
        cmd = [sys.executable, "-m", "kvtier.daemon", "--socket", self.socket, "--pool-size", pool_size,
               "--slab-size", slab_size, "--log-level", log_level, *extra]
        self._log = open(self.log_path, "w")
        # Its own directory as cwd: with ``-m`` the cwd comes first on sys.path, so a caller in
        # another checkout's directory would otherwise start that checkout's daemon.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.dir)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        # The socket appears after the pool is reserved and prefaulted.
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.read_log()
                self.stop()
                raise RuntimeError(f"kvtier daemon did not start: {log.strip()[-2000:]}")
            time.sleep(0.02)

    def read_log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def heap_bytes(self) -> int:
        """Resident private memory of the daemon (RSS minus shared pages, so the
        pool and mapped KV segments do not count): the index's own footprint."""
        info = psutil.Process(self.proc.pid).memory_info()
        return info.rss - info.shared

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode

    def __enter__(self) -> "PrivateDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
