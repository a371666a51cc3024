"""Redis engine: a shared in-memory store reachable from every node.

Why these choices:

- Bulk values go through redis-py's connection pool but are framed by hand and sent with
  ``sendall`` on the caller's buffer (redis-py's hiredis packer would copy every value); small
  values are coalesced into one send so 10,000 tiny tensors are not 30,000 syscalls.
- Batches are pipelined: one round trip per batch, not per key. Reads keep only
  ``read_ahead_bytes`` (16 MiB) of GETs outstanding: Redis builds every reply it owes a client in
  that client's output buffer, so a 1 GiB batch of GETs sent at once makes the server copy 1 GiB
  into fresh memory before the socket drains it, which more than halves load speed
  (``benchmarks/redis_ceiling.py --read-ahead-mib``) and holds that much server memory per reader.
- A Redis server closes the connection on a value over 512 MiB (``proto-max-bulk-len``), so the
  engine advertises ``max_value_bytes`` (4 MiB less 64 bytes by default, at most 512 MiB: a
  value of exactly 4 MiB would take 5 MiB of the server's memory) and the format
  layer splits items.
- The commit is ``WATCH``/``MULTI``/``EXEC`` on keys that share a hash tag, so it stays one
  atomic transaction on Redis Cluster too.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from ..errors import (
    InvalidURLError,
    KVCheckpointError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreUnavailableError,
    UnsafeStoreError,
)
from ..urls import (
    DEFAULT_PREFIX,
    mask_url,
    parse_bool,
    parse_size,
    reject_unknown_options,
    split_options,
    take_option,
    validate_prefix,
)
from . import _redis_spares as spares
from ._redis_replies import (
    failed_key,
    is_no_permission,
    is_out_of_memory,
    no_permission,
    server_message,
)
from ._redis_set import MAX_PIPELINE_KEYS, SetPipeline
from ._resp import (
    BACKOFF_S,
    RETRIES,
    BulkReader,
    GetRequests,
    retry,
)
from .base import (
    DEFAULT_PART_BYTES,
    BytesLike,
    Consumer,
    Engine,
    Hasher,
    StoreUsage,
    Update,
    ValueCallback,
)

_MIB = 1 << 20
#: Redis refuses (by closing the connection) a single value larger than this.
REDIS_MAX_VALUE = 512 * _MIB
DEFAULT_READ_AHEAD = 16 * _MIB
#: Seconds a retired value waits as a spare for a save to write over it (URL ``spare_ttl``).
DEFAULT_SPARE_TTL = 900.0
#: Values smaller than this are written with a plain SET: a fresh allocation costs little there.
_REUSE_FROM = 64 * 1024
_DELETE_BATCH = 1000
#: ``RedisEngine._transact_when_full``: set or delete KEYS past the first ARGV[1] (the watched
#: ones) only if each watched key still holds what the caller read. Pairs of ARGV give each
#: key's (exists, value). ``allow-oom`` lets it write on a server at ``maxmemory``.
_CAS_WHEN_FULL = """#!lua flags=allow-oom
local watched = tonumber(ARGV[1])
local a = 2
for i = 1, watched do
  local cur = redis.call('GET', KEYS[i])
  if ARGV[a] == '1' then
    if cur ~= ARGV[a + 1] then return 0 end
  elseif cur then
    return 0
  end
  a = a + 2
end
for i = watched + 1, #KEYS do
  if ARGV[a] == '1' then
    redis.call('SET', KEYS[i], ARGV[a + 1])
  else
    redis.call('DEL', KEYS[i])
  end
  a = a + 2
