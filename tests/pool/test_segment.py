"""Named POSIX shared-memory segments: lifetime, mode, fail-fast, stale cleanup."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from kvtier.pool import SegmentError, ShmSegment, cleanup_stale, unlink_segment

from .conftest import PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 2**20


def shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_create_open_close_unlink(shm_name):
    seg = ShmSegment(shm_name, MiB, create=True)
    assert seg.size == MiB and os.path.getsize(shm_path(shm_name)) == MiB
    seg.buffer[:5] = b"hello"
    # Another process opens it by name and sees (and writes) the same bytes.
    child = run_python(f"""
        from kvtier.pool import ShmSegment
        s = ShmSegment({shm_name!r})
        print(bytes(s.buffer[:5]).decode(), s.size)
        s.buffer[{MiB - 1}] = ord("!")
        s.close()
    """)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["hello", str(MiB)]
    assert seg.buffer[MiB - 1] == ord("!")
    # A non-owner close only unmaps; the owner's close also unlinks.
    reader = ShmSegment("/" + shm_name)
    reader.close()
    assert reader.closed and os.path.exists(shm_path(shm_name))
    with pytest.raises(SegmentError, match="closed"):
        reader.buffer
    seg.close()
    assert seg.closed and not os.path.exists(shm_path(shm_name))
    with pytest.raises(SegmentError):
        ShmSegment(shm_name)


def test_create_refuses_existing_and_bad_sizes(shm_names):
    name = shm_names()
    seg = ShmSegment(name, MiB, create=True)
    try:
        with pytest.raises(SegmentError):
            ShmSegment(name, MiB, create=True)  # exclusive create
        assert os.path.exists(shm_path(name))  # the failed create did not unlink it
    finally:
        seg.close()
    for size in (0, -1):
        with pytest.raises(SegmentError, match="positive"):
            ShmSegment(shm_names(), size, create=True)
    with pytest.raises(SegmentError):
        ShmSegment(shm_names())  # open of a name that does not exist


@pytest.mark.parametrize("mode, umask", [(0o600, 0o022), (0o640, 0o077), (0o660, 0o000)])
def test_created_with_requested_mode_regardless_of_umask(shm_name, mode, umask):
    old = os.umask(umask)
    try:
        seg = ShmSegment(shm_name, MiB, create=True, mode=mode)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(shm_path(shm_name)).st_mode) == mode
    finally:
        seg.close()


def test_oversize_segment_fails_fast_and_leaves_nothing(shm_name):
    vfs = os.statvfs("/dev/shm")
    huge = 10 * vfs.f_blocks * vfs.f_frsize
    t0 = time.monotonic()
    with pytest.raises(SegmentError, match=r"cannot reserve .*/dev/shm") as err:
        ShmSegment(shm_name, huge, create=True)
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0, f"took {elapsed:.1f}s: the reservation is not failing fast"
    assert str(huge) in str(err.value)
    assert not os.path.exists(shm_path(shm_name))


def test_cleanup_stale_removes_dead_owners_only(shm_names):
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()  # reaped: its pid is no longer alive
    dead = ShmSegment(shm_names(exited.pid), MiB, create=True)
    live = ShmSegment(shm_names(), MiB, create=True)
    nopid = ShmSegment(shm_names("nopid"), MiB, create=True)
    try:
        removed = cleanup_stale(PREFIX)
        # Other sessions' dead test segments may be swept too; ours must be.
        assert dead.name.lstrip("/") in removed
        assert live.name.lstrip("/") not in removed and nopid.name.lstrip("/") not in removed
        assert not os.path.exists(shm_path(dead.name))
        assert os.path.exists(shm_path(live.name)) and os.path.exists(shm_path(nopid.name))
    finally:
        for seg in (dead, live, nopid):
            seg.close()
    assert not os.path.exists(shm_path(nopid.name))


def test_close_refuses_while_a_tensor_view_lives(shm_name):
    # In a child process: if close() unmapped under a live tensor, the next
    # write would segfault, and that must not take the test runner down.
    child = run_python(f"""
        import gc, os, torch
        from kvtier.pool import ShmSegment
        seg = ShmSegment({shm_name!r}, 1 << 20, create=True)
        view = torch.frombuffer(seg.buffer, dtype=torch.uint8)[4096:8192]
        try:
            seg.close()
        except BufferError:
            print("refused")
        view.fill_(7)  # the mapping is still there
        assert bytes(seg.buffer[4096:4100]) == bytes([7] * 4) and not seg.closed
        assert os.path.exists("/dev/shm/" + {shm_name!r})
        del view
        gc.collect()
        seg.close()
        print("closed", seg.closed, os.path.exists("/dev/shm/" + {shm_name!r}))
    """)
    assert child.returncode == 0, f"rc={child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.split() == ["refused", "closed", "True", "False"]


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_users_segment_is_refused_not_raised(shm_name):
    # The systemd daemon runs as kvtier; engines' segments belong to their own
    # users in the sticky /dev/shm. posix_ipc reports EACCES as its own
    # PermissionsError, which escaped unlink_segment (reaping a dead engine
    # then failed with INTERNAL) and ShmSegment (not a SegmentError).
    seg = ShmSegment(shm_name, 4096, create=True, mode=0o600)
    pid = os.fork()
    if pid == 0:  # child: become nobody, then try to remove and to open root's segment
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 2 if unlink_segment(shm_name) is False else 3  # refused, not raised
            try:
                ShmSegment(shm_name)
            except SegmentError:
                code = 0 if code == 2 else code
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(f"/dev/shm/{shm_name}")
    seg.close()
    assert not os.path.exists(f"/dev/shm/{shm_name}")
