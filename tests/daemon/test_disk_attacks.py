"""The disk tier under attack and under failure: files damaged, swapped,
planted or handed to another user are never served and are deleted; another
user can neither write into disk_path nor read a tenant's blocks back from it;
a full disk and a hung disk fail disk blocks as values while RAM hits go on;
a daemon killed mid-write never serves a torn block to the next one. Real
daemons, real files, real other uids, a real full filesystem."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

from tests.conftest import REPO, DaemonProc
from tests.daemon.test_disk_tier import block_files, chain, disk_env, scanned, written
from tests.daemon.test_reaping import wait_for
from tests.daemon.test_tenants import ATTACKER, VICTIM, finish_victim, lines, start_victim, worker
from tests.helpers import NS, block_bytes, make_kv

OTHER_UID = 41008
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root: other uids, chown, mount")


def restarted(daemon_factory, tmp_path, env, **kw):
    """A fresh daemon on the same disk_path (its RAM pool empty), its scan done."""
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=env, **kw)
    assert scanned(d)
    return d


def store_to_disk(d, kv, hs) -> list:
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(len(hs)))).wait().ok
        assert written(d, len(hs))
    return block_bytes(kv, range(len(hs)))


def file_of(root, key: bytes) -> str:
    return next(f for f in block_files(root) if os.path.basename(f).startswith(key.hex()))


@needs_root
def test_files_damaged_swapped_or_given_away_after_the_scan_are_never_served(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB")
    kv = make_kv(seed=11)
    hs = chain(1, 8)
    want = store_to_disk(daemon_factory(env=env), kv, hs)
    d = restarted(daemon_factory, tmp_path, env)
    files = [file_of(root, k) for k in hs]
    with open(files[1], "r+b") as f:  # one payload bit flipped
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 1]))
    os.truncate(files[2], 4096 + 10)  # torn
    shutil.copyfile(files[7], files[3])  # another block's file under this name: valid, but not this block
    os.chown(files[4], OTHER_UID, OTHER_UID)  # another user's file
    os.chmod(files[5], 0o666)  # a file others could have written
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(hs) == 8  # the index does not know yet: lookups never touch the disk
        for t in kv.tensors:
            t.zero_()
        r = c.load(hs, list(range(8))).wait()
        assert sorted(r.failed) == [1, 2, 3, 4, 5]
        got = block_bytes(kv, range(8))
        for i in (0, 6, 7):
            assert all(torch.equal(got[i * 4 + j], want[i * 4 + j]) for j in range(4))
        for i in (1, 2, 3, 4, 5):  # nothing of a rejected block reached the engine
            assert all(not got[i * 4 + j].any() for j in range(4))
        assert c.lookup(hs) == 1  # the chain now ends where the first bad file was
    s = d.stats()["disk"]
    assert s["rejected"] == 5 and s["blocks"] == 3
    assert wait_for(lambda: [os.path.exists(f) for f in files] == [True] + [False] * 5 + [True, True])
    assert "rejected and deleted" in d.read_log()


@needs_root
def test_files_planted_in_disk_path_are_deleted_by_the_scan(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB")
    kv = make_kv(seed=12)
    hs = chain(2, 6)
    want = store_to_disk(daemon_factory(env=env), kv, hs)
    files = [file_of(root, k) for k in hs]
    nsdir = os.path.dirname(files[0])
    planted = {
        "junk": os.path.join(nsdir, "not-a-block.kvb"),
        "renamed": os.path.join(nsdir, os.path.basename(files[5]).replace(hs[5].hex(), chain(9, 1)[0].hex())),
        "fifo": os.path.join(nsdir, chain(9, 2)[1].hex() + "-" + "0" * 16 + ".kvb"),
        "torn_tmp": os.path.join(root, "tmp", "123-abc-1.tmp"),
    }
    with open(planted["junk"], "wb") as f:
        f.write(os.urandom(5000))
    shutil.copyfile(files[5], planted["renamed"])  # a valid file under another block's name
    os.mkfifo(planted["fifo"], 0o600)  # would hang a reader that opened it blindly
    with open(planted["torn_tmp"], "wb") as f:
        f.write(b"half a write")
    os.chown(files[4], OTHER_UID, OTHER_UID)
    os.truncate(files[3], 4096 + 7)
    d = restarted(daemon_factory, tmp_path, env)
    s = d.stats()["disk"]
    assert (s["blocks"], s["scan_rejected"]) == (4, 5)  # junk, renamed, fifo, another uid's, truncated
    assert not any(os.path.exists(p) for p in planted.values())
    assert [os.path.exists(f) for f in files] == [True, True, True, False, False, True]
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.lookup(hs) == 3
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs[:3], list(range(3))).wait().ok
        assert all(torch.equal(a, b) for a, b in zip(want[:12], block_bytes(kv, range(3))))


@needs_root
def test_another_user_can_neither_write_into_disk_path_nor_load_a_tenants_disk_blocks(tmp_path):
    root = tmp_path / "disk"
    run = tempfile.mkdtemp(prefix="kvt-disk-tenants-")
    os.chmod(run, 0o755)
    os.chmod(tmp_path, 0o755)  # the other uid may reach disk_path's door, not open it
    env = {"KVTIER_SOCKET_MODE": "666", **disk_env(root, "16MiB")}
    sock = os.path.join(run, "kvtier.sock")
    try:
        d = DaemonProc(tmp_path, env=env, socket=sock)
        v, stored = start_victim(sock, VICTIM)
        assert finish_victim(v)["same"]
        assert written(d, 4)
        d.stop()
        d = DaemonProc(tmp_path, env=env, socket=sock)  # RAM empty: the victim's blocks are on disk only
        assert scanned(d)
        a = lines(worker("attacker", sock, ATTACKER))["attacked"]
        assert a["hits"] == 0 and a["loaded"] == 0 and a["got_zeros_only"]
        r = lines(worker("reader", sock, VICTIM))["read"]
        assert (r["hits"], r["loaded"], r["digest"]) == (4, 4, stored["digest"])
        nsdir = os.path.dirname(block_files(root)[0])
        plant = (f"import os, sys\nsys.path.insert(0, {REPO!r})\nfrom tests.privileges import drop_to\n"
                 f"drop_to({OTHER_UID})\nfor p in sys.argv[1:]:\n    try:\n"
                 "        open(os.path.join(p, 'x.kvb'), 'wb')\n        print('wrote', p)\n"
                 "    except PermissionError:\n        print('refused', p)\n")
        out = subprocess.run([sys.executable, "-c", plant, str(root), nsdir, os.path.join(root, "tmp")],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.split().count("refused") == 3, out
        d.stop()
    finally:
        shutil.rmtree(run, ignore_errors=True)


def mounted_tmpfs(tmp_path, size: str):
    """A tmpfs of ``size`` at tmp_path/mnt for the test's length (a generator for fixtures)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


