"""Engines under other uids than the daemon's (the systemd deployment) get
lookup-mirror hits too: the daemon hands each registration's table to its
process as a read-only descriptor over the hand-over socket. The engine's
uid cannot open the 0600 table by name, cannot write it through the
descriptor; a third uid of another tenant gets the table neither by name nor
by asking, registered or not. As root the workers run as numeric uids
(``setresuid``); without root the test is skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO, DaemonProc

WORKER = os.path.join(REPO, "tests", "daemon", "mirror_worker.py")
ENGINE, STRANGER = 41011, 41012
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="other uids need root to run the workers")


@pytest.fixture
def shared_daemon(tmp_path):
    """A daemon other users can reach (socket dir 0755, socket 0666), mirrors on."""
    run = tempfile.mkdtemp(prefix="kvt-mirror-")
    os.chmod(run, 0o755)
    d = DaemonProc(tmp_path, env={"KVTIER_SOCKET_MODE": "666", "KVTIER_LOOKUP_INDEX": "true"},
                   socket=os.path.join(run, "kvtier.sock"))
    yield d
    d.stop()
    shutil.rmtree(run, ignore_errors=True)


def worker(role: str, socket: str, uid: int, *args: str) -> subprocess.Popen:
    env = {"PYTHONPATH": REPO, "HOME": "/tmp", "PATH": os.environ.get("PATH", "")}
    return subprocess.Popen([sys.executable, WORKER, role, socket, str(uid), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def line(p: subprocess.Popen) -> dict:
    got = p.stdout.readline()
    assert got, p.stderr.read()[-3000:] if p.poll() is not None else "no line"
    return json.loads(got)


@needs_root
def test_an_engine_of_another_uid_gets_mirror_hits_and_a_stranger_gets_no_table(shared_daemon):
    socket = shared_daemon.socket
    e = worker("engine", socket, ENGINE)
    try:
        got = line(e)
        # Its own namespace's table, mapped from the handed-over descriptor.
        assert got["mapped"] and got["mirror_hits"] == 4 and got["hits"] == 4
        assert got["mirror_lookups"] == 1  # its mirror lookup reached the daemon's counters
        # The descriptor is read-only and the table stays the daemon's 0600 file.
        assert got["by_name"] == "EACCES"
        assert got["map_shared_write"] == "EACCES"
        assert got["reopen_for_writing"] == "EACCES"
        assert got["write"] == "EBADF" and got["truncate"] in ("EINVAL", "EBADF")
        s = worker("stranger", socket, STRANGER, got["name"])
        out, err = s.communicate(timeout=120)
        assert s.returncode == 0, err[-3000:]
        st = json.loads(out.splitlines()[-1])
        assert st["by_name"] == "EACCES"
        assert st["asked_unregistered"] == "DaemonUnavailable"  # refused: no registration of its own
        assert st["asked_registered"] == "DaemonUnavailable"    # refused: its registration is elsewhere
        assert st["own_mapped"] and st["own_mirror"] != got["name"]  # its own tenant's table
        assert st["hits"] == 0  # the engine's blocks are not in it
        e.stdin.write("go\n")
        e.stdin.flush()
        assert line(e)["mirror_hits"] == 4  # the engine's table is intact
        e.communicate(timeout=60)
        assert e.returncode == 0
    finally:
        if e.poll() is None:
            e.kill()
    assert "refused: no registration of this process uses that mirror" in shared_daemon.read_log()


def raw_request(socket: str, payload, fds=()) -> tuple[dict, list[int]]:
    """One message on the hand-over socket, as a hostile client would send it."""
    import socket as so

    import msgpack
    with so.socket(so.AF_UNIX, so.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(socket + ".fd")
        so.send_fds(s, [payload if isinstance(payload, bytes) else msgpack.packb(payload)], list(fds))
        data, got, _, _ = so.recv_fds(s, 4096, 4)
    return msgpack.unpackb(data), got


def test_bad_mirror_requests_get_an_error_and_no_descriptor(daemon_factory):
    from kvtier.client.errors import DaemonUnavailable
    from kvtier.client.handover import fetch_mirror
    from tests.helpers import NS, make_kv
    off = daemon_factory(env={"KVTIER_LOOKUP_INDEX": "false"})
    with pytest.raises(DaemonUnavailable, match="lookup_index is off"):
        fetch_mirror(off.socket, "/kvtier-ix.0")
    d = daemon_factory(env={"KVTIER_LOOKUP_INDEX": "true"})
    kv = make_kv(seed=23)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        name = c.registration.index
        r, w = os.pipe()
        try:
            for payload, fds in [({"v": 1, "mirror": name}, [r]),       # descriptors attached
                                 ({"v": 1, "mirror": 7}, []),            # not a name
                                 ({"v": 1, "mirror": "x" * 200}, []),    # too long
                                 ({"v": 1, "mirror": "/kvtier-ix.nope"}, []),  # no such table
                                 ({"v": 1, "mirror": "/../../etc/passwd"}, []),
                                 (b"\x00" * 300, [])]:                   # not a request at all
                reply, got = raw_request(d.socket, payload, fds)
                assert "error" in reply and got == [], (payload, reply)
        finally:
            os.close(r)
            os.close(w)
        reply, got = raw_request(d.socket, {"v": 1, "mirror": name})  # this process is registered there
        assert reply == {"mirror": name} and len(got) == 1
        assert os.fstat(got[0]).st_size > 0 and (os.stat(f"/proc/self/fd/{got[0]}").st_mode & 0o777) == 0o600
        flags = int(open(f"/proc/self/fdinfo/{got[0]}").read().split("flags:")[1].split()[0], 8)
        assert flags & os.O_ACCMODE == os.O_RDONLY
        os.close(got[0])
    kv.close()
