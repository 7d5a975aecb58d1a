"""The systems ``scripts/bench_peers.py`` compares: how each one's service and engines start.

* ``alone``          - vLLM, no connector (the baseline of every ratio);
* ``kvtier``         - kvtier's connector, a private ``kvtier-daemon``;
* ``lmcache-<mode>`` - ``LMCacheMPConnector`` and a private ``lmcache server`` in that
  CPU transfer mode (``lmcache_driven``, the server's default; ``engine_driven``,
  the worker's default: both sides are told the same mode);
* ``vllm-offload``   - vLLM's own ``OffloadingConnector`` with its ``CPUOffloadingSpec``;
* ``vllm-simple``    - vLLM's ``SimpleCPUOffloadConnector``.

A system is a ``kv_transfer_config`` for its engines plus, for the two with a
node service, that service's process. Every engine is a ``peers_engine.py``
process with the same arguments but that config. ``Engine.wait_ready`` says
whether vLLM could build it and, if not, the exception it raised: that is how
the benchmark finds out which peers run on the CPU build.
"""

from __future__ import annotations

import json
import os
import shutil
import socket as socketlib
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENGINE = os.path.join(HERE, "peers_engine.py")
LMCACHE_VENV = os.path.join(REPO, ".venv-lmcache")
LMCACHE_MODES = ("lmcache_driven", "engine_driven")
ALL = ("alone", "kvtier", *(f"lmcache-{m}" for m in LMCACHE_MODES), "vllm-offload", "vllm-simple")
# LMCache sends usage data by default; the benchmark never does.
NO_TRACKING = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def lmcache_python() -> str | None:
    """The peers' venv (``scripts/peers_venv.sh``) when it exists and has LMCache."""
    py = os.path.join(LMCACHE_VENV, "bin", "python")
    if os.path.exists(py) and os.path.exists(os.path.join(LMCACHE_VENV, "bin", "lmcache")):
        return py
    return None


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A node service (kvtier's daemon, LMCache's server): its process and how long it took to start."""

    def __init__(self, name: str, proc: subprocess.Popen, start_s: float, log: str):
        self.name, self.proc, self.start_s, self.log = name, proc, start_s, log

    def cpu_s(self) -> float:
        import psutil
        try:
            p = psutil.Process(self.proc.pid)
            procs = [p, *p.children(recursive=True)]
            return sum(sum(x.cpu_times()[:2]) for x in procs)
        except psutil.Error:
            return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_kvtier(tmp: str, pool: str, env: dict, config: str = "") -> tuple[Service, dict]:
    """A private daemon (``config``: its TOML file; none: defaults, never the host's);
    returns it and the connector config that points vLLM at it."""
    sys.path.insert(0, os.path.join(REPO, "client"))
    import vllm_offline
    from benchlib import no_system_config
    sock = os.path.join(tmp, "kvtier.sock")
    log = os.path.join(tmp, "kvtier-daemon.log")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.daemon", "--socket", sock, "--pool-size", pool,
                             *(["--config", config] if config else no_system_config())], env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    _wait_for(lambda: os.path.exists(sock), proc, log, "kvtier-daemon")
    return Service("kvtier", proc, time.perf_counter() - t0, log), vllm_offline.kv_transfer_config(sock, 32)


def start_lmcache(tmp: str, mode: str, l1_gb: float, env: dict, extra: list[str] = (),
                  port: int | None = None) -> tuple[Service, dict]:
    """A private ``lmcache server`` (its own port; ``port``: the one a restarted server keeps,
    where its engines reconnect) in CPU transfer mode ``mode``."""
    port = port or free_port()
    log = os.path.join(tmp, f"lmcache-{mode}.log")
    cmd = [os.path.join(LMCACHE_VENV, "bin", "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--http-port", str(free_port()),  # its admin API (default 8080: two servers would collide)
           "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--chunk-size", "256",
           "--supported-transfer-mode", mode, *extra]
    if mode == "engine_driven":  # without a segment name it sends every block pickled over ZeroMQ
        cmd += ["--shm-name", f"lmcache-bench-{os.getpid()}-{port}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**env, **NO_TRACKING}, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    _wait_for(lambda: _listening(port), proc, log, "lmcache server")
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                                              "lmcache.mp.mp_transfer_mode": mode}}
    service = Service(f"lmcache-{mode}", proc, time.perf_counter() - t0, log)
    service.port = port
    return service, transfer


def vllm_offload(kind: str, cpu_bytes: int) -> dict:
    """vLLM's own CPU offloading (in the engine's process: no service, no cross-process store)."""
    if kind == "vllm-offload":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                              "block_size": 32}}
    return {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}


def kv_bytes_per_token(args) -> int:
    """KV bytes per token of the benchmark's model (make_tiny_llama: head size 64, hidden/128
    KV heads, bfloat16)."""
    return args.layers * 2 * max(1, args.hidden // 128) * 64 * 2


def _listening(port: int) -> bool:
    with socketlib.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(ready, proc: subprocess.Popen, log: str, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start; {log}:\n" + open(log).read()[-3000:])
        time.sleep(0.05)


class Engine:
    """A ``peers_engine.py`` process; ``call(op, **kw)`` -> its JSON answer."""

    def __init__(self, system: str, role: str, python: str, model: str, transfer: dict | None, env: dict,
                 tmp: str, kv_bytes: int, max_model_len: int):
        self.system, self.name, self.transfer = system, f"{system}/{role}", transfer
        cmd = [python, ENGINE, "--model", model, "--kv-bytes", str(kv_bytes), "--max-model-len", str(max_model_len)]
        if transfer:
            cmd += ["--transfer", json.dumps(transfer)]
        self.log = os.path.join(tmp, f"{system}-{role}.log")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, env=env)
        self.ready: dict | None = None
        self.failed: str = ""
        self.lock = threading.Lock()

    def wait_ready(self) -> bool:
        """True when vLLM built the engine; False with ``failed`` = the exception it raised."""
        seen: list[str] = []  # vLLM logs to stdout: the root cause is there, not in the front end's exception
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.ready = json.loads(line[6:])
                return True
            if line.startswith("FAILED "):
                self.failed = json.loads(line[7:])["error"]
                break
            seen.append(line)
        self.proc.wait()
        with open(self.log, "a") as f:
            f.writelines(seen)
        cause = _last_error(seen)
        self.failed = f"{cause} ({self.failed})" if cause and cause not in self.failed else self.failed or cause
        return False

    def call(self, op: str, **kw) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            for line in self.proc.stdout:
                if line.startswith("RESULT "):
                    return json.loads(line[7:])
        raise RuntimeError(f"engine {self.name} exited; {self.log}:\n" + open(self.log).read()[-3000:])

    def ttft(self, prompt: list[int]) -> float:
        return self.call("ttft", prompt=prompt)["s"]

    def pids(self) -> list[int]:
        """The engine's processes: the front end and vLLM's engine core / worker under it."""
        import psutil
        try:
            p = psutil.Process(self.proc.pid)
            return [p.pid, *(c.pid for c in p.children(recursive=True))]
        except psutil.Error:
            return []

    def close(self) -> None:
        from benchlib import quit_engine
        quit_engine(self.proc)


def _last_error(lines: list[str]) -> str:
    """The first exception an engine's output names (vLLM's engine core fails in a child
    process, logged with a ``(EngineCore pid=N) ERROR`` prefix; the front end then raises
    only 'Engine core initialization failed')."""
    for x in lines:
        text = x.split("] ", 1)[-1].strip() if "ERROR" in x else x.strip()
        head = text.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return text[:500]
    return "exited with no READY line"


def rss_mib(pids: list[int]) -> dict:
    """Resident memory of processes, summed: RSS (shared pages counted in each) and PSS (shared split)."""
    import psutil
    rss = pss = 0
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
            rss, pss = rss + m.rss, pss + getattr(m, "pss", m.rss)
        except psutil.Error:
            continue
    return {"rss_mib": round(rss / 2**20), "pss_mib": round(pss / 2**20)}


def which(name: str) -> str | None:
    return shutil.which(name)
