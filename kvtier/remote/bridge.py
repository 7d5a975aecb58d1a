"""The daemon's side of the remote tier: runs on the poll-loop thread and is
the only part that touches the block index for remote work.

The daemon calls it at these points (marked ``# remote tier hook`` there):

  adopted(entries)     warm restart: the kept blocks join the backlog again, a batch as
                       it runs low, written only if the store lacks them (EXISTS
                       first); none lost silently
  committed(plan)      after an engine's store committed: the new blocks join their
                       tenant's write backlog, which feeds the write-behind queue
                       (pinned in the pool, at most ``queue_bytes``) as it frees
  lookup(...) -> bool  the local READY prefix ended early: ask the store how far
                       the chain goes on; True = the Hits reply comes from here
  load(ns, pending) -> bool  the load names blocks this pool lacks: allocate
                       them (invisible, like a store in progress), fetch and
                       verify them, commit the good ones, then hand the load
                       back to the path that asked (``pending.land()``: a copy
                       from RAM); True = the reply comes from there
  cancel(...) -> bool  a Cancel names a load whose blocks are being fetched: the
                       fetch stops, the load is answered failed without a copy
  poll()               the tier's wakeup fd is readable: finish what completed,
                       feed the backlog into the room freed
  waiting(uid) -> int  loads of that user waiting for a fetch: they count toward
                       its ``max_transfers_per_user`` like its copies (a stalled
                       store must not let one user park unbounded loads here)

A store of any length reaches the store whole as the queue drains: the backlog
(kvtier.disk.schedule.WriteBacklog, shared with the disk tier) names blocks by
(namespace, hash), at most ``backlog_bytes`` of them, tenants taking turns. A
block is read from the pool when its turn comes if it is still there; what is
not written is counted per tenant and why (``not_written``): ``evicted`` (left
RAM before its turn, by eviction or flush), ``backlog_full``, ``budget``,
``rejected`` (the server refused it), ``error``, ``too_large`` (a block larger
than the whole allowance). While the store is unreachable the backlog waits
(blocks of a failed write rejoin it) and goes on when the breaker closes.

Blocks that arrive from the store are committed as ordinary pool blocks
(lookups see them, block events announce them, eviction may drop them) but are
never written back. A block the store lost or that fails verification is
dropped before commit, so the load, back on its path, reports it failed.

Only namespaces of tenants the operator named (config ``tenants``) cross
nodes, under that name: a user listed nowhere is tenant ``uid<N>`` on this
node only, and uid numbers mean nothing on another node. ``cluster_name``
maps a namespace key to its name across nodes, or None (local only).
"""

from __future__ import annotations

import logging
from collections import Counter

from ..disk.schedule import ADOPT_BATCH, Adopted, WriteBacklog
from ..pool.index import BlockIndex
from ..pool.keys import owner_of, split_key
from ..protocol import messages as m
from .secret import load_secret
from .settings import RemoteSettings
from .tier import RemoteTier

log = logging.getLogger("kvtier.remote")