end
return 1
"""
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")

T = TypeVar("T")


def _translate_errors(method: Callable[..., T]) -> Callable[..., T]:
    """Turn redis-py's connection errors into one that names the server (never the password).
    kvckpt's own errors pass through as they are: they already say what went wrong, and
    ``StoreUnavailableError`` is an ``OSError`` that must not be re-diagnosed as an unreachable
    server (too few replicas answering ``WAIT`` is not that)."""

    @functools.wraps(method)
    def wrapper(self: RedisEngine, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except KVCheckpointError:
            raise
        except redis.AuthenticationError as e:
            raise auth_error(f"Redis at {self.address}", self.url, self._redis_url, e) from None
        except redis.ReadOnlyError:
            raise ReadOnlyStoreError(
                f"Redis at {self.address} ({self.url}) is a read-only replica: save, delete and "
                "gc through its primary"
            ) from None
        except redis.ResponseError as e:  # after ReadOnlyError, one of them
            if is_no_permission(e):
                raise no_permission(
                    f"Redis at {self.address}", self.url, self._redis_url, e
                ) from None
            if _db_out_of_range(e):
                raise InvalidURLError(
                    f"Redis at {self.address} has no database {_db_of(self._redis_url)} "
                    f"({self.url}): its databases are numbered from 0 to its `databases` "
                    "setting minus one (16 by default; `redis-cli CONFIG GET databases`). Use "
                    "one of those in the URL: redis://host:port/0"
                ) from None
            if is_out_of_memory(e):
                raise self._out_of_memory(e, failed_key(e)) from None
            raise
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            # OSError: a socket error from the engine's own reads (_BulkReader), after retries
            raise StoreUnavailableError(
                f"cannot reach Redis at {self.address} ({self.url}): {str(e).rstrip('.')}. "
                "Is redis-server running and reachable from this host?"
            ) from None

    return wrapper


def _retried(method: Callable[..., T]) -> Callable[..., T]:
    """Run an idempotent operation again when the connection drops (``RETRIES`` times, with
    backoff): a dropped connection is an everyday fault, and these operations may run twice.
    A transaction's update may therefore also run after its first run was applied (the reply
    was lost), which ``kvckpt.catalog.update_index`` requires each update to recognise."""

    @functools.wraps(method)
    def wrapper(self: RedisEngine, *args: Any, **kwargs: Any) -> T:
        for n in range(RETRIES + 1):
            try:
                return method(self, *args, **kwargs)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if n == RETRIES or isinstance(e, redis.AuthenticationError):
                    raise
                time.sleep(BACKOFF_S * 2**n)
        raise AssertionError("unreachable")

    return wrapper


def _loopback(host: str | None) -> bool:
    """Whether ``host`` names this node's loopback interface (a server on this node)."""
    if host is None or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolving it here would cost a lookup per engine
        return False


def _has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``:pw@``, a lone ``pw@``, or ``?password=``)."""
    parts, opts = split_options(url)
    return bool(parts.password or parts.username or opts.get("password"))


def auth_error(server: str, url: str, raw_url: str, error: Exception) -> StoreUnavailableError:
    """The error for a server that refused a connection's authentication: a password that is
    required but missing from the URL is named as such, not as refused credentials."""
    if not _has_password(raw_url):
        return StoreUnavailableError(
            f"{server} requires a password, and the URL {url} has none: add it, as "
            "redis://:PASSWORD@host:port/db (or redis://USER:PASSWORD@host:port/db for an ACL "
            "user; percent-encode special characters)"
        )
    return StoreUnavailableError(
        f"{server} refused the credentials in {url}: {str(error).rstrip('.')}. Check the user "
        "and password in the URL (redis://user:password@host:port/db)."
    )


def _db_out_of_range(error: redis.ResponseError) -> bool:
    return "db index is out of range" in str(error).lower()


def _db_of(url: str) -> str:
    parts, opts = split_options(url)
    return opts.get("db") or parts.path.strip("/") or "0"


class RedisSettings(Engine):
    """What the single-server engine and the cluster engine (``redis_cluster.py``, one
    ``RedisEngine`` per primary) share: kvckpt's own URL options, checked once, and the
    engine's identity (its URL with the password masked, its prefix)."""

    shared = True
    supports_ttl = True
    # hashing xxh3 on each piece of a value as it lands or just after the socket took it (still
    # in the CPU cache) costs a tenth of a loopback load or save or less, with the server on the
    # same 2 cores (benchmarks/run.py; docs/PERFORMANCE.md)
    checksums_by_default = True
    hashes_while_writing = True

    def _configure(
        self,
        url: str,
        *,
        prefix: str,
        part_bytes: int,
        pipeline_bytes: int,
        allow_eviction: bool,
        wait_replicas: int,
        wait_timeout: float,
        read_ahead_bytes: int,
        read_lease: bool = True,
    ) -> None:
        check_redis_options(url, part_bytes, wait_replicas, wait_timeout, read_ahead_bytes)
        self._raw_url = url
        self._prefix = validate_prefix(prefix)
        self.max_value_bytes = part_bytes
        self.pipeline_bytes = pipeline_bytes
        self.read_ahead_bytes = read_ahead_bytes
        self.allow_eviction = allow_eviction
        self.wait_replicas = wait_replicas
        self.wait_timeout = wait_timeout
        self.read_leases = read_lease

    def settings(self) -> dict[str, Any]:
        """The options ``_configure`` took, as keyword arguments (for another engine)."""
        return dict(
            prefix=self._prefix,
            part_bytes=self.max_value_bytes,
            pipeline_bytes=self.pipeline_bytes,
            allow_eviction=self.allow_eviction,
            wait_replicas=self.wait_replicas,
            wait_timeout=self.wait_timeout,
            read_ahead_bytes=self.read_ahead_bytes,
            read_lease=self.read_leases,
        )

    @property
    def url(self) -> str:
        return mask_url(self._raw_url)

    @property
    def prefix(self) -> str:
        return self._prefix