@pytest.fixture
def tiny_fs(tmp_path):
    """A 192 KiB tmpfs: room for 9 files of a 16 KiB block."""
    yield from mounted_tmpfs(tmp_path, "192k")


@needs_root
def test_a_full_disk_fails_writes_as_values_and_ram_hits_go_on(daemon_factory, tiny_fs):
    d = daemon_factory(pool_size="2MiB", slab_size="1MiB", env=disk_env(tiny_fs / "disk", "64MiB"))
    kv = make_kv(seed=13)
    hs = chain(3, 32)
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        assert c.store(hs, list(range(32))).wait().ok
        want = block_bytes(kv, range(32))
        assert wait_for(lambda: d.stats()["disk"]["queued_bytes"] == 0)
        s = d.stats()["disk"]
        assert s["enospc"] > 0 and s["written"] + s["enospc"] == 32 and s["blocks"] == s["written"]
        assert "No space left" in s["last_errors"]["enospc"]
        assert c.lookup(hs) == 32
        for t in kv.tensors:
            t.zero_()
        assert c.load(hs, list(range(32))).wait().ok  # from RAM
        assert all(torch.equal(a, b) for a, b in zip(want, block_bytes(kv, range(32))))
    assert os.listdir(tiny_fs / "disk" / "tmp") == []  # failed writes leave nothing behind
    assert "disk tier enospc" in d.read_log()


