"""Warm restart: the pool and a journal of its committed blocks outlive the
daemon (``warm_restart = true``); the next daemon adopts them.

Names. The kept pool is ``/kvtier-warm.<h>`` and its journal
``/kvtier-warm.<h>.journal``, ``h`` a hash of the daemon's user and socket
(one pair per daemon instance on a node; the pid-named stale cleanup never
touches them).

Adoption (at start, before the socket is bound). Both segments must be
regular, owned by the daemon's user, have exactly ``shm_mode`` and the
expected sizes (checked on the opened descriptor), and the journal header
must name the same format version, pool size and slab size. Then every valid
record becomes a READY block of its namespace (tenant and fingerprint as
recorded), claimed at its offset: no copy, no prefault (the mapping faults
pages in as they are read). Anything else - a setting changed, a segment
of another user or mode, a damaged header, a symlink or anything else planted
at either name - starts cold: one log line says why, the old segments are
unlinked and new ones made. A name the daemon cannot unlink (another user's,
when the daemon is not root: /dev/shm is sticky) means no warm restart this
run (a pool with an unguessable name instead), never a failed start.

Verification: each record carries the checksum (pool/checksum.py) of its block taken when its
store's copy finished; an adopted block is checked at its first load, on
the copy thread, before its bytes are reported loaded (a mismatch reports
the block missing and drops it). Checking at adoption would read the whole
pool before the first hit (BENCHMARKS.md has both costs).

Not kept: swap (offloaded requests belong to connections that die with the
daemon: their slots are free after a restart), stores still in flight, blocks
stored from CUDA registrations or fetched from the remote tier (no crc is
taken for them on the store path), and blocks beyond the journal's record
count (``journal.full``).

Primitives: ``warm_names(config)``, ``WarmPool(config).open() -> ShmSegment``,
``.adopt(index, crcs, tiers) -> [entry]``, ``.committed(plan, crcs)``, ``.removed(entry)``,
``.to_verify(op)``, ``.verified(offsets)``, ``.stats()``, ``.close()``;
``discard_kept(config)`` (warm_restart off: the kept pair goes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

from ..ownership import distrust, ours
from ..pool.index import is_ready
from ..pool.journal import Journal, journal_bytes
from ..pool.segment import SHM_DIR, SegmentError, ShmSegment, unlink_segment
from ..pool.sizes import format_size

log = logging.getLogger("kvtier.daemon")
WARM_PREFIX = "kvtier-warm."


def warm_names(config, uid: int | None = None) -> tuple[str, str]:
    """The kept pool's and journal's names for this daemon's user (or ``uid``) and socket."""
    uid = os.geteuid() if uid is None else uid
    h = hashlib.sha256(f"{uid}:{config.socket}".encode()).hexdigest()[:16]
    return f"/{WARM_PREFIX}{h}", f"/{WARM_PREFIX}{h}.journal"


def discard_kept(config) -> None:
    """``warm_restart`` is off: a pool an earlier daemon kept is memory nobody will use."""
    for name in warm_names(config)[::-1]:  # journal first: a pool without one is never adopted
        if unlink_segment(name):
            log.info("warm_restart is off: removed the kept segment %s", name)