def check_redis_options(
    url: str, part_bytes: int, wait_replicas: int, wait_timeout: float, read_ahead_bytes: int
) -> None:
    """The option checks shared by the single-server and the cluster engine."""
    if not 1 <= part_bytes <= REDIS_MAX_VALUE:
        raise InvalidURLError(
            f"part_bytes={part_bytes} in {mask_url(url)} must be between 1 and "
            f"{REDIS_MAX_VALUE} (a Redis server refuses larger values)"
        )
    if read_ahead_bytes < 1:
        raise InvalidURLError(
            f"read_ahead_bytes={read_ahead_bytes} in {mask_url(url)} must be at least 1 byte "
            "(default 16MiB)"
        )
    if wait_replicas < 0 or wait_timeout <= 0:
        raise InvalidURLError(
            f"wait_replicas must be >= 0 and wait_timeout > 0 seconds in {mask_url(url)}"
        )


class RedisEngine(RedisSettings):
    """``redis://[user:password@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path.sock``.

    kvckpt's own query options: ``prefix`` (key namespace), ``part_bytes`` (largest value per
    key, default 64 bytes under 4MiB, which the server's allocator fits in 4 MiB; at most
    512MiB), ``pipeline_bytes`` (bytes per pipelined batch of
    writes), ``read_ahead_bytes`` (bytes of GET replies requested ahead of the one being read,
    default 16MiB), ``allow_eviction`` (accept an evicting ``maxmemory-policy``),
    ``wait_replicas`` and ``wait_timeout`` (a save's data and its commit count only once that
    many replicas have acknowledged them, ``WAIT``; default 0 replicas, 10 s), ``spare_ttl``
    (seconds that retention keeps a deleted checkpoint's values as spares for the next save to
    overwrite in place, default 900; 0 deletes them at once), ``read_lease`` (0: reads take no
    read lease; ``kvckpt.catalog.read_lease`` says what that risks).
    Every other query option goes to redis-py (``ssl_ca_certs``, ``socket_timeout``, ...).
    """

    # hashes on the one thread that sends: a save measures what that costs it (kvckpt.writer)
    hashes_inline = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        part_bytes: int = DEFAULT_PART_BYTES,
        pipeline_bytes: int = 256 * _MIB,
        redis_url: str | None = None,
        allow_eviction: bool = False,
        wait_replicas: int = 0,
        wait_timeout: float = 10.0,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD,
        spare_ttl: float = DEFAULT_SPARE_TTL,
        read_lease: bool = True,
    ) -> None:
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
        if spare_ttl < 0:
            raise InvalidURLError(
                f"spare_ttl={spare_ttl:g} in {mask_url(url)} must be >= 0 seconds (0: no spares)"
            )
        self._redis_url = redis_url or url
        self.spare_ttl = spare_ttl
        #: A new value written over a spare's memory skips the server's allocation of fresh
        #: pages, the slow part of a save into Redis on a VM (benchmarks/job.py measures it).
        self.reuses_values = spare_ttl > 0
        self._client_obj: redis.Redis | None = None
        parts = split_options(self._redis_url)[0]
        if parts.scheme == "unix":
            self.address = parts.path
        else:
            self.address = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
        self.server_on_node = parts.scheme == "unix" or _loopback(parts.hostname)

    @classmethod
    def from_url(cls, url: str) -> RedisEngine:
        parts, opts = split_options(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise InvalidURLError(f"not a Redis URL: {mask_url(url)}")
        if parts.scheme != "unix" and not parts.hostname:
            raise InvalidURLError(f"Redis URL {mask_url(url)} names no host")
        if parts.scheme == "unix" and not parts.path:
            raise InvalidURLError(f"Redis URL {mask_url(url)} names no socket path")
        try:
            _ = parts.port
        except ValueError:
            raise InvalidURLError(f"Redis URL {mask_url(url)} has an invalid port") from None
        ours = take_redis_options(opts, url)
        ours["spare_ttl"] = take_option(opts, "spare_ttl", url, float, DEFAULT_SPARE_TTL)
        check_redis_py_options(opts, url, parts.scheme, (*KVCKPT_REDIS_OPTIONS, "spare_ttl"))
        opts.setdefault("socket_connect_timeout", "10")
        opts.setdefault("socket_timeout", "300")
        query = "&".join(f"{k}={v}" for k, v in opts.items())
        # geturl() would drop the "//" of unix:///path (an empty host), which redis-py refuses
        redis_url = f"{parts.scheme}://{parts.netloc}{parts.path}?{query}"
        return cls(url, redis_url=redis_url, **ours)

    def __reduce__(self) -> Any:
        return (_rebuild, (self._raw_url, self._redis_url, self.settings(), self.spare_ttl))

    @property
    def _client(self) -> redis.Redis:
        if self._client_obj is None:
            try:
                pool = redis.ConnectionPool.from_url(self._redis_url)
            except (ValueError, TypeError) as e:
                raise InvalidURLError(f"bad Redis URL {self.url}: {e}") from None
            self._client_obj = redis.Redis(connection_pool=pool)
        return self._client_obj

    def close(self) -> None:
        if self._client_obj is not None:
            spares.stop_ahead_of(self._client_obj)  # would reconnect through this client
            self._client_obj.close()
            self._client_obj.connection_pool.disconnect()
            self._client_obj = None

    def _with_connection(self, work: Callable[[Any], T]) -> T:
        """Run ``work(conn)`` on a pooled connection; a connection left mid-reply is dropped."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            return work(conn)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    # -- Engine interface ---------------------------------------------------------------------

    @_translate_errors
    def put_many(
        self,
        items: Iterable[tuple[str, BytesLike]],
        *,
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
        spare_of: Callable[[str], str] | None = None,
    ) -> None:
        """SET each value, pipelined, sent straight from the caller's memory. With
        ``spare_of`` (key -> spare name, see ``retire_values``), a large value takes its spare
        over instead where there is one (``RENAME``, ``PERSIST``) and is written into the
        spare's memory (``SETRANGE key 0``); a spare of another size is replaced by a SET."""
        spare_of = spare_of if self.reuses_values else None
        if spare_of is not None:
            spares.stop_ahead(self.address)  # none made behind the checks for existing ones
        hashing = on_value if hasher is not None else None

        def work(conn: Any) -> None:
            pipeline = SetPipeline(self, conn, hashing, hasher)
            for i, (key, value) in enumerate(items):
                view = memoryview(value)
                reuse = spare_of is not None and view.nbytes >= _REUSE_FROM
                pipeline.add(i, key, view, spare_of(key) if reuse else None)  # type: ignore[misc]
            pipeline.flush()

        self._with_connection(work)

    @_translate_errors
    def get_many(self, keys: Sequence[str], consume: Consumer) -> None:
        def work(conn: Any) -> None:
            # Value sizes are unknown here: a full part until replies give an average.
            count = total = 0

            def expected(_: int) -> int:
                return total // count if count else self.max_value_bytes

            for start in range(0, len(keys), MAX_PIPELINE_KEYS):
                batch = keys[start : start + MAX_PIPELINE_KEYS]
                requests = GetRequests(conn, batch, expected, self.read_ahead_bytes)
                for i in range(len(batch)):
                    requests.send_ahead_of(i)
                    value = conn.read_response(disable_decoding=True)
                    requests.received(i)
                    count += 1
                    total += 0 if value is None else len(value)
                    consume(start + i, None if value is None else memoryview(value))

        self._with_connection(work)

    @_translate_errors
    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
    ) -> list[int | None]:
        def work(conn: Any) -> list[int | None]:
            sizes: list[int | None] = []
            for start in range(0, len(keys), MAX_PIPELINE_KEYS):
                stop = min(len(keys), start + MAX_PIPELINE_KEYS)

                def read_batch(start: int = start, stop: int = stop) -> list[int | None]:
                    requests = GetRequests(
                        conn,
                        keys[start:stop],
                        lambda j: buffers[start + j].nbytes,
                        self.read_ahead_bytes,
                    )
                    reader = BulkReader(conn._sock)
                    got = []
                    for i in range(start, stop):
                        requests.send_ahead_of(i - start)
                        hash_ = None if hasher is None else hasher()
                        size = reader.read_bulk_into(buffers[i], hash_)
                        requests.received(i - start)
                        got.append(size)
                        if on_value is not None and size == buffers[i].nbytes:
                            on_value(i, None if hash_ is None else hash_.intdigest())
                    if reader.buffered():
                        raise redis.ConnectionError("unexpected bytes after the replies")
                    return got

                sizes += retry(conn, read_batch)
            return sizes

        return self._with_connection(work)

    @_translate_errors
    @_retried
    def get(self, key: str) -> bytes | None:
        return self._client.get(key)  # type: ignore[return-value]  # no decode_responses

    @_translate_errors
    @_retried
    def scan(self, prefix: str) -> Iterator[str]:
        pattern = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        keys = [k.decode() for k in self._client.scan_iter(match=pattern, count=1000)]
        return iter(keys)

    @_translate_errors
    @_retried
    def delete(self, keys: Iterable[str]) -> int:
        deleted = 0
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) >= _DELETE_BATCH:
                deleted += self._client.unlink(*batch)
                batch = []
        if batch:
            deleted += self._client.unlink(*batch)
        return deleted

    @_translate_errors
    @_retried
    def retire_values(self, keys: Sequence[tuple[str, str]]) -> int:
        """Keep each retired value under its spare name for ``spare_ttl`` seconds, or delete
        them with ``spare_ttl=0`` (``_redis_spares``)."""
        if not self.reuses_values:
            return self.delete(key for key, _ in keys)
        return spares.retire(self._client, keys, self._spare_ttl_ms())

    def make_spares(self, values: Sequence[tuple[str, int]], after: str | None = None) -> None:
        """Spares for the next save, made on a background thread once key ``after`` exists:
        one of the name and size of each value at least as large as the values that take
        spares over (``_redis_spares``)."""
        if self.reuses_values:
            wanted = [(name, n) for name, n in values if n >= _REUSE_FROM]
            spares.make_ahead(self._client, self.address, wanted, self._spare_ttl_ms(), after)

    def _spare_ttl_ms(self) -> int:
        return max(1, int(self.spare_ttl * 1000))

    @_translate_errors
    @_retried
    def transact(self, watch: Sequence[str], update: Update) -> None:
        """``WATCH``/``MULTI``/``EXEC``. On a server at ``maxmemory``, which refuses every
        ``SET`` however small, a transaction that frees memory (bookkeeping that drops an entry:
        a failed save's pending entry, a lease) runs as a script allowed to (``allow-oom``), so
        that clean-up never waits for room it is about to make."""

        def apply(pipe: Any) -> None:
            current = [pipe.get(k) for k in watch]
            writes = update(current)
            pipe.multi()
            for k, v in writes.items():
                if v is None:
                    pipe.delete(k)
                else:
                    pipe.set(k, v)

        try:
            self._client.transaction(apply, *watch)
        except redis.ResponseError as e:
            if not is_out_of_memory(e) or not self._transact_when_full(watch, update):
                raise

    def _transact_when_full(self, watch: Sequence[str], update: Update) -> bool:
        """Apply a transaction that writes no more bytes than its keys hold now, as a
        compare-and-set script flagged ``allow-oom``; False where it would grow the store (or
        the server has no script flags, before Redis 7)."""
        for _attempt in range(100):
            current: list[bytes | None] = [self.get(k) for k in watch]
            writes = update(current)
            if not writes:
                return True
            held = {k: len(v) for k, v in zip(watch, current, strict=True) if v is not None}
            if sum(len(v) for v in writes.values() if v is not None) > sum(
                held.get(k, 0) for k in writes
            ):
                return False
            args: list[Any] = [len(watch)]
            for value in (*current, *writes.values()):
                args += ["0", ""] if value is None else ["1", value]
            try:
                done = self._client.eval(
                    _CAS_WHEN_FULL, len(watch) + len(writes), *watch, *writes, *args
                )
            except redis.ResponseError:
                return False
            if done:
                return True
        return False

    @_translate_errors
    @_retried
    def expire_at(self, keys: Iterable[str], when: float) -> None:
        at_ms = int(when * 1000)
        pipe = self._client.pipeline(transaction=False)
        for n, key in enumerate(keys, 1):
            pipe.pexpireat(key, at_ms)
            if n % _DELETE_BATCH == 0:
                pipe.execute()
        pipe.execute()

    @_translate_errors
    @_retried
    def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        sizes: list[int | None] = []
        for start in range(0, len(keys), MAX_PIPELINE_KEYS):
            pipe = self._client.pipeline(transaction=False)
            batch = keys[start : start + MAX_PIPELINE_KEYS]
            for key in batch:
                pipe.exists(key)
                pipe.strlen(key)
            replies = pipe.execute()
            sizes += [n if e else None for e, n in zip(replies[::2], replies[1::2], strict=True)]
        return sizes

    def sync_replicas(self) -> None:
        self.wait_for_replicas(f"{{{self._prefix}}}/sync")

    @_translate_errors
    @_retried
    def wait_for_replicas(self, scratch_key: str) -> None:
        """``WAIT`` for ``wait_replicas`` replicas, after a write to ``scratch_key``.

        WAIT counts acknowledgements of *this connection's* writes. The replication stream is
        one ordered log, so a tiny write made now, once acknowledged, proves that every write
        made before it, on any connection, has reached the replica too.
        """
        if not self.wait_replicas:
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.set(scratch_key, str(time.time()))
        pipe.execute_command("WAIT", self.wait_replicas, int(self.wait_timeout * 1000))
        acked = int(pipe.execute()[1])
        if acked < self.wait_replicas:
            raise StoreUnavailableError(
                f"only {acked} of the {self.wait_replicas} replicas asked for (wait_replicas) "
                f"acknowledged the writes to {self.url} within {self.wait_timeout:g} s. Check "
                "`INFO replication` on the primary, or lower wait_replicas / raise wait_timeout."
            )

    @_translate_errors
    @_retried
    def session_id(self) -> str | None:
        return str(self._client.info("server").get("run_id"))

    @_translate_errors
    @_retried
    def preflight(self, nbytes: int) -> None:
        """Refuse to write into a server that may evict keys, or that has no room."""
        mem = self._client.info("memory")
        self._refuse_eviction(mem)
        limit, used = int(mem.get("maxmemory", 0)), int(mem.get("used_memory", 0))
        if limit and used + nbytes > limit:
            raise StoreFullError(
                f"Redis at {self.address} has no room for this save: it needs {nbytes} bytes, "
                f"and {max(0, limit - used)} of maxmemory {limit} are free. Delete old "
                "checkpoints (kvckpt gc URL --keep-last N) or raise maxmemory."
            )

    @_translate_errors
    @_retried
    def refuse_unsafe(self) -> None:
        self._refuse_eviction(self._client.info("memory"))

    def _refuse_eviction(self, mem: dict[str, Any]) -> None:
        policy = mem.get("maxmemory_policy", "noeviction")
        if policy != "noeviction" and not self.allow_eviction:
            raise UnsafeStoreError(
                f"Redis at {self.address} ({self.url}) has maxmemory-policy {policy!r}: it may "
                "evict checkpoint keys silently when memory runs short, leaving damaged "
                "checkpoints. Nothing was written. Run `CONFIG SET maxmemory-policy noeviction` "
                "on the server (and in its config), or add ?allow_eviction=1 to the URL to "
                "accept the risk."
            )

    @_translate_errors
    @_retried
    def usage(self) -> StoreUsage:
        mem = self._client.info("memory")
        limit = int(mem.get("maxmemory", 0))
        used = int(mem.get("used_memory", 0))
        if limit:
            return StoreUsage(used, limit, "maxmemory")
        return StoreUsage(used, None, "no maxmemory: the host's memory")

    def _out_of_memory(
        self, error: redis.ResponseError, key: str | None, size: int | None = None
    ) -> StoreFullError:
        """The error for a write that the server refused for want of memory (``maxmemory``):
        the store, the key as text, and the server's memory state."""
        try:
            mem = self._client.info("memory")
            state = (
                f"used_memory {mem.get('used_memory')} of maxmemory {mem.get('maxmemory')} bytes"
            )
        except redis.RedisError:
            state = "memory state unknown"
        what = "a value" if key is None else repr(key)
        what += "" if size is None else f" ({size} bytes)"
        return StoreFullError(
            f"Redis at {self.address} ({self.url}) ran out of memory while storing {what}; "
            f"{state}: {server_message(error)}. Committed checkpoints are intact; delete old "
            "ones (kvckpt gc URL --keep-last N) or raise maxmemory."
        )

    @_translate_errors
    @_retried
    def info(self, section: str | None = None) -> dict[str, Any]:
        """The server's INFO (memory, policy) for preflight checks and diagnostics."""
        return self._client.info(section) if section else self._client.info()


