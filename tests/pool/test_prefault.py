"""A pool is faulted in on several threads, whole, and a tmpfs too small fails it at once.

``ShmSegment`` faults a segment of ``PARALLEL_MIN`` or more in with
``MADV_POPULATE_WRITE`` on threads (``pool/prefault.py``) instead of
``posix_fallocate`` and ``MAP_POPULATE`` on one. What must hold either way:
every page is allocated before the segment is handed out (no copy later
faults, or dies of SIGBUS on a full /dev/shm), the memory reads zero and
takes writes, and a tmpfs without room is an error, not a signal.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from kvtier.pool.prefault import PARALLEL_MIN, NoRoom, populate, threads_for
from kvtier.pool.segment import SHM_DIR, ShmSegment, unique_name
from tests.conftest import REPO


def test_a_pool_sized_segment_is_whole_before_it_is_handed_out():
    name = unique_name("kvtier-test-prefault.")
    seg = ShmSegment(name, PARALLEL_MIN, create=True)
    try:
        st = os.stat(SHM_DIR + name)
        assert st.st_size == PARALLEL_MIN
        assert st.st_blocks * 512 >= PARALLEL_MIN  # every page allocated, none left to fault later
        t = torch.frombuffer(seg.buffer, dtype=torch.uint8)
        assert int(t[:: 1 << 20].sum()) == 0 and int(t[-1]) == 0
        t[-4096:] = 7
        assert int(t[-1]) == 7
        del t
    finally:
        seg.close()
    assert not os.path.exists(SHM_DIR + name)


def test_threads_follow_the_size_and_the_cores():
    assert threads_for(64 << 20) == 1
    assert 1 <= threads_for(1 << 40) <= min(16, os.cpu_count())


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "tmpfs"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_tmpfs_without_room_is_an_error_not_a_signal(small_tmpfs):
    path = small_tmpfs / "pool"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 128 << 20)  # four times what the tmpfs may hold
        mm = mmap.mmap(fd, 128 << 20, flags=mmap.MAP_SHARED)
        with pytest.raises(NoRoom) as err:
            populate(mm, 128 << 20, "the test pool", threads=2)
        assert "is /dev/shm large enough?" in str(err.value)
        mm.close()  # populate let go of the mapping
    finally:
        os.close(fd)


NO_ROOM = """
import os, sys
from kvtier.pool.segment import SHM_DIR, SegmentError, ShmSegment, unique_name
from kvtier.pool.prefault import PARALLEL_MIN
try:
    ShmSegment(unique_name("kvtier-test-prefault."), PARALLEL_MIN, create=True)
    print("created")
except SegmentError as exc:
    print("refused", "large enough" in str(exc), sorted(os.listdir(SHM_DIR)))
"""


def test_a_pool_bigger_than_dev_shm_fails_the_start_and_leaves_nothing():
    # A /dev/shm of 256 MiB (a private mount, this process only) for a 1 GiB pool.
    out = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=256m tmpfs /dev/shm && "
                          f"exec {sys.executable} -c '{NO_ROOM}'"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    if out.returncode != 0 and "mount" in out.stderr:
        pytest.skip(f"needs root to mount a private /dev/shm: {out.stderr.strip()}")
    assert out.stdout.strip() == "refused True []", out.stderr
