"""A namespace's directory goes once every file queued to be unlinked in it is gone, not
when the job that named the directory is done: a flush or a fit unlinks in slices, one
job each, and two writer threads finish them in any order. The last slice (a few files)
used to finish before the slice ahead of it (thousands) on a loaded machine, its rmdir
found the directory not yet empty, and the directory stayed for good (seen in CI)."""

from __future__ import annotations

import mmap
import os

from kvtier.disk.format import TMP_DIR, ns_dir
from kvtier.disk.io import DiskIO
from tests.daemon.test_reaping import wait_for

NS = "team\x00model|float16"


def until(cond, timeout=30.0) -> bool:
    return wait_for(cond, timeout, interval=0.002)


def test_a_directory_named_by_the_last_of_many_unlink_jobs_goes_once_all_its_files_are_gone(tmp_path):
    root = tmp_path / "disk"
    (root / TMP_DIR).mkdir(parents=True)
    pool = mmap.mmap(-1, 2**20)
    io = DiskIO(str(root), pool, threads=1, direct=False, writers=4)  # four writers: more orders
    d = root / ns_dir(NS)
    try:
        for round_ in range(20):
            d.mkdir()
            big = [str(d / f"a{k}") for k in range(400)]
            last = [str(d / "b")]
            for p in big + last:
                open(p, "wb").close()
            io.unlink(big[:200])
            io.unlink(big[200:])
            io.unlink(last, [NS])  # the last slice names the directory
            assert until(lambda: not d.exists(), 10), (round_, len(os.listdir(d)))
            assert until(lambda: io.counters["unlinked"] == 401 * (round_ + 1)), io.counters
    finally:
        io.close()
        pool.close()

