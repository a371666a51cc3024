"""Store URLs: parsing, password masking, and URL scheme -> engine (``open_store``).

Built-in schemes: ``lmdb``, ``redis``, ``rediss``, ``unix``, ``redis+cluster``,
``rediss+cluster``. Third-party packages add schemes
through the entry-point group ``kvckpt.engines``; the entry point names the scheme and points to
a callable taking the URL string and returning an :class:`~kvckpt.engines.base.Engine`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from .engines.base import Engine
from .errors import InvalidURLError, KVCheckpointError

DEFAULT_PREFIX = "kvckpt"
ENTRY_POINT_GROUP = "kvckpt.engines"
BUILTIN_SCHEMES = ("lmdb", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")


def mask_url(url: str) -> str:
    """The URL with its password (and any ``password=`` query value) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{hostport}"
        elif userinfo:
            # redis://secret@host: a lone userinfo is taken as the password by redis-py.
            netloc = f"***@{hostport}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def split_options(url: str) -> tuple[SplitResult, dict[str, str]]:
    """Parse ``url`` and return it with its query options as a dict (last value wins)."""
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise InvalidURLError(f"cannot parse store URL {mask_url(url)!r}: {e}") from None
    return parts, dict(parse_qsl(parts.query, keep_blank_values=True))


def validate_name(name: str, what: str = "checkpoint id", max_len: int = 200) -> str:
    """Return ``name`` if it is safe to embed in keys, else raise with the rule."""
    from .errors import InvalidCheckpointIdError

    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > max_len:
        raise InvalidCheckpointIdError(
            f"invalid {what} {name!r}: use 1-{max_len} characters from letters, digits and "
            "'.', '_', '=', '-', starting with a letter or digit (characters such as '/', "
            "'{', '}', '*', '?' or spaces would break kvckpt's key schema)"
        )
    return name


def validate_prefix(prefix: str) -> str:
    return validate_name(prefix, "prefix", 128)


def take_option(
    options: dict[str, str], name: str, url: str, convert: Callable[[str], Any], default: Any
) -> Any:
    """Pop one query option and convert it, raising an error that names the URL on bad values."""
    if name not in options:
        return default
    raw = options.pop(name)
    try:
        return convert(raw)
    except (TypeError, ValueError) as e:
        why = f": {e}" if isinstance(e, KVCheckpointError) else ""
        raise InvalidURLError(
            f"bad value {raw!r} for option {name!r} in store URL {mask_url(url)}{why}"
        ) from None


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def parse_size(raw: str) -> int:
    """``1048576``, ``64MiB``, ``1GiB``, ``512KB``... -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", raw, re.IGNORECASE)
    if not m:
        raise ValueError(raw)
    number, unit = int(m.group(1)), m.group(2).upper()
    base = 1024 if (m.group(3) or "").lower() == "ib" or not m.group(3) else 1000
    return number * base ** "_KMGT".index(unit or "_")


def _builtin_factory(scheme: str, create: bool) -> Callable[[str], Engine]:
    if scheme == "lmdb":
        from .engines.lmdb import LMDBEngine

        return functools.partial(LMDBEngine.from_url, create=create)
    if scheme.endswith("+cluster"):
        from .engines.redis_cluster import RedisClusterEngine

        return RedisClusterEngine.from_url
    from .engines.redis import RedisEngine

    return RedisEngine.from_url


def _plugin_factory(scheme: str) -> Callable[[str], Engine] | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            return ep.load()
    return None


def open_store(store: str | Engine, *, create: bool = True) -> Engine:
    """The engine for a store URL; an engine object is returned as it is.

    ``create=False`` is for callers that only read (listing, inspecting, loading): an engine
    with a place to create (an LMDB directory) then raises ``StoreNotFoundError`` where the
    store does not exist, instead of creating an empty one. Writers create it (the default).

    >>> open_store("lmdb:///dev/shm/ckpt")            # doctest: +SKIP
    >>> open_store("redis://:pw@redis-host:6379/0?prefix=run7")  # doctest: +SKIP
    """
    if not isinstance(store, str):
        if isinstance(store, Engine) or all(
            callable(getattr(store, m, None))
            for m in ("put_many", "get_many", "get", "scan", "delete", "transact")
        ):
            return store
        raise TypeError(
            f"store must be a URL string or an engine object, not {type(store).__name__}"
        )
    scheme = store.split("://", 1)[0].lower() if "://" in store else ""
    if not scheme:
        raise InvalidURLError(
            f"store URL {mask_url(store)!r} has no scheme: use e.g. 'lmdb:///dev/shm/ckpt' or "
            "'redis://localhost:6379/0'"
        )
    factory = (
        _builtin_factory(scheme, create) if scheme in BUILTIN_SCHEMES else _plugin_factory(scheme)
    )
    if factory is None:
        plugins = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})
        known = ", ".join([*BUILTIN_SCHEMES, *plugins])
        raise InvalidURLError(
            f"unsupported store URL scheme {scheme!r} in {mask_url(store)!r}: kvckpt knows "
            f"{known}. Other engines are added by packages registering the entry-point group "
            f"{ENTRY_POINT_GROUP!r}."
        )
    return factory(store)
