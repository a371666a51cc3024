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

Spares ahead are made only where the server has room for twice their bytes under
``maxmemory``: the last of a server's memory is left to the saves. Like retention's spares,
they expire after ``spare_ttl`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis

from ._redis_replies import no_such_key

logger = logging.getLogger(__name__)

#: Keys per pipelined batch of ``retire``.
_RETIRE_BATCH = 1000
#: Spares per pipelined batch of ``make_ahead``: a save that comes waits for one batch at most.
_AHEAD_BATCH = 4
#: Seconds ``make_ahead`` waits for the save's commit before it gives up (a save that failed),
#: and the longest pause between two looks.
_COMMIT_WAIT_S = 120.0
_COMMIT_POLL_MAX_S = 1.0


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

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None


#: The spares being made, by server (``RedisEngine.url``).
_AHEAD: dict[str, _Ahead] = {}
_LOCK = threading.Lock()


def make_ahead(
    client: redis.Redis,
    server: str,
    spares: Sequence[tuple[str, int]],
    ttl_ms: int,
    after: str | None = None,
) -> None:
    """Make a spare of each (name, bytes) on a background thread, once key ``after`` (a
    save's commit record) exists, and return at once. Spares that exist are left as they are
    (``SETRANGE`` at the last byte only grows a shorter one). Nothing is made where the server
    lacks room, or where ``after`` does not appear within ``_COMMIT_WAIT_S``; a failure is
    logged, never raised: the next save then writes without these spares."""
    stop_ahead(server)
    if not spares:
        return
    ahead = _Ahead()

    def work() -> None:
        try:
            pause, deadline = 0.05, time.monotonic() + _COMMIT_WAIT_S
            while after is not None and not client.exists(after):
                if ahead.stop.wait(pause) or time.monotonic() > deadline:
                    return
                pause = min(2 * pause, _COMMIT_POLL_MAX_S)
            mem = client.info("memory")
            limit, used = int(mem.get("maxmemory", 0)), int(mem.get("used_memory", 0))
            if limit and limit - used < 2 * sum(n for _, n in spares):
                return
            for start in range(0, len(spares), _AHEAD_BATCH):
                if ahead.stop.is_set():
                    return
                pipe = client.pipeline(transaction=False)
                for name, nbytes in spares[start : start + _AHEAD_BATCH]:
                    pipe.setrange(name, nbytes - 1, b"\0")
                    pipe.pexpire(name, ttl_ms)
                pipe.execute()
        except (redis.RedisError, OSError) as e:
            logger.info("spares ahead of the next save to %s not made: %s", server, e)

    ahead.thread = threading.Thread(target=work, name="kvckpt-redis-spares", daemon=True)
    with _LOCK:
        _AHEAD[server] = ahead
    ahead.thread.start()


def stop_ahead(server: str) -> None:
    """Stop making spares for ``server`` after the batch being sent, and wait for it."""
    with _LOCK:
        ahead = _AHEAD.pop(server, None)
    if ahead is not None:
        ahead.stop.set()
        if ahead.thread is not None:
            ahead.thread.join()


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
