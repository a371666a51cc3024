"""Store URL -> engine: the registry of URL schemes, and ``open_store``.

Built-in schemes (``lmdb``, ``redis``, ``rediss``, ``unix``, ``redis+cluster``,
``rediss+cluster``) and third-party ones are found the same way: a scheme names a callable that
takes the URL string and returns an :class:`~kvckpt.engines.base.Engine`, imported on first
use. Third-party packages register theirs under the entry-point group ``kvckpt.engines``
(the entry point's name is the scheme)::

    [project.entry-points."kvckpt.engines"]
    mem = "memplugin:open_mem"

This module sits above the engines (it imports them); the engines only use ``kvckpt.urls``.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import NoReturn

from .engines.base import Engine
from .errors import InvalidURLError
from .urls import mask_url

ENTRY_POINT_GROUP = "kvckpt.engines"

#: scheme -> "module:callable" of the built-in engines, in the form an entry point gives
BUILTIN_ENGINES = {
    "lmdb": "kvckpt.engines.lmdb:LMDBEngine.from_url",
    "redis": "kvckpt.engines.redis:RedisEngine.from_url",
    "rediss": "kvckpt.engines.redis:RedisEngine.from_url",
    "unix": "kvckpt.engines.redis:RedisEngine.from_url",
    "redis+cluster": "kvckpt.engines.redis_cluster:RedisClusterEngine.from_url",
    "rediss+cluster": "kvckpt.engines.redis_cluster:RedisClusterEngine.from_url",
}
BUILTIN_SCHEMES = tuple(BUILTIN_ENGINES)
#: built-in engines with a place a read-only open must not create (an LMDB directory)
_CREATES = frozenset({"lmdb"})
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def _load(target: str) -> Callable[..., Engine]:
    """``module:attr.attr`` -> the object, importing the module (as an entry point loads)."""
    module, _, attrs = target.partition(":")
    obj = importlib.import_module(module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj  # type: ignore[return-value]


def _factory(scheme: str, create: bool) -> Callable[[str], Engine] | None:
    if scheme in BUILTIN_ENGINES:
        factory = _load(BUILTIN_ENGINES[scheme])
        return functools.partial(factory, create=create) if scheme in _CREATES else factory
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == scheme:
            return ep.load()
    return None


def _no_scheme(store: str) -> NoReturn:
    """The error for a URL without ``scheme://``: a known scheme missing its ``//`` (such as
    ``lmdb:/dir``) is named, with the URL as it should be written."""
    found = _SCHEME.match(store)
    if found is not None and found.group(1).lower() in (*BUILTIN_SCHEMES, *_plugin_schemes()):
        scheme, rest = found.group(1), store[found.end() :]
        local = scheme.lower() in ("lmdb", "unix")  # a path, not a host, follows the '//'
        if local and not rest.startswith("/"):
            fix = f"'{scheme}:///absolute/path' (a local path must be absolute)"
        else:
            fix = repr(mask_url(f"{scheme}://{rest.lstrip('/') if not local else rest}"))
        raise InvalidURLError(
            f"store URL {mask_url(store)!r} lacks the '//' after '{scheme}:': write {fix}"
        )
    raise InvalidURLError(
        f"store URL {mask_url(store)!r} has no scheme: use e.g. 'lmdb:///dev/shm/ckpt' or "
        "'redis://localhost:6379/0'"
    )


def _plugin_schemes() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def open_store(store: str | Engine, *, create: bool = True) -> Engine:
    """The engine for a store URL; an engine object is returned as it is.

    ``create=False`` is for callers that only read (listing, inspecting, loading): an engine
    with a place to create (an LMDB directory) then raises ``StoreNotFoundError`` where the
    store does not exist, instead of creating an empty one. Writers create it (the default).

    >>> open_store("lmdb:///dev/shm/ckpt")            # doctest: +SKIP
    >>> open_store("redis://:pw@redis-host:6379/0?prefix=run7")  # doctest: +SKIP
    """
    if not isinstance(store, str):
        if isinstance(store, Engine):
            return store
        raise TypeError(
            f"store must be a URL string or a kvckpt.Engine, not {type(store).__name__} "
            "(an engine subclasses kvckpt.Engine: CONTRIBUTING.md, 'Add an engine')"
        )
    scheme = store.split("://", 1)[0].lower() if "://" in store else ""
    if not scheme:
        _no_scheme(store)
    factory = _factory(scheme, create)
    if factory is None:
        known = ", ".join([*BUILTIN_SCHEMES, *_plugin_schemes()])
        raise InvalidURLError(
            f"unsupported store URL scheme {scheme!r} in {mask_url(store)!r}: kvckpt knows "
            f"{known}. Other engines are added by packages registering the entry-point group "
            f"{ENTRY_POINT_GROUP!r}."
        )
    return factory(store)
