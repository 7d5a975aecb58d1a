"""Segment names come from clients: odd ones are refused, never crash the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.pool.segment import SegmentError, ShmSegment, unlink_segment


@pytest.mark.parametrize("name", ["/kvtier-kv.1.a\x00b", "\x00", "/kvtier-kv.\x00"])
def test_nul_in_name_is_refused_not_a_segfault(name):
    # Run in a child: before the fix posix_ipc segfaulted on these names,
    # which took the whole daemon down on one bad REGISTER.
    code = ("import sys; from kvtier.pool.segment import ShmSegment, SegmentError\n"
            f"try:\n    ShmSegment({name!r})\nexcept SegmentError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "NUL byte" in out.stdout, (out.returncode, out.stderr[-500:])
    with pytest.raises(SegmentError):
        ShmSegment(name, 4096, create=True)
    assert unlink_segment(name) is False


def test_a_new_engine_cache_sweeps_its_users_dead_segments():
    """Segments of dead engines of this user go when the next engine starts."""
    import multiprocessing as mp
    import os

    from kvtier.pool.segment import ShmSegment
    from kvtier.transfer.shm import KV_PREFIX, ShmKVCache

    child = mp.get_context("spawn").Process(target=int)
    child.start()
    child.join()
    dead = f"/{KV_PREFIX}{child.pid}.0.dead01"
    ShmSegment(dead, 4096, create=True).release(unlink=False)
    assert os.path.exists("/dev/shm" + dead)
    kv = ShmKVCache([(2, 8)])
    try:
        assert not os.path.exists("/dev/shm" + dead)
    finally:
        kv.close()
