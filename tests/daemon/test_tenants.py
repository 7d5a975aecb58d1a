"""Tenancy: another user gets no byte of a victim's KV in or out, sharing works where declared.

As root the workers run as numeric uids (``setresuid`` in the child): a
victim, an attacker, a friend the operator put in the victim's tenant, and
the victim's own user again. Without root only the same-user half runs (the
cross-user half is skipped, with that reason).
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

WORKER = os.path.join(REPO, "tests", "daemon", "tenant_worker.py")
VICTIM, ATTACKER, FRIEND = 41001, 41002, 41003
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="cross-user isolation needs root to run workers as other uids")


@pytest.fixture
def shared_daemon(tmp_path):
    """A daemon other users can reach: socket dir 0755 (root's), socket 0666."""
    run = tempfile.mkdtemp(prefix="kvt-tenants-")
    os.chmod(run, 0o755)
    env = {"KVTIER_SOCKET_MODE": "666", "KVTIER_TENANTS": f"team:{VICTIM},{FRIEND}"}
    d = DaemonProc(tmp_path, env=env, socket=os.path.join(run, "kvtier.sock"))
    yield d
    d.stop()
    shutil.rmtree(run, ignore_errors=True)


def worker(role: str, socket: str, uid: int | None, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    """The worker drops to ``uid`` itself (setresuid) once its imports are done."""
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    args = [sys.executable, WORKER, role, socket] + ([str(uid)] if uid is not None else [])
    return subprocess.Popen(args, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def lines(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return {d["step"]: d for d in map(json.loads, out.splitlines())}


def start_victim(socket: str, uid: int | None):
    v = worker("victim", socket, uid, stdin=subprocess.PIPE)
    stored = json.loads(v.stdout.readline() or "null")
    assert stored and stored["step"] == "stored", v.stderr.read()[-3000:] if v.poll() is not None else stored
    return v, stored


def finish_victim(v) -> dict:
    v.stdin.write("go\n")
    v.stdin.flush()
    return lines(v)["checked"]


@needs_root
def test_another_user_cannot_read_probe_flush_or_poison_the_victims_cache(shared_daemon):
    """The attacker uses the victim's fingerprint and hashes: it sees none of the
    victim's namespaces or clients, gets 0 hits and no bytes, flushes nothing of
    the victim's, cannot open the pool or name memory, and its forged blocks
    never reach the victim, whose engine memory stays untouched."""
    socket = shared_daemon.socket
    v, stored = start_victim(socket, VICTIM)
    a = lines(worker("attacker", socket, ATTACKER))["attacked"]
    assert a["sees_namespaces"] == [] and a["sees_clients"] == ["attacker"]
    assert a["flush_all"] == "ok" and a["flush_ns"] == "UNKNOWN_NAMESPACE"
    assert a["hits"] == 0 and a["loaded"] == 0 and a["got_zeros_only"]
    assert a["forged_stored"] == 4  # into the attacker's own namespace only
    assert a["by_name"] == "BAD_ARGUMENT"
    assert a["pools_opened"] == []
    checked = finish_victim(v)
    assert checked == {"step": "checked", "untouched": True, "loaded": 4, "same": True}
    # A later reader of the victim's user gets the victim's bytes, not the forgery.
    r = lines(worker("reader", socket, VICTIM))["read"]
    assert (r["hits"], r["loaded"], r["digest"]) == (4, 4, stored["digest"])
    assert r["digest"] != a["forged_digest"]
    # The operator sees both tenants' namespaces side by side.
    tenants = sorted(n["tenant"] for n in shared_daemon.stats()["namespaces"])
    assert tenants == ["team", f"uid{ATTACKER}"]


@needs_root
def test_users_the_operator_put_in_one_tenant_share_the_cache(shared_daemon):
    """The friend is another uid in the victim's declared tenant: it hits and
    loads the victim's blocks byte for byte."""
    v, stored = start_victim(shared_daemon.socket, VICTIM)
    r = lines(worker("reader", shared_daemon.socket, FRIEND))["read"]
    assert (r["hits"], r["loaded"], r["digest"]) == (4, 4, stored["digest"])
    assert finish_victim(v)["same"]


def test_processes_of_one_user_share_the_cache(shared_daemon):
    """Two engines of the same user (the common case) still share prefixes."""
    uid = VICTIM if ROOT else None
    v, stored = start_victim(shared_daemon.socket, uid)
    r = lines(worker("reader", shared_daemon.socket, uid))["read"]
    assert (r["hits"], r["loaded"], r["digest"]) == (4, 4, stored["digest"])
    assert finish_victim(v) == {"step": "checked", "untouched": True, "loaded": 4, "same": True}


def test_a_ticket_is_good_only_for_the_process_that_handed_the_memory_over(shared_daemon):
    """Memory handed over by one process cannot be registered by another, even
    of the same user (a leaked ticket is worth nothing)."""
    from kvtier.client import KVTierError
    from kvtier.protocol import ErrorCode
    from kvtier.protocol import messages as m
    code = ("import sys; sys.path.insert(0, %r); from tests.helpers import make_kv, ticket_for;"
            "kv = make_kv(); print(ticket_for(%r, kv))" % (REPO, shared_daemon.socket))
    ticket = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": REPO}).stdout.strip()
    from tests.helpers import NS, make_kv
    kv = make_kv()
    with shared_daemon.client() as c:
        with pytest.raises(KVTierError) as exc:
            c.channel.call(m.Register(NS.fingerprint(), kv.specs([0] * 4), ticket=ticket))
        assert exc.value.code == ErrorCode.UNAUTHORIZED and "another process" in exc.value.message
        with pytest.raises(KVTierError) as exc:  # and it was used up by the attempt
            c.channel.call(m.Register(NS.fingerprint(), kv.specs([0] * 4), ticket=ticket))
        assert "unknown or expired" in exc.value.message


def test_unused_tickets_per_user_are_capped(shared_daemon):
    """Handing memory over without registering it cannot pile descriptors up
    in the daemon: a user holds at most 8 unused tickets."""
    from kvtier.client import KVTierError
    from kvtier.client.handover import hand_over
    from tests.helpers import make_kv
    kv = make_kv()
    tickets = [hand_over(shared_daemon.socket, kv.fds()) for _ in range(8)]
    with pytest.raises(KVTierError, match="too many unused tickets"):
        hand_over(shared_daemon.socket, kv.fds())
    assert len(set(tickets)) == 8