class RemoteBridge:
    def __init__(self, tier: RemoteTier, index: BlockIndex, send, crcs: dict | None = None,
                 cluster_name=lambda key: key, backlog_bytes: int | None = None):
        self.tier, self.index = tier, index
        self.send = send                # (identity, request id, reply) -> None: lookups' Hits
        self.crcs = crcs                # the daemon's checksum table, when checksums are on
        self.cluster_name = cluster_name  # namespace key -> name across nodes, or None (local only)
        self.fetching: dict = {}        # (identity, request id) -> the fetch job of a load
        self.loads_waiting: Counter = Counter()  # uid -> its loads waiting for a fetch
        self.unnamed: set[str] = set()  # tenants already logged as local-only
        self.backlog = WriteBacklog(backlog_bytes or tier.settings.queue_bytes * 4)  # committed, not yet queued
        self.queued = 0                 # bytes of write-behind jobs in flight (pinned in the pool)
        self.retried = 0                # blocks whose write failed (store unreachable) back in the backlog
        # Warm restart: adopted blocks waiting for their batch, then (pulled into the backlog) to
        # be written if the store lacks them: an EXISTS first. Taken out at their turn.
        self.adopted_blocks = Adopted()
        self.recheck: set = set()       # (ns key, hash) pulled, not yet taken: at most a batch or so
        self.warm = Counter()           # requeued, present (held by the store already: not sent)

    @property
    def wakeup_fd(self) -> int:
        return self.tier.wakeup_fd

    def stats(self, tenant: str | None = None) -> dict:
        """The tier's counters; the backlog's for ``tenant`` (None: every tenant's)."""
        b = self.backlog
        return {**self.tier.stats(), "local_only_tenants": len(self.unnamed), "pinned_bytes": self.queued,
                "backlog_blocks": b.blocks if tenant is None else b.of(tenant),
                "backlog_limit_bytes": b.limit_bytes, "retried": self.retried,
                "loads_waiting": sum(self.loads_waiting.values()),  # a count, like the disk tier's
                "warm_requeued": self.warm["requeued"], "warm_present": self.warm["present"],
                "warm_waiting": self.adopted_blocks.left,
                "not_written": b.not_written(tenant)}

    def _name(self, ns) -> str | None:
        name = self.cluster_name(ns.key)
        if name is None:
            tenant = split_key(ns.key)[0]
            if tenant not in self.unnamed:
                self.unnamed.add(tenant)
                log.info("tenant %s is not named in config tenants: its blocks stay on this node", tenant)
        return name

    def close(self) -> None:
        if self.backlog.blocks:
            log.warning("remote tier: %d committed blocks still in the write backlog are not written "
                        "(the daemon stops)", self.backlog.blocks)
        self.tier.close()

    # ---- hooks -------------------------------------------------------------------------
    def committed(self, plan) -> None:
        entries = [e for e in plan.entries if e is not None and self.index.is_ready(e)]
        if not entries or self._name(plan.ns) is None:
            return
        tenant = owner_of(plan.ns.key)
        if plan.ns.block_bytes > self.tier.settings.queue_bytes:  # would wait for room forever
            self.backlog.lost(tenant, "too_large", len(entries))
            return
        # The chain's start first: a prefix is what another node can use before the rest lands.
        self.backlog.add(tenant, plan.ns, [e.key for e in entries])
        self._feed()

    def adopted(self, entries: list) -> None:
        """Warm restart (daemon/warm.py): the kept blocks, oldest first. Which of them the
        last daemon had written is not recorded (a SIGKILL leaves some in its backlog), so
        each joins the backlog again, a batch when it runs low, and is written if the store
        lacks it: its write job asks EXISTS first (``if_missing``), and one the store holds is
        counted ``present``, never sent twice. Tenants not named across nodes never were to be."""
        waiting = self.adopted_blocks
        waiting.add(entries)
        for ns, n in waiting.counts():
            if self._name(ns) is None:
                waiting.forget({ns.key})
            elif ns.block_bytes > self.tier.settings.queue_bytes:
                self.backlog.lost(owner_of(ns.key), "too_large", n)
                waiting.forget({ns.key})
        self.warm["requeued"] += waiting.left
        self._feed()

    def _pull_adopted(self) -> None:
        """The next ``ADOPT_BATCH`` adopted blocks join their tenants' backlogs, to be checked."""
        for ns, keys in self.adopted_blocks.pull(ADOPT_BATCH):
            self.recheck.update((ns.key, k) for k in keys)
            self.backlog.add(owner_of(ns.key), ns, keys)

    def _feed(self) -> None:
        """Move backlog turns into the write-behind queue while it has room and the store is
        up. A block is pinned from here until written; one gone from RAM is counted."""
        room = self.tier.settings.queue_bytes
        while self.tier.available():
            if self.adopted_blocks.left and self.backlog.blocks < ADOPT_BATCH:
                self._pull_adopted()
            turn = self.backlog.take(room - self.queued)
            if turn is None:
                return
            tenant, ns, keys = turn
            check = bool(self.recheck) and _take(self.recheck, ns.key, keys)
            entries = self.index.ready_entries(ns, keys)
            self.backlog.lost(tenant, "evicted", len(keys) - len(entries))
            name = self._name(ns)
            if name is None:  # not named across nodes (it was at commit: the names are fixed at start)
                self.backlog.lost(tenant, "local_only", len(entries))
            if not entries or name is None:
                continue
            self.index.pin(entries)
            n = self.tier.write(name, [e.key for e in entries], [e.offset for e in entries],
                                ns.block_bytes, ("write", entries, tenant, ns, check), if_missing=check)
            self.queued += n * ns.block_bytes
            if n < len(entries):  # the store went away since available(): they wait for it
                self.index.unpin(entries[n:])
                self._retry(tenant, ns, [e.key for e in entries[n:]], check)
                del entries[n:]  # the token's list: what the write job releases when done
                return

    def _written(self, job) -> None:
        """A write job is done: release its blocks; those the store could not take rejoin
        the backlog (they are written once it is back), the rest not written are counted."""
        _, entries, tenant, ns, check = job.token
        self.index.unpin(entries)
        self.queued -= len(entries) * ns.block_bytes
        self.warm["present"] += len(job.present)
        if job.failed:
            self.retried += len(job.failed)
            self._retry(tenant, ns, [entries[i].key for i in job.failed], check)
        for why, n in job.dropped.items():
            self.backlog.lost(tenant, why, n)
        if not self.backlog.blocks:
            self.recheck.clear()  # what is left there was flushed or dropped meanwhile

    def _retry(self, tenant: str, ns, keys: list, check: bool) -> None:
        if check:  # still written only if the store lacks it
            self.recheck.update((ns.key, k) for k in keys)
        self.backlog.add(tenant, ns, keys)

    def lookup(self, identity: bytes, req_id: int, ns, keys: list[bytes], hits: int) -> bool:
        if hits >= len(keys):
            return False
        name = self._name(ns)
        return name is not None and self.tier.probe(name, keys[hits:], ("lookup", identity, req_id, hits),
                                                    owner_of(ns.key))

    def load(self, ns, pending) -> bool:
        """Fetch the blocks of ``pending`` the pool lacks; True when it waits for them. A
        lookup-and-load (prefix) is not fetched: its lookup already asked the store."""
        if pending.prefix or not self.tier.available():
            return False
        keys = pending.keys
        name = self._name(ns)
        if name is None:
            return False
        missing = [k for k in dict.fromkeys(keys) if not self.index.holds(ns.key, k)]
        if not missing:
            return False
        present = self.index.ready_entries(ns, keys)
        # Held so that room made for the fetched blocks is not taken from this very chain.
        self.index.pin(present)
        plan = self.index.prepare_store(ns, missing)
        got = [e for e in plan.entries if e is not None]
        token = ("load", pending, plan, present)
        job = self.tier.fetch(name, [e.key for e in got], [e.offset for e in got], ns.block_bytes,
                              token, owner_of(ns.key)) if got else None
        if job is not None:
            self.fetching[(pending.identity, pending.req_id)] = job
            self.loads_waiting[pending.uid] += 1
            return True
        self.index.complete_store(plan, failed=range(len(plan.entries)))  # no room: load locally
        self.index.unpin(present)
        return False

    def waiting(self, uid) -> int:
        """Loads of ``uid`` waiting for a fetch: transfers in flight like its copies."""
        return self.loads_waiting.get(uid, 0)

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
            if job.kind == "healed":
                continue  # the store is back: the backlog goes on below
            kind = job.token[0]
            if kind == "write":
                self._written(job)
            elif kind == "lookup":
                _, identity, req_id, hits = job.token
                self.send(identity, req_id, m.Hits(hits + job.hits))
            else:
                self._finish_load(job)
        self._feed()

    # ---- loads ---------------------------------------------------------------------------
    def _finish_load(self, job) -> None:
        """Commit the verified blocks, release the chain, hand the load back to its path
        (which, when the client cancelled meanwhile, answers every block failed)."""
        _, pending, plan, present = job.token
        self.fetching.pop((pending.identity, pending.req_id), None)
        self.loads_waiting[pending.uid] -= 1  # before land(): the load takes its own place again
        if not self.loads_waiting[pending.uid]:
            del self.loads_waiting[pending.uid]
        failed = set(job.failed)
        fetched = [i for i, e in enumerate(plan.entries) if e is not None]
        self.index.complete_store(plan, failed=[fetched[j] for j in failed])
        self.index.unpin(present)
        if self.crcs is not None:
            self.crcs.update(job.crcs)
        if job.cancelled:  # the engine may reuse its blocks already: copy nothing into them
            pending.cancel()
        pending.land()


def _take(recheck: set, ns_key: str, keys: list) -> bool:
    """Take ``keys`` out of ``recheck``; whether any of them was there."""
    n = len(recheck)
    recheck.difference_update((ns_key, k) for k in keys)
    return len(recheck) < n


def open_remote(config, pool, index: BlockIndex, send, crcs: dict | None,
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
    # The backlog names at most the pool's worth of blocks: more could not be in RAM to write.
    return RemoteBridge(tier, index, send, crcs, cluster_name, backlog_bytes=config.pool_size)
