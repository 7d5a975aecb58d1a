"""The remote secret file: the daemon's user alone may read it, or the remote
tier does not start. Real files, real modes and owners, a real daemon process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtier.remote.secret import SecretError, load_secret
from tests.conftest import REPO
from tests.remote.conftest import SECRET, write_secret


def test_a_file_only_the_daemons_user_reads_gives_the_key_and_the_redis_credentials(tmp_path):
    path = write_secret(tmp_path / "s", extra='password = "p@ss"\nusername = "kv"\n', mode=0o400)
    s = load_secret(path)
    assert (s.key, s.password, s.username) == (SECRET, "p@ss", "kv")
    assert "p@ss" not in repr(s) and SECRET.hex() not in repr(s)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o610])
def test_a_file_group_or_others_may_read_is_refused_saying_how_to_fix_it(tmp_path, mode):
    path = write_secret(tmp_path / "s", mode=mode)
    with pytest.raises(SecretError, match=rf"mode {mode:04o} lets group or others (read|write to|run) it.*chmod 0600"):
        load_secret(path)


def test_a_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root to give the file away (CI runs as root)", pytrace=False)
    path = write_secret(tmp_path / "s")
    os.chown(path, 41009, 41009)
    with pytest.raises(SecretError, match="belongs to uid 41009"):
        load_secret(path)


@pytest.mark.parametrize("text, why", [
    ('key = "abcd"\n', "at least 64 hex digits"),
    ('key = "zz' + "0" * 64 + '"\n', "hex digits"),
    ("key = [\n", "not TOML"),
    ('key = "' + "00" * 32 + '"\ntoken = "x"\n', "unknown keys"),
])
def test_a_malformed_file_is_refused(tmp_path, text, why):
    path = tmp_path / "s"
    path.write_text(text)
    path.chmod(0o600)
    with pytest.raises(SecretError, match=why):
        load_secret(str(path))


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(SecretError, match="No such file"):
        load_secret(str(tmp_path / "none"))


def test_the_daemon_refuses_to_start_with_a_group_readable_secret(tmp_path):
    """As installed before this change (0640 root:kvtier): the daemon exits 2 (no restart
    loop under systemd) and its log says which file and what to do."""
    path = write_secret(tmp_path / "remote.secret", mode=0o640)
    env = {**os.environ, "PYTHONPATH": REPO, "KVTIER_REMOTE": "redis://127.0.0.1:1",
           "KVTIER_REMOTE_SECRET_FILE": path}
    out = subprocess.run([sys.executable, "-m", "kvtier.daemon", "--socket", str(tmp_path / "d.sock"),
                          "--pool-size", "8MiB", "--slab-size", "1MiB"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"remote_secret_file {path}: mode 0640 lets group or others read it" in out.stderr
    assert not os.path.exists(tmp_path / "d.sock")
