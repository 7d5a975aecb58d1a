"""Names the daemon creates in /dev/shm cannot be taken from it (issue 30, rows 4-5).

/dev/shm is writable by every user. Another uid that plants a file or a
symlink at a name the daemon is about to use must never stop it from
starting: the daemon either picks a name nobody could have guessed (its
pool) or refuses what it finds at its fixed name (the warm-restart pair) and
starts cold, with a log line. Real daemon processes, a real other uid.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.warm import warm_names
from kvtier.pool.segment import unlink_segment
from tests.conftest import DaemonProc
from tests.daemon.test_attacks import serves_a_good_client
from tests.daemon.test_warm_restart import WARM, start_warm_daemon_as

OTHER_UID = 41009
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant files as another uid")

AS_OTHER_USER = """
import os, sys
uid = int(sys.argv[1]); os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
exec(sys.argv[2])
"""


def as_other_user(code: str, uid: int = OTHER_UID) -> str:
    out = subprocess.run([sys.executable, "-c", AS_OTHER_USER, str(uid), code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_root
def test_files_planted_at_the_next_pids_pool_names_do_not_stop_the_daemon(tmp_path):
    """The attacker reads ns_last_pid (world-readable) and plants an empty file at
    /dev/shm/kvtier-pool.<pid> for each of the next 3,000 pids: the daemon that
    starts next has one of those pids. Before: it refused to start ("exists").
    After: its pool's name has a random part, it starts and serves."""
    first = int(open("/proc/sys/kernel/ns_last_pid").read()) + 1
    planted = range(first, first + 3000)
    as_other_user(f"""
for pid in range({first}, {first + 3000}):
    os.close(os.open(f"/dev/shm/kvtier-pool.{{pid}}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
""")
    d = None
    try:
        d = DaemonProc(tmp_path)
        assert d.proc.pid in planted, "the attack missed: the daemon's pid was not among the planted names"
        assert os.stat(f"/dev/shm/kvtier-pool.{d.proc.pid}").st_uid == OTHER_UID  # left alone
        assert serves_a_good_client(d)
        (pool,) = glob.glob(f"/dev/shm/kvtier-pool.{d.proc.pid}.*")
        assert os.stat(pool).st_uid == os.geteuid()
        print(f"\n3000 squatted pool names: daemon pid {d.proc.pid} started with {os.path.basename(pool)}")
    finally:
        if d is not None:
            d.stop()
        for pid in planted:
            unlink_segment(f"/kvtier-pool.{pid}")


@needs_root
@pytest.mark.parametrize("which", ["journal", "both"])
def test_a_symlink_at_a_kept_segments_name_starts_the_daemon_cold(tmp_path, which):
    """Another user points a symlink from the warm-restart journal's (or both kept
    segments') predictable name at a file of its choosing. Before: ``cannot start: [Errno 40]
    Too many levels of symbolic links``, at every restart. After: the link is
    refused (never followed), removed, and the daemon starts cold and serves."""
    sock = str(tmp_path / "warm.sock")
    names = warm_names(DaemonConfig(socket=sock))
    links = ["/dev/shm" + n for n in (names if which == "both" else names[1:])]
    target = str(tmp_path / "victim-file")
    open(target, "wb").write(b"not the attacker's")
    as_other_user(f"for link in {links!r}: os.symlink({target!r}, link)")
    d = None
    try:
        d = DaemonProc(tmp_path, socket=sock, env=WARM)
        w = d.stats()["warm_restart"]
        assert w["start"] == "cold" and "Too many levels of symbolic links" in w["reason"]
        assert not any(map(os.path.islink, links)) and open(target, "rb").read() == b"not the attacker's"
        assert serves_a_good_client(d)
        assert "warm restart: starting cold" in d.read_log()
    finally:
        if d is not None:
            d.stop()
        for name in names:
            unlink_segment(name)


@needs_root
def test_a_symlink_an_unprivileged_daemon_cannot_remove_means_no_warm_restart_not_no_daemon(tmp_path, monkeypatch):
    """Run as its own user the daemon cannot unlink another user's link in the
    sticky /dev/shm: it runs with an unguessable pool and without warm restart."""
    daemon_uid = 41010
    run = tempfile.mkdtemp(prefix="kvt-names-")
    os.chown(run, daemon_uid, daemon_uid)
    sock = os.path.join(run, "kvtier.sock")
    names = warm_names(DaemonConfig(socket=sock), uid=daemon_uid)
    as_other_user(f"os.symlink('/etc/passwd', {'/dev/shm' + names[1]!r})")
    log = open(tmp_path / "daemon.log", "w")
    p = start_warm_daemon_as(daemon_uid, sock, log)
    try:
        from kvtier.client import Client
        monkeypatch.setenv("KVTIER_DAEMON_USER", str(daemon_uid))
        with Client(sock, name="probe", timeout=10) as c:
            assert c.stats()["warm_restart"] == {"enabled": False}
        assert os.path.islink("/dev/shm" + names[1])  # not ours to remove; never followed
        assert "running without warm restart" in (tmp_path / "daemon.log").read_text()
    finally:
        p.terminate()
        p.wait(30)
        log.close()
        for name in names:
            unlink_segment(name)
        shutil.rmtree(run, ignore_errors=True)
