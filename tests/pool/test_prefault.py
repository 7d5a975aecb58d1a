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


# ---- serving while the rest faults in (prefault = "background") ------------------------------

def test_a_pool_serving_while_it_faults_in_hands_out_only_slabs_whose_pages_are_in():
    """The first part is in when the segment is handed out; the allocator opens the rest's
    slabs only as the background says their pages are in, prefix first, until all are."""
    from kvtier.pool.allocator import SlabAllocator
    size, slab = PARALLEL_MIN + (512 << 20), 64 << 20
    name = unique_name("kvtier-test-prefault.")
    seg = ShmSegment(name, size, create=True, serve_after=PARALLEL_MIN // 2)
    try:
        bg = seg.background
        assert bg is not None and bg.start == PARALLEL_MIN // 2
        alloc = SlabAllocator(size, slab, bg.done)
        cls = alloc.add_class(slab)
        seen, opened = [], alloc.opened
        while True:
            done = bg.take()
            assert done >= bg.start and done % slab == 0 or done == size
            alloc.open_to(done)
            assert alloc.opened == done // slab >= opened  # only what is in, and never less
            opened = alloc.opened
            seen.append(done)
            if not bg.running:
                break
            select_on(bg.fd)
        assert bg.finished and not bg.error and alloc.opened == size // slab and alloc.faulting_bytes == 0
        st = os.stat(SHM_DIR + name)
        assert st.st_blocks * 512 >= size  # every page in now
        offsets = alloc.alloc_many(cls, size // slab)
        assert sorted(offsets) == [i * slab for i in range(size // slab)]  # every slab usable
        alloc.check_integrity()
    finally:
        seg.close()  # stops the threads first (they hold the mapping)
    assert not os.path.exists(SHM_DIR + name)


def select_on(fd: int) -> None:
    import select
    select.select([fd], [], [], 5.0)


def test_slabs_past_what_is_in_are_neither_free_nor_used_until_opened():
    from kvtier.pool.allocator import SlabAllocator
    slab = 1 << 20
    a = SlabAllocator(8 * slab, slab, usable=3 * slab + 5)  # 3 whole slabs in
    cls = a.add_class(slab)
    assert (a.opened, a.faulting_bytes, a.free_bytes) == (3, 5 * slab, 3 * slab)
    assert sorted(a.alloc_many(cls, 8)) == [0, slab, 2 * slab]  # the pool is "full" at what is in
    a.check_integrity()
    a.free(slab)
    assert a.open_to(2 * slab) == 0 and a.open_to(6 * slab) == 3
    got = a.alloc_many(cls, 8)
    assert got[0] == slab and sorted(got) == [slab, 3 * slab, 4 * slab, 5 * slab]  # freed first, then new
    a.check_integrity()
    a.slabs[7].cls = 0  # a block where the pages are not in: caught
    with pytest.raises(Exception, match="before its pages are in"):
        a.check_integrity()


BACKGROUND_NO_ROOM = """
import mmap, os, sys, select
from kvtier.pool.prefault import Background
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 128 << 20)
mm = mmap.mmap(fd, 128 << 20, flags=mmap.MAP_SHARED)
bg = Background(mm, 128 << 20, "the test pool", start=8 << 20, threads=2, chunk=8 << 20)
while bg.running:
    select.select([bg.fd], [], [], 5.0)
    bg.take()
print(bg.done >> 20, bg.finished, bg.error)
bg.stop()
mm.close()
"""


def test_a_tmpfs_filling_while_the_rest_faults_in_stops_the_pool_at_what_is_in(small_tmpfs):
    """No signal, no crash: the background stops with the tmpfs full, says why, and what it
    counts as in is a prefix below what the tmpfs holds."""
    out = subprocess.run([sys.executable, "-c", BACKGROUND_NO_ROOM, str(small_tmpfs / "pool")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    done, finished, error = out.stdout.split(" ", 2)
    # The first 8 MiB (start) are never touched here, so the 32 MiB tmpfs can hold pages up to
    # 40 MiB: a run that filled it to its last page counts 40 (seen under load), never more.
    assert finished == "False" and 8 <= int(done) <= 8 + 32 and "is /dev/shm large enough?" in error
