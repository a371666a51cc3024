"""Checkpoint ids for Lightning's paths, the pointer files written at those paths, and the
stores this process opened (a pointer file names its store with the password masked)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.pytorch.plugins.io import CheckpointIO

from ..engines.base import Engine
from ..errors import (
    KVCheckpointError,
    MetadataError,
)
from ..stores import open_store
from ..urls import validate_name
from .store import Saved, load_checkpoint

#: the ``"kvckpt"`` value of a pointer file
POINTER_KIND = "lightning-pointer"
POINTER_VERSION = 1
_POINTER_MAX_BYTES = 1 << 16

#: Engines this process opened for Lightning, by masked URL. A pointer file names its store
#: with the password masked (it is written to disk), so a load finds the engine, credentials
#: included, here: every ``KVCheckpointIO``, ``KVCheckpoint`` and ``auto_resume`` registers its
#: stores.
_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _register(engine: Engine) -> Engine:
    with _engines_lock:
        _engines.setdefault(engine.url, engine)
    return engine


def _full_path(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return os.path.abspath(text) if _is_local_file_protocol(text) else text


def checkpoint_id_for(path: str | os.PathLike) -> str:
    """The checkpoint id of a Lightning checkpoint path: the file name without ``.ckpt``,
    cleaned to kvckpt's id alphabet, plus the first 8 hex digits of the SHA-256 of its
    (absolute) directory, so runs that share a store keep apart; 6 more of the file name's own
    hash where cleaning changed the name. Deterministic: a replaced node finds the id from the
    path alone."""
    full = _full_path(path)
    directory, _, name = full.rpartition("/") if "/" in full else ("", "", full)
    stem = name.removesuffix(".ckpt")
    clean = re.sub(r"[^A-Za-z0-9._=-]+", "_", stem)[:150].lstrip("._=-") or "ckpt"
    suffix = hashlib.sha256(directory.encode()).hexdigest()[:8]
    if clean != stem:
        suffix += hashlib.sha256(name.encode()).hexdigest()[:6]
    return validate_name(f"{clean}.{suffix}")


def read_pointer(path: str | os.PathLike) -> dict[str, Any] | None:
    """The pointer file at ``path`` (a dict), or None where ``path`` is some other file (a
    Lightning checkpoint saved with ``torch.save``). ``FileNotFoundError`` where nothing is
    there."""
    fs = get_filesystem(os.fspath(path))
    with fs.open(os.fspath(path), "rb") as f:
        head = f.read(_POINTER_MAX_BYTES + 1)
    if not head.lstrip().startswith(b"{") or len(head) > _POINTER_MAX_BYTES:
        return None
    try:
        pointer = json.loads(head)
    except ValueError:
        return None
    if not isinstance(pointer, dict) or pointer.get("kvckpt") != POINTER_KIND:
        return None
    if not isinstance(pointer.get("checkpoint_id"), str) or not isinstance(
        pointer.get("store"), str
    ):
        raise MetadataError(f"pointer file {os.fspath(path)!r} lacks 'store' or 'checkpoint_id'")
    return pointer


def write_pointer(path: str | os.PathLike, engine: Engine, saved: Saved) -> None:
    """Write the pointer file: atomically (temporary file, then rename) on a local disk."""
    text = json.dumps(
        {
            "kvckpt": POINTER_KIND,
            "version": POINTER_VERSION,
            "store": engine.url,  # password masked
            "checkpoint_id": saved.checkpoint_id,
            "save_id": saved.save_id,
            "created_at": saved.created_at,
        },
        indent=1,
    )
    target = os.fspath(path)
    fs = get_filesystem(target)
    if not _is_local_file_protocol(target):
        with fs.open(target, "w") as f:
            f.write(text)
        return
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kvckpt-pointer-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _pointer_engine(pointer: dict[str, Any], path: str, own: Engine | None = None) -> Engine:
    url = pointer["store"]
    if own is not None and own.url == url:
        return own
    with _engines_lock:
        engine = _engines.get(url)
    if engine is not None:
        return engine
    if "***" in url:
        raise KVCheckpointError(
            f"pointer file {path!r} names store {url}, whose password is not written to disk: "
            "create KVCheckpointIO, KVCheckpoint or auto_resume with that store's full URL in "
            "this process before loading"
        )
    return _register(open_store(url, create=False))


def _load_path(
    path: str | os.PathLike,
    *,
    own: Engine | None,
    id_for: Callable[[str], str],
    weights_only: bool,
    map_location: Any,
    fallback: CheckpointIO,
) -> dict[str, Any]:
    """Load whatever ``path`` is: a pointer file, another Lightning checkpoint file (through
    ``fallback``), or, where no file exists, ``own``'s checkpoint of that path."""
    text = os.fspath(path)
    try:
        pointer, exists = read_pointer(text), True
    except IsADirectoryError:  # a sharded checkpoint directory: the fallback's to read
        pointer, exists = None, True
    except FileNotFoundError:
        pointer, exists = None, False
    if pointer is not None:
        engine = _pointer_engine(pointer, text, own)
        return load_checkpoint(
            engine,
            pointer["checkpoint_id"],
            weights_only=weights_only,
            map_location=map_location,
            path=text,
        )
    if exists:
        kwargs = {} if map_location is None else {"map_location": map_location}
        return fallback.load_checkpoint(text, weights_only=weights_only, **kwargs)
    if own is None:
        raise FileNotFoundError(f"Checkpoint file not found: {text}")
    return load_checkpoint(
        own, id_for(text), weights_only=weights_only, map_location=map_location, path=text
    )
