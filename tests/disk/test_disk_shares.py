"""tenant_share on the disk index, without files: a tenant at its share of
disk_size drops its own oldest files, never another tenant's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import os

from kvtier.disk.format import HEADER_BYTES, encode_header, file_bytes
from kvtier.disk.index import DiskEntry, DiskIndex
from kvtier.pool.keys import SEP

FILE = file_bytes(100)


def entry(tenant, k, seq):
    return DiskEntry(f"{tenant}{SEP}m", k.to_bytes(16, "little"), seq, 100, 0, f"/{tenant}/{k}")


def write(idx, tenant, k, seq) -> list | None:
    """One block written as the bridge does: reserve, then add, then release."""
    victims = idx.reserve(FILE, None, tenant)
    if victims is None:
        return None
    victims += idx.add(entry(tenant, k, seq))
    idx.release(FILE, tenant)
    idx.check_integrity()
    return victims


def test_a_tenant_writing_without_end_drops_only_its_own_oldest_files():
    idx = DiskIndex(capacity=10 * FILE, share=0.5)
    for k in range(4):
        assert write(idx, "bob", k, seq=k) == []
    for k in range(100, 140):
        victims = write(idx, "alice", k, seq=k)
        assert all(v.ns_key.startswith("alice") for v in victims)
    assert len(idx.entries_of(f"bob{SEP}m")) == 4  # every one of bob's files kept
    alice = idx.entries_of(f"alice{SEP}m")
    assert sorted(int.from_bytes(k, "little") for k in alice) == list(range(135, 140))  # her newest 5
    assert idx.shares.usage() == {"alice": 5 * FILE, "bob": 4 * FILE}
    assert idx.shares.own_dropped["alice"] == 35


def test_a_small_block_is_charged_the_whole_pages_its_file_takes(tmp_path):
    """A 256-byte block's file is 4,352 bytes, which the filesystem stores in
    two 4 KiB pages: the tenant is charged 8 KiB, not 4.3 KiB, so a tenant of
    tiny blocks cannot put twice its share of disk_size on the disk."""
    path = tmp_path / "block.kvb"
    path.write_bytes(encode_header(f"alice{SEP}m", bytes(16), 1, 256, 0) + bytes(range(256)))
    taken = os.stat(path).st_blocks * 512  # what this filesystem allocated for it
    assert HEADER_BYTES + 256 < file_bytes(256) == 8192
    assert taken <= file_bytes(256), taken
    assert file_bytes(4096) == 8192 and file_bytes(4097) == 12288  # an aligned payload adds no page

    idx = DiskIndex(capacity=64 * 1024, share=0.5)  # alice's share: 32 KiB, four such files
    for k in range(10):
        e = DiskEntry(f"alice{SEP}m", k.to_bytes(16, "little"), k, 256, 0, f"/alice/{k}")
        assert idx.reserve(e.file_bytes, None, "alice") is not None
        idx.add(e)
        idx.release(e.file_bytes, "alice")
        idx.check_integrity()
    assert len(idx.entries_of(f"alice{SEP}m")) == 4  # 7 with the unrounded 4,352 B charge
    assert idx.shares.usage() == {"alice": 4 * 8192} and idx.used == 32 * 1024


def test_with_the_share_off_one_tenant_drops_everyones_files_as_before():
    idx = DiskIndex(capacity=10 * FILE)
    for k in range(4):
        write(idx, "bob", k, seq=k)
    for k in range(100, 120):
        write(idx, "alice", k, seq=k)
    assert idx.entries_of(f"bob{SEP}m") is None


def test_a_write_larger_than_the_share_is_refused_and_changes_nothing():
    idx = DiskIndex(capacity=10 * FILE, share=0.2)
    write(idx, "alice", 1, seq=1)
    assert idx.reserve(3 * FILE, None, "alice") is None
    assert idx.reserved == 0 and len(idx) == 1
    idx.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([0.3, 0.5, 1.0]),
       st.lists(st.tuples(st.sampled_from(["write", "touch", "flush"]), st.integers(0, 2), st.integers(0, 20)),
                max_size=80))
def test_counters_stay_exact_and_no_tenant_passes_its_share(share, ops):
    idx = DiskIndex(capacity=12 * FILE, share=share)
    for seq, (op, t, k) in enumerate(ops):
        tenant = f"t{t}"
        if op == "write":
            write(idx, tenant, k, seq)
        elif op == "touch":
            e = (idx.entries_of(f"{tenant}{SEP}m") or {}).get(k.to_bytes(16, "little"))
            if e is not None:
                idx.touch(e)
        else:
            idx.drop([f"{tenant}{SEP}m"])
        idx.check_integrity()
        if share < 1:
            assert all(b <= idx.shares.limit for b in idx.shares.used.values())