class WarmPool:
    def __init__(self, config):
        self.config = config
        self.pool_name, self.journal_name = warm_names(config)
        self.segment = self.jsegment = self.journal = None
        self.start = "cold"
        self.reason = ""
        self.adopted = self.rejected = self.verify_failed = 0
        self.adopted_at: float | None = None
        self.adopt_s = 0.0
        self.handover_s = 0.0  # handing the adopted blocks to the lower tiers (after adopt_s)
        self.unverified: dict[int, int] = {}  # adopted offset -> crc32 at commit, until its first load

    # ---- start ---------------------------------------------------------------------------
    def kept_bytes(self) -> int:
        """Bytes of a kept pool of ours (its pages are already counted as used RAM)."""
        try:
            st = os.stat(SHM_DIR + self.pool_name, follow_symlinks=False)
        except OSError:
            return 0
        return 0 if distrust(st, "regular file", ours(), deny=0) else st.st_size

    def open(self) -> ShmSegment | None:
        """The pool segment: the kept one when it fits these settings, else a new one;
        None when a kept name is blocked (the daemon makes a pool of an unguessable name instead)."""
        t0 = time.monotonic()
        why = self._open_kept()
        if not why:
            self.start = "warm"
            self.adopt_s = time.monotonic() - t0
            return self.segment
        self.reason = why
        log.warning("warm restart: starting cold: %s", why)
        self._close_maps()
        for name in (self.journal_name, self.pool_name):
            unlink_segment(name)
        size = self.config.pool_size
        try:
            self.segment = ShmSegment(self.pool_name, size, create=True, mode=self.config.shm_mode)
            self.jsegment = ShmSegment(self.journal_name, journal_bytes(size), create=True,
                                       mode=self.config.shm_mode)
        except Exception as exc:
            if self.segment is not None:
                self.segment.close(unlink=True)
                self.segment = None
            if not isinstance(exc, SegmentError) or not any(
                    os.path.lexists(SHM_DIR + n) for n in (self.pool_name, self.journal_name)):
                raise  # no room: the caller reports it
            # A name is held by something we cannot remove (another user's file or link, in
            # the sticky /dev/shm): run without warm restart rather than not at all.
            self.reason += f"; {exc}: running without warm restart"
            log.error("warm restart: %s", self.reason)
            return None
        self.journal = Journal.create(self.jsegment.buffer, size, self.config.slab_size)  # header last
        return self.segment

    def _open_kept(self) -> str:
        """"" when both kept segments were opened and the journal fits; else why not."""
        size, mode = self.config.pool_size, self.config.shm_mode
        if not any(os.path.lexists(SHM_DIR + n) for n in (self.pool_name, self.journal_name)):
            return "no pool was kept"
        try:
            # The journal first, sized by its header: its reason names the setting that changed.
            self.jsegment = ShmSegment(self.journal_name, check=_vet(None, mode), populate=False)
            journal, why = Journal.open(self.jsegment.buffer, size, self.config.slab_size)
            if journal is None:
                return why
            self.segment = ShmSegment(self.pool_name, check=_vet(size, mode), populate=False)
        except SegmentError as exc:
            return f"refusing the kept pool: {exc}"
        self.journal = journal
        return ""

    def adopt(self, index, crcs: dict | None = None, tiers=()) -> list:
        """Make the journal's valid records READY blocks of ``index`` (fresh, empty) and hand
        them to the lower ``tiers`` (``adopted(entries)``: each writes those it lacks, since a
        SIGKILL may have left them unwritten); the adopted entries, oldest commit first."""
        if self.start != "warm":
            return []
        t0 = time.monotonic()
        kept, rejected = self.journal.scan()
        by_ns: dict[str, list] = {}
        for k in kept:
            by_ns.setdefault(k.ns_key, []).append(k)
        taken, entries = [], []
        for ns_key, ks in by_ns.items():
            try:
                ns = index.namespace(ns_key, ks[0].block_bytes)
            except ValueError as exc:  # e.g. a block larger than today's slab: refuse its records
                log.warning("warm restart: refusing %d blocks of a namespace: %s", len(ks), exc)
                rejected += len(ks)
                continue
            got = index.adopt(ns, [(k.key, k.offset) for k in ks], enter=False)
            for k, e in zip(ks, got):
                if e is None:
                    rejected += 1
                else:
                    taken.append(k)
                    entries.append((k.gen, e))
        # Eviction order as it was committed, across namespaces.
        ordered = [e for _, e in sorted(entries, key=lambda ge: ge[0])]
        index.enter_in_order(ordered)
        self.journal.keep(taken)
        self.unverified = {k.offset: k.crc for k in taken}
        if crcs is not None:  # checksums on: the debug table knows the adopted blocks too
            crcs.update(self.unverified)
        self.adopted, self.rejected = len(taken), rejected
        self.adopted_at = time.time()
        self.adopt_s += time.monotonic() - t0  # the hand-over below comes on top
        index.check_integrity()
        t1 = time.monotonic()
        for t in tiers:
            t.adopted(ordered)
        self.handover_s = time.monotonic() - t1
        log.info("warm restart: adopted %d blocks (%s) kept since %s in %.3fs; refused %d records",
                 len(taken), format_size(sum(k.block_bytes for k in taken)),
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.journal.created)), self.adopt_s,
                 rejected)
        return ordered

    # ---- the index's and the copy runner's hooks (loop thread) ----------------------------
    def committed(self, plan, crcs: list) -> None:
        """A store's blocks are READY and their bytes in the pool: record them."""
        crc_of = dict(crcs)
        ns = plan.ns
        for e in plan.entries:
            if e is not None and is_ready(e) and e.offset in crc_of:
                self.journal.commit(ns.key, ns.block_bytes, e.key, e.offset, crc_of[e.offset])

    def removed(self, e) -> None:
        self.journal.remove(e.offset, e.ns.key)
        self.unverified.pop(e.offset, None)

    def to_verify(self, op) -> list[tuple[int, int, int]]:
        """(index in the request, offset, crc) of the adopted blocks a load reads first."""
        if not self.unverified:
            return []
        u = self.unverified
        return [(i, off, u[off]) for i, off in op.slots() if off in u]

    def verified(self, checked: list[tuple[int, int, int]], bad: list[int]) -> None:
        failed = set(bad)
        for i, off, _ in checked:
            if i in failed:
                self.verify_failed += 1
            else:
                self.unverified.pop(off, None)

    # ---- status / stop ------------------------------------------------------------------
    def stats(self) -> dict:
        j = self.journal
        return {"enabled": True, "start": self.start, "reason": self.reason,
                "adopted_blocks": self.adopted, "rejected_records": self.rejected,
                "adopted_at": self.adopted_at, "adopt_s": round(self.adopt_s, 4),
                "handover_s": round(self.handover_s, 4),
                "kept_since": j.created if j else None, "kept_blocks": j.kept if j else 0,
                "not_kept": j.full if j else 0, "unverified_blocks": len(self.unverified),
                "verify_failed": self.verify_failed}

    def close(self) -> None:
        """Unmap the journal, never unlink: the next daemon adopts what is there
        (the pool segment is the daemon's to unmap, after its tensor is gone)."""
        self.journal = None
        if self.jsegment is not None:
            self.jsegment.release(unlink=False)
            self.jsegment = None

    def _close_maps(self) -> None:
        self.journal = None
        for seg in (self.jsegment, self.segment):
            if seg is not None:
                seg.release(unlink=False)
        self.jsegment = self.segment = None


def _vet(size: int | None, mode: int):
    owners = ours()

    def check(st: os.stat_result) -> str:
        why = distrust(st, "regular file", owners, mode=mode)
        if why:
            return f"the shared memory object: {why}" + (" (shm_mode)" if why.startswith("mode") else "")
        if size is not None and st.st_size != size:
            return f"{st.st_size} bytes, expected {size} (pool_size changed?)"
        return ""
    return check
