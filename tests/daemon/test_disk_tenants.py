"""The disk tier between tenants (issue 30, rows 10-11): a tenant is shown only
its own disk errors, and its flush removes its blocks from disk too, also
the namespaces a restart left on disk only.

Real daemon processes as root with socket mode 0666, engines as other uids
(they import as root, then drop to their uid for good), a real full tmpfs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO, DaemonProc
from tests.daemon.test_disk_attacks import tiny_fs  # noqa: F401 (a fixture)
from tests.daemon.test_disk_tier import block_files, chain, disk_env, scanned
from tests.daemon.test_reaping import wait_for
from tests.daemon.test_tenants import ATTACKER, VICTIM

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: engines as other uids, a tmpfs")

ENGINE = """
import hashlib, json, sys, time
sys.path.insert(0, {repo!r})
from kvtier.client import Client, KVTierError
from tests.daemon.test_disk_tier import chain
from tests.helpers import NS, block_bytes, make_kv
from tests.privileges import drop_to
drop_to({uid})
sock, action, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
hs = chain(7, n)
kv = make_kv(seed=31 if action == "store" else None)
digest = lambda: hashlib.sha256(b"".join(t.numpy().tobytes() for t in block_bytes(kv, range(n)))).hexdigest()
with Client(sock, name="engine-" + action, timeout=10) as c:
    out = {{}}
    if action == "store":  # and wait until the disk tier took the writes (written or failed)
        c.register_kv_cache(kv, [0] * 4, NS)
        out["ok"] = c.store(hs, list(range(n))).wait().ok
        while c.stats()["disk"]["queued_bytes"]:
            time.sleep(0.05)
        out["digest"] = digest()
    elif action == "load":
        c.register_kv_cache(kv, [0] * 4, NS)
        out["hits"] = c.lookup(hs)
        out["loaded"] = c.load(hs, list(range(n))).wait().done
        out["digest"] = digest()
    elif action in ("flush", "flush-ns"):
        try:
            out["removed"] = c.flush(NS if action == "flush-ns" else None)
        except KVTierError as exc:
            out["error"] = exc.code.name
    out["disk"] = c.stats()["disk"]
print(json.dumps(out))
"""


def engine(sock: str, uid: int, action: str, n: int = 16) -> dict:
    out = subprocess.run([sys.executable, "-c", ENGINE.format(repo=REPO, uid=uid), sock, action, str(n)],
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.fixture
def run_dir():
    """A socket directory other users can reach (root's, 0755)."""
    run = tempfile.mkdtemp(prefix="kvt-disk-tenants-")
    os.chmod(run, 0o755)
    yield run
    shutil.rmtree(run, ignore_errors=True)


def shared(tmp_path, run_dir, disk_path, size="64MiB") -> DaemonProc:
    env = {"KVTIER_SOCKET_MODE": "666", **disk_env(disk_path, size)}
    return DaemonProc(tmp_path, pool_size="2MiB", slab_size="1MiB", env=env,
                      socket=os.path.join(run_dir, "kvtier.sock"))


@needs_root
def test_another_tenant_never_sees_the_victims_disk_errors(tmp_path, run_dir, tiny_fs):  # noqa: F811
    """The victim's writes fail on a full disk; the error names the file (its
    tenant's namespace digest and the block hash). The attacker's stats show
    the pool-wide counters but not that message; the victim and the operator
    see it."""
    d = shared(tmp_path, run_dir, tiny_fs / "disk")
    try:
        victim = engine(d.socket, VICTIM, "store", 32)
        assert victim["ok"] and victim["disk"]["enospc"] > 0
        hashes = [h.hex() for h in chain(7, 32)]
        mine = victim["disk"]["last_errors"]["enospc"]
        assert "No space left" in mine and any(h in mine for h in hashes)
        attacker = engine(d.socket, ATTACKER, "stats")["disk"]
        print(f"\nattacker's disk.last_errors: {attacker['last_errors']!r}; enospc counter {attacker['enospc']}")
        assert attacker["enospc"] == victim["disk"]["enospc"]  # pool-wide figures are everyone's
        assert attacker["last_errors"] == {}
        assert not any(h in json.dumps(attacker) for h in hashes)
        assert "No space left" in d.stats()["disk"]["last_errors"]["enospc"]  # the operator sees all
    finally:
        d.stop()


@needs_root
@pytest.mark.parametrize("how", ["flush", "flush-ns"])
def test_a_tenants_flush_after_a_restart_removes_its_blocks_on_disk(tmp_path, run_dir, how):
    """The victim's 16 blocks reach the disk; the daemon restarts (RAM empty,
    the namespace is on disk only). Another tenant's flush removes none of them;
    the victim's flush() or flush(NS) removes all 16, files included, and they
    never load again. Before: 0 removed / UNKNOWN_NAMESPACE, files kept."""
    root = tmp_path / "disk"
    d = shared(tmp_path, run_dir, root)
    try:
        stored = engine(d.socket, VICTIM, "store")
        assert stored["disk"]["written"] == 16
    finally:
        d.stop()
    d = shared(tmp_path, run_dir, root)
    try:
        assert scanned(d) and d.stats()["disk"]["blocks"] == 16
        other = engine(d.socket, ATTACKER, how)
        assert other.get("removed", 0) == 0 and len(block_files(root)) == 16
        flushed = engine(d.socket, VICTIM, how)
        print(f"\nvictim's {how} after a restart: removed {flushed.get('removed')}")
        assert flushed.get("removed") == 16, flushed
        assert wait_for(lambda: block_files(root) == [])
        after = engine(d.socket, VICTIM, "load")
        assert (after["hits"], after["loaded"]) == (0, 0)
        assert engine(d.socket, VICTIM, "flush-ns")["error"] == "UNKNOWN_NAMESPACE"  # nothing left to name
    finally:
        d.stop()
