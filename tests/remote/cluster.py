"""A real Redis Cluster of three masters on loopback, from the redis-server binary.

Used by the remote-tier tests and ``scripts/bench_remote.py``. Each master
keeps its cluster config (``nodes.conf``) in its own directory, so
``kill()`` followed by ``start()`` brings the same cluster back (empty: no
persistence), the way a restarted production cluster comes back.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def why_missing() -> str | None:
    """Why a cluster cannot run here, or None."""
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        return "redis-server/redis-cli not on PATH: apt-get install -y redis-server (see .ci/run)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "python package 'redis' missing: pip install 'kvtier[remote]'"
    return None


def _free_port() -> int:
    """A port free on loopback whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a Redis cluster node")


class LocalCluster:
    def __init__(self, masters: int = 3, maxmemory: str = "", policy: str = "noeviction", password: str = ""):
        self.dir = tempfile.mkdtemp(prefix="kvtier-rc-")
        self.ports = [_free_port() for _ in range(masters)]
        self.maxmemory, self.policy = maxmemory, policy
        self.password = password  # AUTH required of every client (and the masters among themselves)
        self.procs: list[subprocess.Popen] = []
        self.start()
        self._run_cli("--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                      "--cluster-replicas", "0", "--cluster-yes")
        self.wait_ok()

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        self.procs = [self._spawn(port) for port in self.ports]
        for port in self.ports:
            self._wait_port(port)

    def _spawn(self, port: int) -> subprocess.Popen:
        d = os.path.join(self.dir, str(port))
        os.makedirs(d, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000", "--dir", d,
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--logfile", os.path.join(d, "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill_master(self, i: int) -> None:
        """SIGKILL master ``i`` alone: its slots fail, the other masters keep running."""
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def restart_master(self, i: int) -> None:
        """Master ``i`` back on its port, empty, rejoining from its nodes.conf; then wait_ok()."""
        self.procs[i] = self._spawn(self.ports[i])
        self._wait_port(self.ports[i])

    def _wait_port(self, port: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), 0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not start: {self.logs()}")

    def _run_cli(self, *args: str, port: int | None = None) -> str:
        cmd = ["redis-cli"] + (["-p", str(port)] if port else []) + list(args)
        env = {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stdout}{out.stderr}")
        return out.stdout

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every master reports cluster_state:ok (the readiness probe after create or restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all("cluster_state:ok" in self._run_cli("cluster", "info", port=p) for p in self.ports):
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok after {timeout}s: {self.logs()}")

    def client(self, password: str | None = None):
        """A redis-py cluster client; ``password`` defaults to the cluster's own."""
        from redis.cluster import ClusterNode, RedisCluster
        password = self.password if password is None else password
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in self.ports],
                            **({"password": password} if password else {}))

    def kill(self) -> None:
        """SIGKILL every master (no shutdown, no save): the cluster is gone at once."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.procs = []

    def logs(self) -> str:
        out = []
        for port in self.ports:
            path = os.path.join(self.dir, str(port), "redis.log")
            if os.path.exists(path):
                with open(path) as f:
                    out.append(f"--- {port}\n" + "".join(f.readlines()[-15:]))
        return "\n".join(out)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