#: kvckpt's own query options of a Redis or Redis Cluster URL (``spare_ttl``: single server).
KVCKPT_REDIS_OPTIONS = (
    "prefix",
    "part_bytes",
    "pipeline_bytes",
    "read_ahead_bytes",
    "allow_eviction",
    "wait_replicas",
    "wait_timeout",
    "read_lease",
)
#: Connection options redis-py takes from a URL as strings, beyond the ones it converts
#: (``redis.connection.URL_QUERY_ARGUMENT_PARSERS``). ``ssl_*``: TLS URLs only.
_REDIS_PY_STRING_OPTIONS = (
    "client_name",
    "username",
    "password",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_ciphers",
)


def redis_py_options(scheme: str) -> list[str]:
    """The query options of a URL of ``scheme`` that redis-py's ``from_url`` takes: the
    connection options it converts and the string ones (TLS options on TLS URLs only, keepalive
    on TCP only)."""
    names = {*redis.connection.URL_QUERY_ARGUMENT_PARSERS, *_REDIS_PY_STRING_OPTIONS}
    if not scheme.startswith("rediss"):
        names = {n for n in names if not n.startswith("ssl_")}
    if scheme == "unix":
        names.discard("socket_keepalive")
    return sorted(names)


def check_redis_py_options(opts: dict[str, str], url: str, scheme: str, ours: Any) -> None:
    """Refuse query options that neither kvckpt (``ours``) nor redis-py takes, naming the
    valid ones: redis-py would otherwise fail on the first connection with a ``TypeError``
    about a keyword argument."""
    valid = redis_py_options(scheme)
    unknown = [k for k in opts if k not in valid]
    tls = any(k.startswith("ssl_") for k in unknown) and not scheme.startswith("rediss")
    note = " (TLS options need a rediss:// URL)" if tls else ""
    reject_unknown_options(unknown, url, "Redis URL", [*ours, *valid], note)


