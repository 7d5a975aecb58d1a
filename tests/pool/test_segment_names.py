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
