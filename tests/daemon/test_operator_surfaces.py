"""Metrics and the block event stream show every tenant's namespaces and block
hashes: only operators (root, the daemon's user, ``admin_group``) read them.

The other user here is what an engine account is to the service: another uid
in the daemon's group (gid 0 for a daemon run by root, as group ``kvtier`` is
for the service user). It runs in its own process, dropped to that uid with
``setresuid``, and tries the real endpoints of a real daemon started under the
unit's ``UMask=0007``. ``nobody`` stands for an operator by group membership
(``admin_group = "nogroup"``, nobody's primary group).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from kvtier.daemon.operators import tcp_peer_uid
from tests.conftest import REPO
from tests.daemon.test_metrics import free_port, scrape_until
from tests.helpers import NS

ENGINE_USER = 41005  # not an operator; member of the daemon's group


def as_user(uid: int, gid: int, code: str) -> str:
    """Run ``code`` as ``uid``/``gid``; its stdout (the test's evidence). Imports come
    first, as root: the interpreter's own files need not be readable by that uid."""
    prologue = ("import os, socket, encodings.idna\n"
                f"os.setgroups([]); os.setresgid({gid}, {gid}, {gid}); os.setresuid({uid}, {uid}, {uid})\n")
    out = subprocess.run([sys.executable, "-c", prologue + code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


SCRAPE = """
c = socket.create_connection(("127.0.0.1", {port}), timeout=10)
c.sendall(b"GET /metrics HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n")
reply = b""
while chunk := c.recv(65536):
    reply += chunk
status = reply.split(b" ", 2)[1].decode() if reply else "closed"
print(status, {fp!r}.encode() in reply)
"""

CONNECT = """
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({path!r}); print("connected")
except PermissionError as e:
    print("refused", e.errno)
"""


@pytest.fixture
def service_umask():
    """The unit's UMask=0007: before this change the event socket came out 0770."""
    old = os.umask(0o007)
    yield
    os.umask(old)


@pytest.fixture
def open_dir():
    """A directory every user may traverse: what stops another user is the socket's own mode."""
    d = tempfile.mkdtemp(prefix="kvtier-ops-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def need_root():
    if os.geteuid() != 0:
        pytest.fail("needs root to run the other user (CI runs as root)", pytrace=False)


def stored_namespace(d) -> None:
    from kvtier.client import block_hashes
    from tests.helpers import make_kv
    kv = make_kv(seed=5)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * len(kv.tensors), NS)
        assert c.store(block_hashes(list(range(64)), 16), [0, 1, 2, 3]).wait().ok
    kv.close()


def test_another_user_gets_403_from_metrics_and_an_operator_reads_them(daemon_factory):
    need_root()
    port = free_port()
    d = daemon_factory(extra=["--metrics", f"127.0.0.1:{port}"], env={"KVTIER_ADMIN_GROUP": "nogroup"})
    stored_namespace(d)
    fp = NS.fingerprint()
    scrape_until(port, lambda m: any(k[0] == "kvtier_namespace_blocks" for k in m))  # as root: readable
    assert as_user(ENGINE_USER, 0, SCRAPE.format(port=port, fp=fp)) == "403 False"  # before: "200 True"
    nobody = pwd.getpwnam("nobody")
    assert as_user(nobody.pw_uid, nobody.pw_gid, SCRAPE.format(port=port, fp=fp)) == "200 True"
    assert f"metrics scrape from uid {ENGINE_USER} refused" in d.read_log()


def test_the_event_socket_is_0600_and_another_user_in_the_daemons_group_cannot_connect(
        daemon_factory, service_umask, open_dir):
    need_root()
    path = os.path.join(open_dir, "events.sock")
    daemon_factory(extra=["--events", path])
    assert os.stat(path).st_mode & 0o777 == 0o600  # before: 0770 under UMask=0007
    assert as_user(ENGINE_USER, 0, CONNECT.format(path=path)) == "refused 13"  # before: "connected"
    assert as_user(0, 0, CONNECT.format(path=path)) == "connected"


def test_with_an_admin_group_the_event_socket_is_theirs_too(daemon_factory, service_umask, open_dir):
    need_root()
    path = os.path.join(open_dir, "events.sock")
    daemon_factory(extra=["--events", "ipc://" + path], env={"KVTIER_ADMIN_GROUP": "nogroup"})
    st = os.stat(path)
    nobody = pwd.getpwnam("nobody")
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, nobody.pw_gid)
    assert as_user(nobody.pw_uid, nobody.pw_gid, CONNECT.format(path=path)) == "connected"
    assert as_user(ENGINE_USER, 0, CONNECT.format(path=path)) == "refused 13"


def test_a_tcp_event_endpoint_is_logged_as_readable_by_whoever_reaches_it(daemon_factory):
    port = free_port()
    d = daemon_factory(extra=["--events", f"tcp://127.0.0.1:{port}"])
    assert "reads every tenant's block events" in d.read_log()


@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"),
                                          (socket.AF_INET6, "::")])
def test_the_kernel_names_the_uid_behind_a_local_tcp_peer(family, host):
    """IPv4, IPv6, and an IPv4 client of a dual-stack listener (seen as ::ffff:127.0.0.1)."""
    with socket.socket(family) as srv:
        try:
            srv.bind((host, 0))
        except OSError as exc:
            pytest.fail(f"{host} unavailable here: {exc}", pytrace=False)
        srv.listen()
        port = srv.getsockname()[1]
        target = "127.0.0.1" if host == "::" else host
        with socket.create_connection((target, port)) as cli:
            conn, peer = srv.accept()
            with conn:
                assert tcp_peer_uid(peer, conn.getsockname()) == os.geteuid()
                assert cli.fileno() >= 0
    assert tcp_peer_uid(("10.255.255.1", 40000), ("127.0.0.1", port)) is None  # not a socket of this machine