def take_redis_options(opts: dict[str, str], url: str) -> dict[str, Any]:
    """kvckpt's own query options of a Redis URL (removed from ``opts``; the rest are
    redis-py's), as keyword arguments of the engines."""
    return dict(
        prefix=take_option(opts, "prefix", url, validate_prefix, DEFAULT_PREFIX),
        part_bytes=take_option(opts, "part_bytes", url, parse_size, DEFAULT_PART_BYTES),
        pipeline_bytes=take_option(opts, "pipeline_bytes", url, parse_size, 256 * _MIB),
        read_ahead_bytes=take_option(opts, "read_ahead_bytes", url, parse_size, DEFAULT_READ_AHEAD),
        allow_eviction=take_option(opts, "allow_eviction", url, parse_bool, False),
        wait_replicas=take_option(opts, "wait_replicas", url, int, 0),
        wait_timeout=take_option(opts, "wait_timeout", url, float, 10.0),
        read_lease=take_option(opts, "read_lease", url, parse_bool, True),
    )


def _rebuild(
    raw_url: str, redis_url: str, settings: dict[str, Any], spare_ttl: float
) -> RedisEngine:
    """An unpickled ``RedisEngine``: the same store, connected anew in this process."""
    return RedisEngine(raw_url, redis_url=redis_url, spare_ttl=spare_ttl, **settings)
