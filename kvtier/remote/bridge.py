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
  cancel(...) -> bool  a Cancel names a load whose blocks are being fetched: the
                       fetch stops, the load is answered failed without a copy
  poll()               the tier's wakeup fd is readable: finish what completed

Blocks that arrive from the store are committed as ordinary pool blocks
(lookups see them, block events announce them, eviction may drop them) but are
never written back. A block the store lost or that fails verification is
dropped before commit, so the load's second run reports it failed.

Only namespaces of tenants the operator named (config ``tenants``) cross
nodes, under that name: a user listed nowhere is tenant ``uid<N>`` on this
node only, and uid numbers mean nothing on another node. ``cluster_name``
maps a namespace key to its name across nodes, or None (local only).
"""

from __future__ import annotations

import logging

from ..pool.index import BlockIndex
from ..protocol import messages as m
from ..protocol.arrays import pack_ids
from ..protocol.codec import encode
from .secret import load_secret
from .settings import RemoteSettings
from .tier import RemoteTier

log = logging.getLogger("kvtier.remote")


class RemoteBridge:
    def __init__(self, tier: RemoteTier, index: BlockIndex, send, redispatch, crcs: dict | None = None,
                 cluster_name=lambda key: key):
        self.tier, self.index = tier, index
        self.send = send                # (identity, request id, reply) -> None
        self.redispatch = redispatch    # (identity, frame) -> None: the daemon's dispatch point
        self.crcs = crcs                # the daemon's checksum table, when checksums are on
        self.cluster_name = cluster_name  # namespace key -> name across nodes, or None (local only)
        self.local_only: set = set()    # (identity, request id) of loads being re-run after a fetch
        self.fetching: dict = {}        # (identity, request id) -> the fetch job of a load
        self.unnamed: set[str] = set()  # tenants already logged as local-only

    @property
    def wakeup_fd(self) -> int:
        return self.tier.wakeup_fd

    def stats(self) -> dict:
        return {**self.tier.stats(), "local_only_tenants": len(self.unnamed)}

    def _name(self, ns) -> str | None:
        name = self.cluster_name(ns.fingerprint)
        if name is None:
            tenant = ns.fingerprint.partition("\x1f")[0]  # daemon.tenancy.SEP
            if tenant not in self.unnamed:
                self.unnamed.add(tenant)
                log.info("tenant %s is not named in config tenants: its blocks stay on this node", tenant)
        return name

    def close(self) -> None:
        self.tier.close()

    # ---- hooks -------------------------------------------------------------------------
    def committed(self, plan) -> None:
        entries = [e for e in plan.entries if e is not None and self.index.is_ready(e)]
        if not entries:
            return
        ns = plan.ns
        name = self._name(ns)
        if name is None:
            return
        self.index.pin(entries)
        # As many as the write-behind allowance holds, from the chain's start: a prefix
        # is what another node can use, so a store larger than the allowance still shares one.
        n = self.tier.write(name, [e.key for e in entries], [e.offset for e in entries],
                            ns.block_bytes, ("write", entries))
        self.index.unpin(entries[n:])
        del entries[n:]  # the token's list: what the write job releases when done

    def lookup(self, identity: bytes, req_id: int, ns, keys: list[bytes], hits: int) -> bool:
        if hits >= len(keys):
            return False
        name = self._name(ns)
        return name is not None and self.tier.probe(name, keys[hits:], ("lookup", identity, req_id, hits))

    def load(self, identity: bytes, req_id: int, msg, ns, keys: list[bytes]) -> bool:
        if (identity, req_id) in self.local_only or not self.tier.available():
            return False
        name = self._name(ns)
        if name is None:
            return False
        missing = [k for k in dict.fromkeys(keys) if not self.index.holds(ns.fingerprint, k)]
        if not missing:
            return False
        present = self.index.ready_entries(ns, keys)
        # Held so that room made for the fetched blocks is not taken from this very chain.
        self.index.pin(present)
        plan = self.index.prepare_store(ns, missing)
        got = [e for e in plan.entries if e is not None]
        token = ("load", identity, req_id, msg, plan, present, len(keys))
        job = self.tier.fetch(name, [e.key for e in got], [e.offset for e in got], ns.block_bytes,
                              token) if got else None
        if job is not None:
            self.fetching[(identity, req_id)] = job
            return True
        self.index.complete_store(plan, failed=range(len(plan.entries)))  # no room: load locally
        self.index.unpin(present)
        return False

    def cancel(self, identity: bytes, req_id: int) -> bool:
        """The client cancels a load while its blocks are being fetched: the fetch
        stops at its next batch and the load is answered failed, nothing copied."""
        job = self.fetching.get((identity, req_id))
        if job is None:
            return False
        self.tier.cancel(job)
        return True

    def poll(self) -> None:
        for job in self.tier.completed():
            kind = job.token[0]
            if kind == "write":
                self.index.unpin(job.token[1])
            elif kind == "lookup":
                _, identity, req_id, hits = job.token
                self.send(identity, req_id, m.Hits(hits + job.hits))
            else:
                self._finish_load(job)

    # ---- loads ---------------------------------------------------------------------------
    def _finish_load(self, job) -> None:
        """Commit the verified blocks, release the chain, answer through a local load
        (or, when the client cancelled meanwhile, answer every block failed)."""
        _, identity, req_id, msg, plan, present, count = job.token
        self.fetching.pop((identity, req_id), None)
        failed = set(job.failed)
        fetched = [i for i, e in enumerate(plan.entries) if e is not None]
        self.index.complete_store(plan, failed=[fetched[j] for j in failed])
        self.index.unpin(present)
        if self.crcs is not None:
            self.crcs.update(job.crcs)
        if job.cancelled:  # the engine may reuse its blocks already: copy nothing into them
            self.send(identity, req_id, m.TransferDone(0, 0, pack_ids(range(count))))
            return
        self.local_only.add((identity, req_id))
        try:
            self.redispatch(identity, encode(msg, req_id))
        finally:
            self.local_only.discard((identity, req_id))


def open_remote(config, pool, index: BlockIndex, send, redispatch, crcs: dict | None,
                cluster_name=lambda key: key) -> RemoteBridge | None:
    """The bridge for ``config.remote``, or None when the remote tier is off.
    Raises ``SecretError`` (a ValueError saying why) when the secret file is
    missing, malformed or readable by anyone but the daemon's user."""
    if not config.remote:
        return None
    secret = load_secret(config.remote_secret_file)
    settings = RemoteSettings(
        config.remote, secret=secret.key, password=secret.password,
        username=secret.username or config.remote_username, tls_ca=config.remote_tls_ca,
        ttl_s=config.remote_ttl_s, budget=config.remote_budget,
        # write-behind holds its blocks in the pool: at most a quarter of it
        queue_bytes=min(config.remote_queue, config.pool_size // 4), timeout_s=config.remote_timeout_s)
    from .store import _redis
    _redis()  # fail at startup, not on the first commit, when the client library is missing
    tier = RemoteTier(settings, pool)
    log.info("remote tier %s (ttl %.0fs, budget %s, write-behind queue %d bytes; values v2, keyed by %s)",
             settings.display, settings.ttl_s, settings.budget or "none", settings.queue_bytes,
             config.remote_secret_file)
    return RemoteBridge(tier, index, send, redispatch, crcs, cluster_name)
