# Part of the vLLM benchmarks (bench_vllm.py, bench_vllm_bind.py, bench_vllm_tput.py, bench_peers.py).
"""The benchmarks' side of ``scripts/vllm_engine.py``: an engine process driven over
its stdin/stdout (``Engine``), the settings every engine of a run must share
(``default_bind``, ``settings_diff``, ``compute_threads``), what runs beside them
(``Neighbour``), new prompts (``Prompts``) and one timed call per engine in a
rotating order (``interleave``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading

from benchlib import REPO, quit_engine

sys.path.insert(0, os.path.join(REPO, "client"))
import vllm_offline as ex  # noqa: E402

ENGINE = os.path.join(REPO, "scripts", "vllm_engine.py")
SETTINGS_NOT_COMPARED = ("threads", "pids")  # CPU seconds and pids differ by nature


class Engine:
    """A ``vllm_engine.py`` process; ``call(op, **kw)`` -> its JSON answer."""

    def __init__(self, name: str, model: str, args, extra: list[str], log_dir: str):
        self.name = name
        env = ex.engine_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND=args.omp_bind)
        cmd = [sys.executable, ENGINE, "--model", model, "--max-model-len", str(args.prefix_tokens + 256),
               "--block-size", "32", *extra]
        self.log = os.path.join(log_dir, f"{name}.log")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, env=env)
        self.ready: dict | None = None
        self.lock = threading.Lock()

    def wait_ready(self) -> dict:
        self.ready = self._read("READY ")
        return self.ready

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        raise RuntimeError(f"engine {self.name} exited; log {self.log}:\n" + open(self.log).read()[-3000:])

    def call(self, op: str, **kw) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            return self._read("RESULT ")

    def ttft(self, prompt: list[int]) -> float:
        return self.call("ttft", prompt=prompt)["s"]

    def close(self) -> None:
        quit_engine(self.proc)


def default_bind() -> str:
    """What vLLM's CPU build picks for an engine with no connector: every allowed
    CPU but the last, which it leaves to the engine's other threads."""
    cpus = sorted(os.sched_getaffinity(0))
    keep = cpus[:-1] or cpus
    return ",".join(str(c) for c in keep)


def settings_diff(engines: list[Engine]) -> list[tuple[str, list]]:
    """Leaf settings that differ between the engines: [(dotted key, [value per engine])]."""
    flat = [_flatten({k: v for k, v in e.ready["settings"].items() if k not in SETTINGS_NOT_COMPARED})
            for e in engines]
    keys = sorted(set().union(*flat))
    return [(k, [f.get(k) for f in flat]) for k in keys if len({json.dumps(f.get(k)) for f in flat}) > 1]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def compute_threads(e: Engine) -> list:
    """(name, CPUs) of the engine core's threads that did real work (the OpenMP team)."""
    return [(n, cpus) for n, cpus, s in e.ready["settings"]["threads"] if s > 0.5]


class Neighbour:
    """What else runs on the cores during a block: nothing, a busy loop, or a vLLM engine prefilling."""

    def __init__(self, kind: str, engine: Engine | None, tokens: int):
        self.kind, self.engine, self.tokens = kind, engine, tokens
        self.proc: subprocess.Popen | None = None
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.prompts = 0

    def __enter__(self):
        if self.kind == "busy":
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        elif self.kind == "engine":
            self.thread = threading.Thread(target=self._loop, daemon=True)
            self.thread.start()
        return self

    def _loop(self) -> None:
        rng = random.Random(99)
        while not self.stop.is_set():
            self.engine.ttft([rng.randrange(1, 500) for _ in range(self.tokens)])
            self.prompts += 1

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        if self.thread is not None:
            self.stop.set()
            self.thread.join(120)


class Prompts:
    def __init__(self, tokens: int, seed: int):
        self.rng, self.tokens = random.Random(seed), tokens

    def new(self, n: int | None = None) -> list[int]:
        return [self.rng.randrange(1, 500) for _ in range(n or self.tokens)]


def interleave(step: int, cases: list[tuple[str, callable]]) -> dict[str, float]:
    """Run one timed call per case, rotating the order by ``step``."""
    k = step % len(cases)
    return {name: fn() for name, fn in cases[k:] + cases[:k]}
