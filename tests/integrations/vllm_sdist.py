"""vLLM's own test files, fetched from its PyPI source distribution at test time.

No vLLM code lives in this repository: the first run downloads the sdist of
the pinned version (checked against its sha256), unpacks only the offloading
tests and the helpers they import into a cache directory, and later runs
reuse it. Where the cache is empty and PyPI cannot be reached, the caller
skips with the reason and how to provide the file.

Cache: ``$KVTIER_VLLM_TESTS_CACHE``, else ``$XDG_CACHE_HOME/kvtier`` (or
``~/.cache/kvtier``; the temp dir where that is read-only). An already downloaded sdist can be named with
``$KVTIER_VLLM_SDIST`` (no network needed).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request

VERSION = "0.32.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/d5/df/"
             f"5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-{VERSION}.tar.gz")
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"

# What the offloading tests import from vLLM's tests package (and no more:
# vLLM's top-level tests/conftest.py pulls in dependencies the CPU build lacks).
MEMBERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/conftest.py",
    "tests/v1/kv_connector/unit/utils.py",
    "tests/v1/kv_connector/unit/test_offloading_connector.py",
    "tests/v1/kv_connector/unit/offloading_connector/",
    "tests/v1/kv_offload/",
)


class Unavailable(Exception):
    """The files are not cached and cannot be fetched; the message says why."""


def cache_root() -> str:
    explicit = os.environ.get("KVTIER_VLLM_TESTS_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "kvtier")
    try:
        os.makedirs(root, exist_ok=True)
        return root
    except OSError:  # a read-only home (some CI runners): the temp dir still caches per machine
        return os.path.join(tempfile.gettempdir(), "kvtier-cache")


def tests_root() -> str:
    """A directory holding vLLM's ``tests`` package (the offloading part)."""
    root = os.path.join(cache_root(), f"vllm-{VERSION}-tests")
    if os.path.exists(os.path.join(root, ".complete")):
        return root
    os.makedirs(cache_root(), exist_ok=True)
    sdist = _sdist()
    staging = tempfile.mkdtemp(prefix=".vllm-tests-", dir=cache_root())
    try:
        _unpack(sdist, staging)
        open(os.path.join(staging, ".complete"), "w").close()
        try:
            os.rename(staging, root)
        except OSError:  # another run finished first: keep its copy
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _sdist() -> str:
    given = os.environ.get("KVTIER_VLLM_SDIST")
    if given:
        if _sha256(given) != SDIST_SHA256:
            raise Unavailable(f"$KVTIER_VLLM_SDIST={given} is not vllm-{VERSION}.tar.gz (sha256 differs)")
        return given
    path = os.path.join(cache_root(), f"vllm-{VERSION}.tar.gz")
    if os.path.exists(path) and _sha256(path) == SDIST_SHA256:
        return path
    part = path + f".part{os.getpid()}"
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=60) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except OSError as exc:
        raise Unavailable(f"vLLM {VERSION}'s test files are not cached under {cache_root()} and PyPI is "
                          f"unreachable ({exc}); set KVTIER_VLLM_SDIST to a downloaded vllm-{VERSION}.tar.gz") \
            from None
    if _sha256(part) != SDIST_SHA256:
        os.unlink(part)
        raise Unavailable(f"{SDIST_URL} does not match its pinned sha256")
    os.replace(part, path)
    return path


def _unpack(sdist: str, dest: str) -> None:
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist, "r:gz") as tar:
        chosen = []
        for m in tar.getmembers():
            name = m.name.removeprefix(prefix)
            if m.isfile() and any(name == w or (w.endswith("/") and name.startswith(w)) for w in MEMBERS):
                m.name = name
                chosen.append(m)
        tar.extractall(dest, members=chosen, filter="data")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
