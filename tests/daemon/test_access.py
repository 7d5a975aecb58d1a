"""Isolation and access: file modes, socket group, token, checksums."""

from __future__ import annotations

import grp
import os
import stat

import pytest

from kvtier.client import Client, KVTierError
from kvtier.protocol import ErrorCode
from tests.helpers import NS, flip_a_pool_byte, make_kv, pool_segments


def test_socket_and_pool_are_owner_group_only(daemon_factory):
    group = grp.getgrgid(os.getgid()).gr_name
    d = daemon_factory(process=True, env={"KVTIER_SOCKET_GROUP": group})
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    (path,) = pool_segments(d.proc.pid)
    pool = os.stat(path)
    assert stat.S_IMODE(pool.st_mode) == 0o600
    fd_sock = os.stat(d.socket + ".fd")  # the hand-over socket: same audience as the ZeroMQ one
    assert stat.S_IMODE(fd_sock.st_mode) == 0o660 and fd_sock.st_gid == os.getgid()
    # Engine KV memory has no name at all (a sealed memfd handed over as a descriptor):
    # nothing in /dev/shm for another process to open.
    before = set(os.listdir("/dev/shm"))
    kv = make_kv()
    assert set(os.listdir("/dev/shm")) == before and kv.name.startswith("memfd:")
    kv.close()


def test_unknown_socket_group_refuses_to_start(tmp_path):
    from tests.conftest import DaemonProc
    with pytest.raises(RuntimeError, match="socket_group"):
        DaemonProc(tmp_path, env={"KVTIER_SOCKET_GROUP": "no-such-group-kvt"})


def test_token_is_required_when_configured(daemon_factory):
    d = daemon_factory(process=True, env={"KVTIER_TOKEN": "s3cret"})
    with pytest.raises(KVTierError) as exc:
        Client(d.socket, timeout=3)
    assert exc.value.code == ErrorCode.UNAUTHORIZED and exc.value.side == "client"
    with pytest.raises(KVTierError):
        Client(d.socket, timeout=3, token="wrong")
    with Client(d.socket, timeout=3, token="s3cret") as c:
        assert c.stats()["pool"]["capacity_bytes"] > 0
    # Without a session nothing is served when a token is set: no stats, no flush.
    import zmq
    from kvtier.protocol import decode, encode
    from kvtier.protocol import messages as m
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect("ipc://" + d.socket)
    for i, msg in enumerate((m.Stats(), m.Flush())):
        raw.send(encode(msg, i + 1))
        rid, reply = decode(raw.recv())
        assert (rid, reply.code) == (i + 1, ErrorCode.NOT_CONNECTED)
    raw.close(0)
    # The CLI takes the token from --token or $KVTIER_TOKEN.
    from kvtier.cli import main
    assert main(["status", "--json", "--socket", d.socket]) == 1
    assert main(["status", "--json", "--socket", d.socket, "--token", "s3cret"]) == 0


def test_checksum_mismatch_fails_the_load_and_drops_the_block(daemon_factory):
    d = daemon_factory(process=True, env={"KVTIER_CHECKSUMS": "1"})
    kv = make_kv(seed=21)
    hashes = [bytes([i]) * 16 for i in range(4)]
    with d.client() as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hashes, [0, 1, 2, 3]).wait().ok
        assert c.load(hashes, [4, 5, 6, 7]).wait().ok  # intact data verifies
        # Corrupt one byte of block 2 inside the daemon's pool (bit rot, a stray write).
        flip_a_pool_byte(d.proc.pid, kv.tensors[0][2])
        r = c.load(hashes, [4, 5, 6, 7]).wait()
        assert r.failed == (2,)  # reported, so the engine recomputes block 2
        assert c.lookup(hashes) == 2  # the corrupt block is gone
        s = d.stats()
        assert s["errors"]["CHECKSUM"] == 1
    kv.close()
