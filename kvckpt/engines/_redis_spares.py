"""Spares: memory in redis-server that a save writes into instead of making the server
allocate it.

A value written with ``SET`` lands in memory the server allocates for it, and new memory is
the slow part of a save into Redis on a VM (``benchmarks/job.py``). So retention keeps the
values of a checkpoint it deletes as *spares* (``retire``), and the next save takes each over
and writes into its memory (``SetPipeline``). A job's first ``keep_last`` saves come before
retention has deleted anything, so they would still allocate: after each of them the writer
asks for its spares *ahead* (``make_ahead``). A background thread waits for the save's commit
(the server runs one command at a time: spares made during the commit would hold it up), then
makes a spare of the name and size of each value the save wrote, with ``SETRANGE`` (the server
allocates and zeroes it while training runs), and the next save finds them. A save into the
same server stops that thread first (``stop_ahead``), after the batch it is sending, so no
spare is made that the save has already looked for.

Under ``maxmemory``, spares ahead are made only while the server has room for twice the bytes
still to make, checked before each batch: the last of a server's memory is left to the saves
(and nothing where the server may evict keys). Like retention's spares, they expire after
``spare_ttl`` seconds.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence

import redis

from ._redis_replies import no_such_key

logger = logging.getLogger(__name__)

#: Keys per pipelined batch of ``retire``.
_RETIRE_BATCH = 1000
#: Bytes per pipelined batch of ``make_ahead``: a save that comes waits for one batch at most.
_AHEAD_BATCH_BYTES = 16 << 20
#: Seconds ``make_ahead`` waits for the save's commit before it gives up (a save that failed;
#: the next save stops it sooner), and the first and the longest pause between two looks.
_COMMIT_WAIT_S = 600.0
_COMMIT_POLL_S = 0.1
_COMMIT_POLL_MAX_S = 2.0


def retire(client: redis.Redis, keys: Sequence[tuple[str, str]], ttl_ms: int) -> int:
    """Rename each (key, spare name) to its spare name with an expiry of ``ttl_ms``
    (``RENAME`` replaces an older spare of that name; the value's memory is not touched).
    Returns the number of keys renamed; a key already gone is skipped."""
    removed = 0
    for start in range(0, len(keys), _RETIRE_BATCH):
        pipe = client.pipeline(transaction=False)
        for key, spare in keys[start : start + _RETIRE_BATCH]:
            pipe.rename(key, spare)
            pipe.pexpire(spare, ttl_ms)
        replies = pipe.execute(raise_on_error=False)
        for renamed in replies[::2]:
            if isinstance(renamed, redis.ResponseError):
                if not no_such_key(renamed):
                    raise renamed
            else:
                removed += 1
    return removed


class _Ahead:
    """One server's spares in the making."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def end(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


#: The spares being made, by server (``RedisEngine.address``: every database and prefix).
_AHEAD: dict[str, _Ahead] = {}
_LOCK = threading.Lock()


def _after_fork() -> None:
    """A fork copies the registry of threads the child does not have, and the lock as it was."""
    global _LOCK
    _LOCK = threading.Lock()
    _AHEAD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def make_ahead(
    client: redis.Redis,
    server: str,
    spares: Sequence[tuple[str, int]],
    ttl_ms: int,
    after: str | None = None,
) -> None:
    """Make a spare of each (name, bytes) on a background thread, once key ``after`` (a
    save's commit record, which must not exist yet) exists, and return at once. A spare that
    exists keeps its memory (``SETRANGE`` zeroes its last byte, and grows a shorter one). Under
    ``maxmemory``, each batch is made only while the server has room for twice the bytes
    still to make; nothing where its ``maxmemory-policy`` evicts. A failure is logged, never
    raised: the next save then writes without these spares."""
    ahead = _Ahead(client)

    def work() -> None:
        try:
            if after is not None and not _committed(client, after, ahead.stop):
                return
            left = sum(n for _, n in spares)
            for batch in _batches(spares):
                if ahead.stop.is_set() or not _room(client, left):
                    return
                pipe = client.pipeline(transaction=False)
                for name, nbytes in batch:
                    pipe.setrange(name, nbytes - 1, b"\0")
                    pipe.pexpire(name, ttl_ms)
                    left -= nbytes
                pipe.execute()
        except (redis.RedisError, OSError) as e:
            logger.info("spares ahead of the next save to %s not made: %s", server, e)

    ahead.thread = threading.Thread(target=work, name="kvckpt-redis-spares", daemon=True)
    with _LOCK:  # registered started, so that whoever finds it can join it
        previous = _AHEAD.pop(server, None)
        if spares:
            _AHEAD[server] = ahead
            ahead.thread.start()
    if previous is not None:
        previous.end()


def _committed(client: redis.Redis, key: str, stop: threading.Event) -> bool:
    """Whether ``key`` appeared before ``stop`` or ``_COMMIT_WAIT_S``. Looks at growing
    intervals, each a little random, so the ranks of a large job do not look at once."""
    pause, deadline = _COMMIT_POLL_S, time.monotonic() + _COMMIT_WAIT_S
    while not client.exists(key):
        if stop.wait(pause * random.uniform(0.5, 1.5)):
            return False
        if time.monotonic() > deadline:
            logger.info("no spares made ahead: %s did not appear in %g s", key, _COMMIT_WAIT_S)
            return False
        pause = min(2 * pause, _COMMIT_POLL_MAX_S)
    return True


def _room(client: redis.Redis, nbytes: int) -> bool:
    """Whether the server has room for twice ``nbytes`` (always, without ``maxmemory``), and
    keeps every key (``noeviction``)."""
    mem = client.info("memory")
    if mem.get("maxmemory_policy", "noeviction") != "noeviction":
        return False
    limit, used = int(mem.get("maxmemory", 0)), int(mem.get("used_memory", 0))
    return not limit or limit - used >= 2 * nbytes


def _batches(spares: Sequence[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    """``spares`` in batches of about ``_AHEAD_BATCH_BYTES`` (one spare at least)."""
    batch: list[tuple[str, int]] = []
    size = 0
    for spare in spares:
        batch.append(spare)
        size += spare[1]
        if size >= _AHEAD_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def stop_ahead(server: str | None = None) -> None:
    """Stop making spares for ``server`` (every server: None) after the batch being sent,
    and wait for that."""
    with _LOCK:
        if server is None:
            stopping = list(_AHEAD.values())
            _AHEAD.clear()
        else:
            one = _AHEAD.pop(server, None)
            stopping = [] if one is None else [one]
    for ahead in stopping:
        ahead.end()


def stop_ahead_of(client: redis.Redis) -> None:
    """Stop the spares being made through ``client`` (an engine closing its connections)."""
    with _LOCK:
        stopping = {k: a for k, a in _AHEAD.items() if a.client is client}
        for server in stopping:
            del _AHEAD[server]
    for ahead in stopping.values():
        ahead.end()


def wait_ahead() -> None:
    """Wait until every server's spares ahead are made (benchmarks, tests)."""
    with _LOCK:
        running = list(_AHEAD.items())
    for server, ahead in running:
        if ahead.thread is not None:
            ahead.thread.join()
        with _LOCK:
            if _AHEAD.get(server) is ahead:
                del _AHEAD[server]
