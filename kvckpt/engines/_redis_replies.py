"""Reading the Redis server's error replies: which failures they are and what they name."""

from __future__ import annotations

import re

import redis

from ..errors import WritePermissionError
from ..urls import split_options


def is_out_of_memory(error: redis.ResponseError) -> bool:
    return isinstance(error, redis.exceptions.OutOfMemoryError) or str(error).startswith("OOM")


_PIPELINE_COMMAND = re.compile(r"Command # \d+ \((\S+) (\S+)")


def failed_key(error: redis.ResponseError) -> str | None:
    """The key of the command that an error of a redis-py pipeline names ("Command # 1 (SET
    key value) of pipeline caused error: ..."), or None."""
    found = _PIPELINE_COMMAND.match(str(error))
    return found.group(2) if found else None


def server_message(error: redis.ResponseError) -> str:
    """The server's own words of a reply error, without redis-py's account of the pipeline
    command (which holds the value's bytes)."""
    text = str(error)
    _, sep, tail = text.partition(" of pipeline caused error: ")
    return (tail if sep else text).strip().rstrip(".")


def no_such_key(error: redis.ResponseError) -> bool:
    """RENAME's reply when its source is gone: no spare to take over, or already taken."""
    return "no such key" in str(error).lower()


def is_no_permission(error: redis.ResponseError) -> bool:
    """A reply refused by the server's ACLs (``NOPERM``): the user may not run the command or
    touch the key."""
    return isinstance(error, redis.exceptions.NoPermissionError) or "NOPERM" in str(error)[:64]


def user_of(raw_url: str) -> str:
    """The ACL user a Redis URL authenticates as (``default`` when it names none)."""
    parts, opts = split_options(raw_url)
    return parts.username or opts.get("username") or "default"


def no_permission(server: str, url: str, raw_url: str, error: redis.ResponseError) -> Exception:
    """The error for a command the server's ACLs refused this URL's user: a write (save, rm,
    gc) by a user limited to reads is named as such, with the fix."""
    user = user_of(raw_url)
    return WritePermissionError(
        f"{server} refused user {user!r} ({url}): {server_message(error)}. Reading "
        "checkpoints (load, ls, info, verify, export) needs +@read; a save, rm and gc also "
        "write, and need +@write on the namespace's keys (ACL SETUSER, docs/reference/urls.md). "
        "Run them with the URL of a user who may write."
    )