@needs_root
def test_a_hung_disk_times_out_its_loads_and_never_holds_up_ram_hits(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "16MiB", disk_timeout_s=0.5)
    kv = make_kv(seed=14)
    hung, other = chain(4, 4), chain(5, 4)
    d0 = daemon_factory(env=env)
    want = store_to_disk(d0, kv, hung + other)
    d0.stop()
    d = restarted(daemon_factory, tmp_path, env)
    fifo = file_of(root, hung[0])
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)  # opening it blocks until a writer comes: a read stuck in the kernel
    with d.client(name="engine", timeout=30.0) as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        ram = chain(6, 8)
        assert c.store(ram, list(range(16, 24))).wait().ok
        r = c.load(hung, list(range(4))).wait()  # answered at the deadline, not when the disk answers
        assert not r.ok and sorted(r.failed) == [0, 1, 2, 3]
        r = c.load(other, list(range(4, 8))).wait()  # a read is still stuck: fail at once
        assert sorted(r.failed) == [0, 1, 2, 3]
        assert c.load(ram, list(range(24, 32))).wait().ok  # RAM hits go on
        s = d.stats()["disk"]
        assert s["timed_out"] == 4 and s["fail_fast"] == 4 and (s["loads_waiting"], s["reads_in_flight"]) == (0, 1)
        threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True).start()  # the disk answers
        assert wait_for(lambda: d.stats()["disk"]["reads_in_flight"] == 0)
        for t in kv.tensors:
            t[4:8].zero_()
        assert c.load(other, list(range(4, 8))).wait().ok  # the disk serves again
        assert all(torch.equal(a, b) for a, b in zip(want[16:], block_bytes(kv, range(4, 8))))
    assert d.stats()["disk"]["rejected"] == 1  # the FIFO: not a regular file, deleted


@needs_root
def test_sigkill_mid_write_never_serves_a_torn_block(daemon_factory, tmp_path):
    root = tmp_path / "disk"
    env = disk_env(root, "64MiB")
    sock = str(tmp_path / "d.sock")
    kv = make_kv(seed=15)
    d = daemon_factory(process=True, socket=sock, env=env)
    want = {}
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(1, 9):  # stored back to back: writes are queued and running at the kill
            for t in kv.tensors:
                t.add_(1)
            hs = chain(tag, 32)
            assert c.store(hs, list(range(32))).wait().ok
            want.update(zip(hs, (block_bytes(kv, [i]) for i in range(32))))
        # Three files at least, of 256 (the rest queued or being written): two are damaged
        # below and one must be left to serve. On a loaded machine the niced writers had
        # sometimes written two by the kill, and nothing was left to serve.
        assert wait_for(lambda: len(block_files(root)) >= 3, 30)
        d.stop(signal.SIGKILL)
    files = block_files(root)
    assert files
    # What a power loss could leave besides: a renamed file whose data never reached the disk.
    os.truncate(files[0], 4096 + 1000)
    with open(files[-1], "r+b") as f:
        f.seek(4096)
        f.write(bytes(4096))
    d = daemon_factory(process=True, socket=sock, env=env)
    assert scanned(d)
    assert os.listdir(root / "tmp") == []
    served = 0
    with d.client(name="engine") as c:
        c.register_kv_cache(kv, [0] * 4, NS)
        for tag in range(1, 9):
            hs = chain(tag, 32)
            for t in kv.tensors:
                t.zero_()
            r = c.load(hs, list(range(32))).wait()
            bad = set(r.failed)
            for i, k in enumerate(hs):
                got = block_bytes(kv, [i])
                if i in bad:
                    assert all(not g.any() for g in got)
                else:
                    assert all(torch.equal(a, b) for a, b in zip(got, want[k]))
                    served += 1
    assert served > 0
    assert d.stats()["disk"]["rejected"] >= 1  # the zeroed payload, caught at read
