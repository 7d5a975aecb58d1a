"""The socket directory: the daemon uses only one that nobody else can write
to, never follows a planted link, never deletes what is not its socket; a
client talks only to a socket of the expected daemon user."""

from __future__ import annotations

import os
import socket

import pytest

from kvtier.client import Client, DaemonUnavailable
from kvtier.client.handover import UntrustedSocket, hand_over
from tests.conftest import DaemonProc
from tests.helpers import make_kv

ROOT = os.geteuid() == 0


def test_a_directory_others_may_write_to_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)  # e.g. an attacker pre-created it, or a shared /tmp subdirectory
    with pytest.raises(RuntimeError, match="lets group or others write"):
        DaemonProc(tmp_path, socket=str(run / "kvtier.sock"))


@pytest.mark.skipif(not ROOT, reason="a directory of another user needs root to create")
def test_a_directory_of_another_user_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chown(run, 41007, 41007)
    with pytest.raises(RuntimeError, match="belongs to uid 41007"):
        DaemonProc(tmp_path, socket=str(run / "kvtier.sock"))


def test_a_planted_lock_link_is_not_followed(tmp_path):
    victim = tmp_path / "victim-file"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    os.symlink(victim, tmp_path / "kvtier.sock.lock")
    with pytest.raises(RuntimeError, match="lock file"):
        DaemonProc(tmp_path, socket=str(tmp_path / "kvtier.sock"))
    assert victim.read_text() == "precious" and os.stat(victim).st_mode & 0o777 == 0o644


def test_a_file_at_the_socket_path_is_never_deleted(tmp_path):
    path = tmp_path / "kvtier.sock"
    path.write_text("not a socket")
    with pytest.raises(RuntimeError, match="not a socket of ours"):
        DaemonProc(tmp_path, socket=str(path))
    assert path.read_text() == "not a socket"


def test_a_client_refuses_a_socket_of_an_unexpected_user(daemon, monkeypatch):
    """With KVTIER_DAEMON_USER naming another uid, the real daemon's socket is
    refused before HELLO (no token leaves) and before any memory is handed over."""
    monkeypatch.setenv("KVTIER_DAEMON_USER", "41008")
    with pytest.raises(UntrustedSocket):
        Client(daemon.socket, timeout=2)
    kv = make_kv()
    with pytest.raises(UntrustedSocket):
        hand_over(daemon.socket, kv.fds())
    monkeypatch.setenv("KVTIER_DAEMON_USER", str(os.getuid()))
    with Client(daemon.socket, timeout=5) as c:  # the expected user: served
        c.ping()


def test_a_fake_daemon_never_gets_the_token_or_the_memory(tmp_path, monkeypatch):
    """A socket swapped in by someone else (here: a directory others may write
    to) is refused by the client before it sends a byte."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(run / "kvtier.sock"))
    fake.listen(1)
    fake.setblocking(False)
    with pytest.raises(DaemonUnavailable, match="directory"):
        Client(str(run / "kvtier.sock"), timeout=1, token="s3cret")
    with pytest.raises(BlockingIOError):  # nobody ever connected
        fake.accept()
    fake.close()
