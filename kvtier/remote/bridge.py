"""The daemon's side of the remote tier: runs on the poll-loop thread and is
the only part that touches the block index for remote work.

The daemon calls it at four points (marked ``# remote tier hook`` there):

  committed(plan)      after an engine's store committed: hold the new blocks
                       and queue them for write-behind; released when written
  lookup(...) -> bool  the local READY prefix ended early: ask the store how far
                       the chain goes on; True = the Hits reply comes from here
  load(...) -> bool    the load names blocks this pool lacks: allocate them
                       (invisible, like a store in progress), fetch and verify
                       them, commit the good ones, then run the load again
                       locally; True = the reply comes from that second run
  poll()               the tier's wakeup fd is readable: finish what completed

Blocks that arrive from the store are committed as ordinary pool blocks
(lookups see them, block events announce them, eviction may drop them) but are
never written back. A block the store lost or that fails verification is
dropped before commit, so the load's second run reports it failed.
"""

from __future__ import annotations

import logging

from ..pool.index import READY, BlockIndex
from ..protocol import messages as m
from ..protocol.codec import encode
from .settings import RemoteSettings
from .tier import RemoteTier

log = logging.getLogger("kvtier.remote")


class RemoteBridge:
    def __init__(self, tier: RemoteTier, index: BlockIndex, send, redispatch, crcs: dict | None = None):
        self.tier, self.index = tier, index
        self.send = send                # (identity, request id, reply) -> None
        self.redispatch = redispatch    # (identity, frame) -> None: the daemon's dispatch point
        self.crcs = crcs                # the daemon's checksum table, when checksums are on
        self.local_only: set = set()    # (identity, request id) of loads being re-run after a fetch

    @property
    def wakeup_fd(self) -> int:
        return self.tier.wakeup_fd

    def stats(self) -> dict:
        return self.tier.stats()

    def close(self) -> None:
        self.tier.close()

    # ---- hooks -------------------------------------------------------------------------
    def committed(self, plan) -> None:
        entries = [e for e in plan.entries
                   if e is not None and e.state == READY and plan.ns.entries.get(e.key) is e]
        if not entries:
            return
        ns = plan.ns
        self.index.pin(entries)
        if not self.tier.write(ns.fingerprint, [e.key for e in entries], [e.offset for e in entries],
                               ns.block_bytes, ("write", entries)):
            self.index.unpin(entries)

    def lookup(self, identity: bytes, req_id: int, ns, keys: list[bytes], hits: int) -> bool:
        if hits >= len(keys):
            return False
        return self.tier.probe(ns.fingerprint, keys[hits:], ("lookup", identity, req_id, hits))

    def load(self, identity: bytes, req_id: int, msg, ns, keys: list[bytes]) -> bool:
        if (identity, req_id) in self.local_only or not self.tier.available():
            return False
        missing = [k for k in dict.fromkeys(keys) if k not in ns.entries]
        if not missing:
            return False
        present = [e for e in map(ns.entries.get, keys) if e is not None and e.state == READY]
        # Held so that room made for the fetched blocks is not taken from this very chain.
        self.index.pin(present)
        plan = self.index.prepare_store(ns, missing)
        got = [e for e in plan.entries if e is not None]
        token = ("load", identity, req_id, msg, plan, present)
        if got and self.tier.fetch(ns.fingerprint, [e.key for e in got], [e.offset for e in got],
                                   ns.block_bytes, token):
            return True
        self.index.complete_store(plan, failed=range(len(plan.entries)))  # no room: load locally
        self.index.unpin(present)
        return False

    def poll(self) -> None:
        for job in self.tier.completed():
            kind = job.token[0]
            if kind == "write":
                self.index.unpin(job.token[1])
            elif kind == "lookup":
                _, identity, req_id, hits = job.token
                self.send(identity, req_id, m.Hits(hits + job.hits))
            else:
                self._finish_load(job.token, job.failed, job.crcs)

    # ---- loads ---------------------------------------------------------------------------
    def _finish_load(self, token, failed, crcs) -> None:
        """Commit the verified blocks, release the chain, answer through a local load."""
        _, identity, req_id, msg, plan, present = token
        failed = set(failed)
        fetched = [i for i, e in enumerate(plan.entries) if e is not None]
        self.index.complete_store(plan, failed=[fetched[j] for j in failed])
        self.index.unpin(present)
        if self.crcs is not None:
            self.crcs.update(crcs)
        self.local_only.add((identity, req_id))
        try:
            self.redispatch(identity, encode(msg, req_id))
        finally:
            self.local_only.discard((identity, req_id))


def open_remote(config, pool, index: BlockIndex, send, redispatch, crcs: dict | None) -> RemoteBridge | None:
    """The bridge for ``config.remote``, or None when the remote tier is off."""
    if not config.remote:
        return None
    settings = RemoteSettings(
        config.remote, password=config.remote_password, username=config.remote_username,
        tls_ca=config.remote_tls_ca, ttl_s=config.remote_ttl_s, budget=config.remote_budget,
        # write-behind holds its blocks in the pool: at most a quarter of it
        queue_bytes=min(config.remote_queue, config.pool_size // 4), timeout_s=config.remote_timeout_s)
    from .store import _redis
    _redis()  # fail at startup, not on the first commit, when the client library is missing
    tier = RemoteTier(settings, pool)
    log.info("remote tier %s (ttl %.0fs, budget %s, write-behind queue %d bytes)", settings.display,
             settings.ttl_s, settings.budget or "none", settings.queue_bytes)
    return RemoteBridge(tier, index, send, redispatch, crcs)
