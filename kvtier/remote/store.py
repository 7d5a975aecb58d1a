"""The Redis side: one connection (cluster or single server) and pipelined
batches of EXISTS / GET / SET. Blocking; only the tier's threads call it.

Any connectivity failure (refused, timed out, cluster down) raises
``Unreachable``; the tier counts it against the breaker and drops the client,
so the next trial reconnects from the seeds and rediscovers the topology
(a cluster restarted on other ports or with other slots is picked up).
A command the server refuses (out of memory under ``maxmemory`` with
``noeviction``) is a per-value result, not a connectivity failure.

Error texts leave here through ``describe``: they become the tier's
``last_error``, which every client's stats show, and a key names a tenant's
namespace digest and block hash (redis-py puts the command into some
errors), so anything key-like is cut from them.
"""

from __future__ import annotations

import re

from .settings import RemoteSettings

# A key (kvt1:/kvt2:/kvt3: and hex) or any long hex run (a namespace digest, a block hash).
_KEYISH = re.compile(r"kvt\d+:[0-9a-fA-F:]*|[0-9a-fA-F]{16,}")
# redis-py's annotation of a pipeline error quotes the command: its key and value bytes.
_COMMAND = re.compile(r"\(.*\)(?= of pipeline caused error)", re.DOTALL)


def describe(exc: BaseException) -> str:
    """``Type: message`` of a store error, without the command it quotes or anything key-like."""
    return _KEYISH.sub("<key>", _COMMAND.sub("(<command>)", f"{type(exc).__name__}: {exc}"))


class Unreachable(Exception):
    """The store could not be reached or did not answer in time."""


def _redis():
    try:
        import redis
    except ImportError:
        raise ImportError("the remote tier needs the redis package: pip install 'kvtier[remote]'") from None
    return redis


class RedisStore:
    def __init__(self, settings: RemoteSettings):
        self.settings = settings
        self.redis = _redis()
        self.client = None
        self.is_cluster = None

    # ---- connection ---------------------------------------------------------------
    def _options(self) -> dict:
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        s = self.settings
        user, password = s.credentials
        opts = dict(socket_timeout=s.timeout_s, socket_connect_timeout=s.timeout_s,
                    retry=Retry(NoBackoff(), 0))  # the breaker decides about retrying
        if user:
            opts["username"] = user
        if password:
            opts["password"] = password
        if s.tls:
            opts["ssl"] = True
            if s.tls_ca:
                opts["ssl_ca_certs"] = s.tls_ca
        return opts

    def connect(self):
        if self.client is not None:
            return self.client
        r = self.redis
        from redis.cluster import ClusterNode, RedisCluster
        opts = self._options()
        try:
            try:
                self.client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.settings.seeds],
                                           **opts)
                self.is_cluster = True
            except r.exceptions.RedisClusterException as exc:
                if "cluster" not in str(exc).lower() or "disabled" not in str(exc).lower():
                    raise
                host, port = self.settings.seeds[0]  # a plain server: use it as it is
                self.client = r.Redis(host=host, port=port, **opts)
                self.client.ping()
                self.is_cluster = False
        except Exception as exc:
            self.close()
            raise Unreachable(describe(exc)) from None
        return self.client

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    # ---- batches --------------------------------------------------------------------
    def _run(self, stage) -> list:
        """Queue commands with ``stage(pipe)``, send them in one pipeline, return the
        per-command results (exceptions for refused commands)."""
        r = self.redis
        client = self.connect()
        try:
            pipe = client.pipeline(transaction=False)
            stage(pipe)
            results = pipe.execute(raise_on_error=False)
        except (r.exceptions.ConnectionError, r.exceptions.TimeoutError, r.exceptions.RedisClusterException,
                r.exceptions.ClusterDownError, OSError) as exc:
            self.close()
            raise Unreachable(describe(exc)) from None
        for res in results:  # some clients report a dead node per command instead of raising
            if isinstance(res, (r.exceptions.ConnectionError, r.exceptions.TimeoutError,
                                r.exceptions.ClusterDownError)):
                self.close()
                raise Unreachable(describe(res))
        return results

    def ping(self) -> None:
        client = self.connect()
        try:
            if self.is_cluster:
                client.ping(target_nodes=client.ALL_NODES)
                info = client.cluster_info(target_nodes=client.get_random_node())
                if info.get("cluster_state") != "ok":
                    raise Unreachable(f"cluster_state {info.get('cluster_state')}")
            else:
                client.ping()
        except Unreachable:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise Unreachable(describe(exc)) from None

    def exists(self, keys: list[bytes]) -> list[bool]:
        results = self._run(lambda pipe: [pipe.exists(k) for k in keys])
        return [res == 1 for res in results]

    def get(self, keys: list[bytes]) -> list:
        results = self._run(lambda pipe: [pipe.get(k) for k in keys])
        return [res if isinstance(res, bytes) else None for res in results]

    def delete(self, keys: list[bytes]) -> None:
        self._run(lambda pipe: [pipe.delete(k) for k in keys])

    def set(self, items: list[tuple[bytes, bytes]], ttl_s: float) -> list[str | None]:
        """SET each (key, value) with a TTL; per item None or why the server refused it."""
        ms = max(1, int(ttl_s * 1000))
        results = self._run(lambda pipe: [pipe.set(k, v, px=ms) for k, v in items])
        return [None if res is True else describe(res) for res in results]
