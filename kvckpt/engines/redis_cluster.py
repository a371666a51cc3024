"""Redis Cluster: ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://`` for TLS).

redis-py's ``RedisCluster`` client knows the cluster's topology (which primary serves which
hash slot) and follows ``MOVED`` redirects. kvckpt uses it for the topology and for single-key
commands, and moves the bulk data with one ``RedisEngine`` per primary, so every primary gets
the zero-copy pipelined ``SET`` and the ``recv_into`` ``GET`` of the single-server engine: keys
are grouped by the primary that serves their slot, and the groups are sent in parallel (socket
I/O releases the GIL), so each primary carries its share of the bytes and of the bandwidth.

Bookkeeping keys (``{P}/meta/...``, ``{P}/index``, leases) share the hash tag ``{P}``, so they
live in one slot and the commit stays one ``WATCH``/``MULTI``/``EXEC`` transaction on the primary
that serves it. Data keys have no hash tag and spread over every slot.

A topology change (failover, resharding) shows up as ``MOVED``/``ASK`` replies or as a primary
that stopped answering: the client's slot map is refreshed and the batch is sent again (``SET``
and ``GET`` are idempotent), a bounded number of times. A save that spans a failover is not
committed: the session id is the set of primaries' run ids, and the writer refuses to commit
across a change, because writes acknowledged by a primary that died may not have reached the
replica that replaced it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import redis
from redis.cluster import ClusterNode, RedisCluster

from ..errors import InvalidURLError, ReadOnlyStoreError, StoreFullError, StoreUnavailableError
from ..urls import (
    DEFAULT_PREFIX,
    mask_url,
    split_options,
)
from ._redis_replies import (
    failed_key,
    is_no_permission,
    is_out_of_memory,
    no_permission,
    server_message,
)
from .base import (
    DEFAULT_PART_BYTES,
    BytesLike,
    Consumer,
    Hasher,
    StoreUsage,
    Update,
    ValueCallback,
)
from .redis import (
    _MIB,
    DEFAULT_READ_AHEAD,
    KVCKPT_REDIS_OPTIONS,
    RedisEngine,
    RedisSettings,
    auth_error,
    check_redis_py_options,
    take_redis_options,
)

T = TypeVar("T")

#: How long a topology change may take before an operation gives up (a failover takes about
#: ``cluster-node-timeout`` plus an election).
_REROUTE_SECONDS = 30.0
_PIPELINE_KEYS = 4096


_TOPOLOGY_ERRORS = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.SlotNotCoveredError,
    redis.ConnectionError,
    redis.TimeoutError,
    StoreUnavailableError,  # a primary that stopped answering (the node engine's retries ran out)
)


def _topology_error(e: BaseException) -> bool:
    if isinstance(e, _TOPOLOGY_ERRORS):
        return True
    # Replies read on a raw node connection: redis-py may leave them as plain ResponseErrors.
    return isinstance(e, redis.ResponseError) and str(e).startswith(
        ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
    )


def _cluster_errors(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: RedisClusterEngine, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except redis.AuthenticationError as e:
            raise auth_error("Redis Cluster", self.url, self._raw_url, e) from None
        except (
            redis.ConnectionError,
            redis.TimeoutError,
            redis.exceptions.RedisClusterException,
            redis.exceptions.ClusterError,
        ) as e:
            raise StoreUnavailableError(
                f"cannot reach Redis Cluster {self.url}: {str(e).rstrip('.')}. Are the nodes "
                "running, and is the cluster state ok (`redis-cli cluster info`)?"
            ) from None
        except redis.ReadOnlyError:
            raise ReadOnlyStoreError(
                f"Redis Cluster {self.url} answered as a read-only replica: save, delete and gc "
                "through its primaries"
            ) from None
        except redis.ResponseError as e:  # after ClusterError: ClusterDownError is both
            if is_no_permission(e):
                raise no_permission("Redis Cluster", self.url, self._raw_url, e) from None
            if is_out_of_memory(e):
                key = failed_key(e)
                raise StoreFullError(
                    f"Redis Cluster {self.url} ran out of memory while storing "
                    f"{'a value' if key is None else repr(key)}: {server_message(e)}. "
                    "Committed checkpoints are intact; delete old ones (kvckpt gc URL "
                    "--keep-last N) or raise maxmemory on the cluster's primaries."
                ) from None
            raise

    return wrapper


class RedisClusterEngine(RedisSettings):
    """``redis+cluster://[user:password@]host:port[,host:port...]`` (any nodes of the cluster:
    the rest are discovered) and ``rediss+cluster://`` for TLS.

    Options are those of the single-server engine (``prefix``, ``part_bytes``,
    ``pipeline_bytes``, ``read_ahead_bytes``, ``allow_eviction``, ``wait_replicas``,
    ``wait_timeout``, ``read_lease``, redis-py connection options), applied to every primary.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        part_bytes: int = DEFAULT_PART_BYTES,
        pipeline_bytes: int = 256 * _MIB,
        allow_eviction: bool = False,
        wait_replicas: int = 0,
        wait_timeout: float = 10.0,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD,
        read_lease: bool = True,
        redis_options: dict[str, str] | None = None,
    ) -> None:
        parts, _ = split_options(url)
        if parts.scheme not in ("redis+cluster", "rediss+cluster"):
            raise InvalidURLError(f"not a Redis Cluster URL: {mask_url(url)}")
        hosts = parts.netloc.rsplit("@", 1)[-1]
        self.startup = []
        for item in hosts.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit():
                raise InvalidURLError(
                    f"Redis Cluster URL {mask_url(url)} must list host:port pairs separated by "
                    f"commas, not {item!r}"
                )
            self.startup.append((host.strip("[]"), int(port)))
        self._configure(
            url,
            prefix=prefix,
            part_bytes=part_bytes,
            pipeline_bytes=pipeline_bytes,
            allow_eviction=allow_eviction,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
            read_ahead_bytes=read_ahead_bytes,
            read_lease=read_lease,
        )
        self.tls = parts.scheme == "rediss+cluster"
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        if self.username and self.password is None:  # redis://secret@host, as redis-py reads it
            self.username, self.password = None, self.username
        self.redis_options = dict(redis_options or {})
        self._cluster_obj: RedisCluster | None = None
        self._nodes: dict[str, RedisEngine] = {}

    @classmethod
    def from_url(cls, url: str) -> RedisClusterEngine:
        parts, opts = split_options(url)
        ours = take_redis_options(opts, url)
        # the options go on to the engine of each primary (a single-server redis[s] URL)
        scheme = "rediss" if parts.scheme.startswith("rediss") else "redis"
        check_redis_py_options(opts, url, scheme, KVCKPT_REDIS_OPTIONS)
        opts.setdefault("socket_connect_timeout", "2")
        opts.setdefault("socket_timeout", "300")
        return cls(url, redis_options=opts, **ours)

    def __reduce__(self) -> Any:
        return (RedisClusterEngine.from_url, (self._raw_url,))

    # -- topology -----------------------------------------------------------------------------

    @property
    def _cluster(self) -> RedisCluster:
        if self._cluster_obj is None:
            kwargs: dict[str, Any] = {
                "startup_nodes": [ClusterNode(h, p) for h, p in self.startup],
                "username": self.username,
                "password": self.password,
                "ssl": self.tls,
                "socket_connect_timeout": float(self.redis_options["socket_connect_timeout"]),
                "socket_timeout": float(self.redis_options["socket_timeout"]),
            }
            for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
                if key in self.redis_options:
                    kwargs[key] = self.redis_options[key]
            try:
                self._cluster_obj = RedisCluster(**kwargs)
            except (redis.RedisError, IndexError) as e:
                raise StoreUnavailableError(
                    f"cannot reach Redis Cluster {self.url}: {str(e).rstrip('.')}. Are the "
                    "nodes running, and is the cluster state ok (`redis-cli cluster info`)?"
                ) from None
        return self._cluster_obj

    def _node_engine(self, node: ClusterNode) -> RedisEngine:
        """The single-server engine that talks to one primary (made once per node)."""
        engine = self._nodes.get(node.name)
        if engine is None:
            auth = ""
            if self.username or self.password:
                auth = (
                    f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"
                )
            query = "&".join(f"{k}={v}" for k, v in self.redis_options.items())
            scheme = "rediss" if self.tls else "redis"
            raw = f"{scheme}://{auth}{node.host}:{node.port}/0"
            engine = RedisEngine(
                raw,
                redis_url=f"{raw}?{query}" if query else raw,
                **self.settings(),
                spare_ttl=0,  # a spare's name hashes to another slot than its key's: no reuse
            )
            self._nodes[node.name] = engine
        return engine

    def _primaries(self) -> list[ClusterNode]:
        return sorted(self._cluster.get_primaries(), key=lambda n: n.name)

    def _node_of(self, key: str) -> ClusterNode:
        return self._cluster.get_node_from_key(key)

    def _refresh(self) -> None:
        """Forget the slot map and the per-node connections; the next call asks the cluster."""
        for engine in self._nodes.values():
            engine.close()
        self._nodes.clear()
        with contextlib.suppress(redis.RedisError):  # still changing: the next try asks again
            self._cluster.nodes_manager.initialize()

    def _rerouted(self, attempt: Callable[[], T]) -> T:
        """Run ``attempt`` (which routes keys itself), again after a topology refresh when the
        topology changed under it, until ``_REROUTE_SECONDS`` have passed."""
        deadline = time.monotonic() + _REROUTE_SECONDS
        pause = 0.1
        while True:
            try:
                return attempt()
            except Exception as e:
                if not _topology_error(e) or time.monotonic() > deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
            self._refresh()

    def _by_node(self, keys: Sequence[str]) -> dict[str, tuple[ClusterNode, list[int]]]:
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i, key in enumerate(keys):
            node = self._node_of(key)
            groups.setdefault(node.name, (node, []))[1].append(i)
        return groups

    def _each_node(
        self, work: Callable[[ClusterNode, list[int]], T], keys: Sequence[str]
    ) -> list[T]:
        """Run ``work(node, key positions)`` for every primary the keys live on, in parallel."""
        groups = list(self._by_node(keys).values())
        if len(groups) <= 1:
            return [work(node, idx) for node, idx in groups]
        with ThreadPoolExecutor(len(groups)) as pool:
            return list(pool.map(lambda g: work(*g), groups))

    # -- Engine interface ---------------------------------------------------------------------

    @_cluster_errors
    def put_many(
        self,
        items: Iterable[tuple[str, BytesLike]],
        *,
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
        spare_of: Callable[[str], str] | None = None,
    ) -> None:
        # Collect up to pipeline_bytes across the cluster, then send each primary its share in
        # parallel. The values are views of the caller's memory: nothing is copied here.
        # Values are always new (no reuses_values across a cluster): spare_of is unused.
        batch: list[tuple[str, BytesLike]] = []
        first = size = 0  # first: position in items of batch[0]
        for key, value in items:
            batch.append((key, value))
            size += memoryview(value).nbytes
            if size >= self.pipeline_bytes or len(batch) >= _PIPELINE_KEYS * 4:
                self._put_batch(batch, first, on_value, hasher)
                first += len(batch)
                batch, size = [], 0
        if batch:
            self._put_batch(batch, first, on_value, hasher)

    def _put_batch(
        self,
        batch: list[tuple[str, BytesLike]],
        first: int,
        on_value: ValueCallback | None,
        hasher: Callable[[], Hasher] | None,
    ) -> None:
        keys = [k for k, _ in batch]

        def put(node: ClusterNode, idx: list[int]) -> None:
            engine = self._node_engine(node)
            values = (batch[i] for i in idx)
            if on_value is None or hasher is None:
                engine.put_many(values)
            else:
                engine.put_many(
                    values,
                    on_value=lambda j, digest: on_value(first + idx[j], digest),
                    hasher=hasher,
                )

        def attempt() -> None:
            self._each_node(put, keys)

        self._rerouted(attempt)

    @_cluster_errors
    def get_many(self, keys: Sequence[str], consume: Consumer) -> None:
        def attempt() -> None:
            for node, idx in self._by_node(keys).values():
                self._node_engine(node).get_many(
                    [keys[i] for i in idx], lambda j, view, idx=idx: consume(idx[j], view)
                )

        self._rerouted(attempt)

    @_cluster_errors
    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
    ) -> list[int | None]:
        sizes: list[int | None] = [None] * len(keys)

        def read(node: ClusterNode, idx: list[int]) -> None:
            got = self._node_engine(node).get_into(
                [keys[i] for i in idx],
                [buffers[i] for i in idx],
                None if on_value is None else (lambda j, digest: on_value(idx[j], digest)),
                hasher,
            )
            for i, n in zip(idx, got, strict=True):
                sizes[i] = n

        self._rerouted(lambda: self._each_node(read, keys))
        return sizes

    @_cluster_errors
    def get(self, key: str) -> bytes | None:
        return self._rerouted(lambda: self._cluster.get(key))  # type: ignore[return-value]

    def _scan_node(self, node: ClusterNode, prefix: str) -> list[str]:
        return list(self._node_engine(node).scan(prefix))

    @_cluster_errors
    def scan(self, prefix: str) -> Iterator[str]:
        keys: set[str] = set()
        for node in self._primaries():
            keys.update(self._rerouted(functools.partial(self._scan_node, node, prefix)))
        return iter(sorted(keys))

    def _pipelined(
        self, keys: Sequence[str], command: Callable[[Any, str], None], per_key: int = 1
    ) -> list[Any]:
        """``per_key`` single-key commands per key, pipelined per primary; the replies in key
        order (a tuple per key when ``per_key`` > 1)."""
        replies: list[Any] = [None] * len(keys)

        def run(node: ClusterNode, idx: list[int]) -> None:
            client = self._node_engine(node)._client
            for start in range(0, len(idx), _PIPELINE_KEYS):
                part = idx[start : start + _PIPELINE_KEYS]
                pipe = client.pipeline(transaction=False)
                for i in part:
                    command(pipe, keys[i])
                got = pipe.execute()
                for j, i in enumerate(part):
                    chunk = got[j * per_key : (j + 1) * per_key]
                    replies[i] = chunk[0] if per_key == 1 else tuple(chunk)

        self._rerouted(lambda: self._each_node(run, keys))
        return replies

    @_cluster_errors
    def delete(self, keys: Iterable[str]) -> int:
        # UNLINK of several keys needs them in one slot; one UNLINK per key, pipelined.
        return sum(self._pipelined(list(keys), lambda pipe, key: pipe.unlink(key)))

    @_cluster_errors
    def transact(self, watch: Sequence[str], update: Update) -> None:
        slots = {self._cluster.keyslot(k) for k in watch}
        if len(slots) > 1:
            raise ValueError(f"a transaction's keys must share a hash slot: {list(watch)}")
        self._rerouted(lambda: self._node_engine(self._node_of(watch[0])).transact(watch, update))

    @_cluster_errors
    def expire_at(self, keys: Iterable[str], when: float) -> None:
        at_ms = int(when * 1000)
        self._pipelined(list(keys), lambda pipe, key: pipe.pexpireat(key, at_ms))

    @_cluster_errors
    def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        def both(pipe: Any, key: str) -> None:
            pipe.exists(key)
            pipe.strlen(key)

        return [n if e else None for e, n in self._pipelined(keys, both, per_key=2)]

    @_cluster_errors
    def session_id(self) -> str | None:
        """The primaries' run ids: a failover or a restart of any of them changes it."""
        return ",".join(str(self._node_engine(node).session_id()) for node in self._primaries())

    @_cluster_errors
    def refuse_unsafe(self) -> None:
        for node in self._primaries():
            self._node_engine(node).refuse_unsafe()

    @_cluster_errors
    def preflight(self, nbytes: int) -> None:
        primaries = self._primaries()
        for node in primaries:
            # Data keys spread evenly over the slots: each primary takes its share (with a
            # margin for uneven spreads of few, large keys).
            self._node_engine(node).preflight(int(1.25 * nbytes / len(primaries)))

    @_cluster_errors
    def usage(self) -> StoreUsage:
        each = [self._node_engine(node).usage() for node in self._primaries()]
        used = sum(u.used_bytes or 0 for u in each)
        if all(u.limit_bytes for u in each):
            return StoreUsage(
                used, sum(u.limit_bytes or 0 for u in each), "the primaries' maxmemory"
            )
        return StoreUsage(used, None, "a primary without maxmemory: the hosts' memory")

    @_cluster_errors
    def sync_replicas(self) -> None:
        if not self.wait_replicas:
            return
        for node in self._primaries():
            self._node_engine(node).wait_for_replicas(self._scratch_key(node))

    def _scratch_key(self, node: ClusterNode) -> str:
        """A key whose slot this primary serves, for the write ``WAIT`` waits on."""
        for n in range(100_000):
            key = f"{self._prefix}/sync/{n}"
            if self._node_of(key).name == node.name:
                return key
        raise StoreUnavailableError(f"primary {node.name} of {self.url} serves no slots")

    def close(self) -> None:
        for engine in self._nodes.values():
            engine.close()
        self._nodes.clear()
        if self._cluster_obj is not None:
            self._cluster_obj.close()
            self._cluster_obj = None
