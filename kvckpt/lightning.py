"""PyTorch Lightning: checkpoints in a key-value store (``pip install 'kvckpt[lightning]'``).

Three pieces, usable together or apart:

- ``KVCheckpointIO(url)``: a ``CheckpointIO`` plugin. ``Trainer(plugins=[KVCheckpointIO(url)])``
  sends ``trainer.save_checkpoint``, ``ModelCheckpoint`` (top-k, ``save_last``, removal) and
  ``trainer.fit(ckpt_path=...)`` to the store.
- ``KVCheckpoint(url, every_n_train_steps=N)``: a callback that saves frequent checkpoints
  (``step-000000123``) into a store or ``kvckpt.Tiers`` beside the user's own checkpoints,
  keeping the newest ``keep_last``, optionally in the background.
- ``auto_resume(sources, ckpt_dir=...)``: the newest complete checkpoint in any of them, as a
  path for ``trainer.fit(ckpt_path=...)`` when a job restarts.

How a Lightning checkpoint is stored. Lightning hands over one nested dict (``state_dict``,
``optimizer_states``, ``loops``, ``callbacks``, ...). Every tensor in it becomes a DCP tensor item
(``lightning/tensor/<n>``, numbered in traversal order) stored as raw bytes like any kvckpt
checkpoint. What remains, the *skeleton* (the dict with each tensor replaced by a meta-device
placeholder of its shape and dtype), is ``torch.save``-d into one uint8 tensor item,
``lightning/skeleton``, and loaded back with ``torch.load(weights_only=True)`` (plus
``kvckpt.storage.SAFE_OBJECT_TYPES``), so a store others can write to cannot run code in the job.
Keeping the structure out of DCP matters: DCP's flattening turns the int keys of an optimizer's
``state`` into strings, which ``Optimizer.load_state_dict`` silently ignores.

Lightning saves and removes on global rank 0 only, and loads on every rank, so every DCP call
here runs with ``no_dist=True``: no collective, and the checkpoint records a world size of 1
(it is complete as soon as rank 0 commits it).

Checkpoint ids and pointer files. Lightning names checkpoints by path. The id of a path is its
file name without ``.ckpt``, cleaned to kvckpt's id alphabet, plus a hash of its directory:
``/runs/a/checkpoints/epoch=1-step=40.ckpt`` -> ``epoch=1-step=40.<8 hex digits>``, so two runs
that share a store but not a directory never collide (``checkpoint_id_for``). After each save a
small JSON *pointer file* is written at the path itself (store URL with any password masked, id,
commit time). It keeps what Lightning does with local files working: ``ModelCheckpoint``'s
existence checks and version suffixes, ``ckpt_path="last"``, and ``auto_resume``. The store is
the truth: a load of a path with no pointer file (a replaced node whose local disk is gone) finds
the id from the path alone.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvckpt.lightning needs the `lightning` package (2.6.x): pip install 'kvckpt[lightning]'"
    ) from e

from .engines.base import Engine
from .errors import (
    CheckpointNotFoundError,
    DataError,
    KVCheckpointError,
    MetadataError,
    StoreNotFoundError,
    UnsafeObjectError,
)
from .manage import delete_checkpoint, discard_save, list_checkpoints
from .reader import KVStorageReader, plain_types_allowed, refusal
from .stores import open_store
from .tiered import Tiers
from .urls import validate_name
from .writer import KVStorageWriter

__all__ = [
    "KVCheckpoint",
    "KVCheckpointIO",
    "auto_resume",
    "checkpoint_id_for",
    "load_checkpoint",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

SKELETON_FQN = "lightning/skeleton"
TENSOR_FQN = "lightning/tensor/{}"
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


# -- splitting a Lightning checkpoint into tensors and a skeleton ------------------------------


def _placeholder(tensor: torch.Tensor, where: str) -> torch.Tensor:
    if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"kvckpt.lightning stores plain dense tensors; {where} is a {type(tensor).__name__} "
            f"with layout {tensor.layout}. Convert it (e.g. .to_dense() or .full_tensor()) in "
            "on_save_checkpoint, or checkpoint it with Lightning's default CheckpointIO."
        )
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors of a Lightning checkpoint dict, keyed by DCP fqn, and its pickled skeleton.

    Dicts (``OrderedDict`` included, with its ``_metadata``), lists and tuples are walked; each
    tensor is replaced by a meta placeholder, in the order ``_fill`` walks them back. The
    caller's dict is not changed."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            placeholder = _placeholder(obj, where)
            tensors[TENSOR_FQN.format(len(tensors))] = obj.detach()
            return placeholder
        if isinstance(obj, dict):
            out = {} if type(obj) is dict else copy.copy(obj)
            for k, v in obj.items():
                out[k] = strip(v, f"{where}[{k!r}]")
            return out
        if isinstance(obj, list):
            items = [strip(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            if type(obj) is list:
                return items
            same = copy.copy(obj)  # a list subclass keeps its class
            same[:] = items
            return same
        if isinstance(obj, tuple):
            items = [strip(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return tuple(items) if type(obj) is tuple else type(obj)(*items)
        return obj

    skeleton = strip(checkpoint, "checkpoint")
    buffer = io.BytesIO()
    torch.save({"format": 1, "tensors": len(tensors), "checkpoint": skeleton}, buffer)
    return tensors, buffer.getvalue()


def _fill(obj: Any, tensors: list[torch.Tensor], used: list[int]) -> Any:
    """Put the loaded tensors back in place of the skeleton's meta placeholders, in order."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            return obj
        i = used[0]
        used[0] += 1
        if i >= len(tensors):
            return obj  # reported by the caller: more placeholders than tensors
        return tensors[i]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _fill(v, tensors, used)
        return obj
    if isinstance(obj, list):
        obj[:] = [_fill(v, tensors, used) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, tensors, used) for v in obj]
        return tuple(items) if type(obj) is tuple else type(obj)(*items)
    return obj


def _unpickle_skeleton(data: bytes, weights_only: bool, where: str) -> dict[str, Any]:
    if not weights_only:
        return torch.load(io.BytesIO(data), map_location=None, weights_only=False)
    try:
        with plain_types_allowed():
            return torch.load(io.BytesIO(data), map_location=None, weights_only=True)
    except Exception as e:
        raise UnsafeObjectError(
            f"the Lightning checkpoint {where} holds objects that "
            f"torch.load(weights_only=True) refuses: {refusal(e)}. Allow the types you expect "
            "with torch.serialization.add_safe_globals([...]); or, if you trust everyone who can "
            "write to this store, load with trainer.fit(..., weights_only=False) or "
            "KVCheckpointIO(..., weights_only=False)."
        ) from None


# -- one checkpoint in a store ------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """What ``save_checkpoint`` committed."""

    checkpoint_id: str
    save_id: str
    created_at: float


@contextlib.contextmanager
def _dcp_errors() -> Iterator[None]:
    """Raise the error of a one-process DCP call itself, not DCP's ``CheckpointException``
    around it: that is a ``BaseException`` (``except Exception`` misses it) whose message is
    a traceback, where a Lightning user should see e.g. kvckpt's ``StoreFullError``."""
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        if len(failures) != 1:
            raise
        raise failures[0][0] from None


def _drop_crashed_saves(engine: Engine, checkpoint_id: str) -> None:
    """Drop uncommitted saves of ``checkpoint_id`` (a writer that died mid-save holds its write
    lease for up to a minute, and the id would refuse a new save meanwhile). Lightning writes
    each id from global rank 0 only, one save at a time, so any such save is a dead one."""
    try:
        infos = list_checkpoints(engine, include_incomplete=True)
    except StoreNotFoundError:
        return
    for info in infos:
        if info.checkpoint_id == checkpoint_id and not info.complete and info.save_id:
            discard_save(engine, checkpoint_id, info.save_id)


def save_checkpoint(
    checkpoint: dict[str, Any] | tuple[dict[str, torch.Tensor], bytes],
    writer: KVStorageWriter,
    checkpoint_id: str,
) -> Saved:
    """Save a Lightning checkpoint dict (or its ``split_checkpoint``) as checkpoint
    ``checkpoint_id`` through ``writer``; collective-free (``no_dist=True``). An existing id is
    replaced atomically: readers see the old checkpoint or the new one, and a save that fails
    leaves the old one as it was."""
    tensors, skeleton = (
        checkpoint if isinstance(checkpoint, tuple) else split_checkpoint(checkpoint)
    )
    _drop_crashed_saves(writer.engine, checkpoint_id)
    state: dict[str, Any] = dict(tensors)
    state[SKELETON_FQN] = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
    writer.reset(checkpoint_id)
    with _dcp_errors():
        dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id, no_dist=True)
    return Saved(checkpoint_id, writer.save_id, writer.committed_at or time.time())


def load_checkpoint(
    store: str | Engine,
    checkpoint_id: str,
    *,
    weights_only: bool = True,
    map_location: Any = None,
    path: str | None = None,
) -> dict[str, Any]:
    """Load the Lightning checkpoint dict saved as ``checkpoint_id`` (tensors on the CPU, or on
    ``map_location`` when that is a device or device string). ``path`` only names the
    Lightning path in errors."""
    engine = open_store(store, create=False)
    named = f"{path!r} (checkpoint {checkpoint_id!r} in {engine.url})" if path else None
    where = named or f"{checkpoint_id!r} in {engine.url}"
    reader = KVStorageReader(engine, checkpoint_id=checkpoint_id)
    try:
        record = reader.read_record()
    except CheckpointNotFoundError as e:
        what = f"Lightning checkpoint {path!r}: " if path else ""
        raise type(e)(
            f"{what}{e}. Check that the store URL is the one the checkpoint was saved to; a "
            "store kept in memory (Redis without persistence, LMDB on /dev/shm) loses its "
            "checkpoints when the server or node restarts."
        ) from None
    items = record.metadata.state_dict_metadata
    if not isinstance(items.get(SKELETON_FQN), TensorStorageMetadata):
        raise MetadataError(
            f"{where} is not a Lightning checkpoint saved by kvckpt.lightning (it has no "
            f"{SKELETON_FQN!r} item); load it with dcp.load and KVStorageReader instead"
        )
    state = {
        fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for fqn, md in items.items()
        if isinstance(md, TensorStorageMetadata)
    }
    # The same save as the metadata just read, even if the id is re-saved meanwhile.
    pinned = KVStorageReader(engine, checkpoint_id=checkpoint_id, save_id=record.save_id)
    with _dcp_errors():
        dcp.load(state, storage_reader=pinned, no_dist=True)
    data = state.pop(SKELETON_FQN).numpy().tobytes()
    wrapped = _unpickle_skeleton(data, weights_only, where)
    if not isinstance(wrapped, dict) or wrapped.get("format") != 1:
        raise MetadataError(f"the skeleton of {where} is not kvckpt.lightning format 1")
    count = wrapped.get("tensors")
    tensors = [state.get(TENSOR_FQN.format(i)) for i in range(count if type(count) is int else 0)]
    if count != len(state) or any(t is None for t in tensors):  # (then every t is a Tensor)
        raise DataError(
            f"{where} is damaged: its skeleton names {count} tensors, the checkpoint holds "
            f"{len(state)}"
        )
    if isinstance(map_location, str | torch.device):
        tensors = [t.to(map_location) for t in tensors]  # type: ignore[union-attr]
    used = [0]
    checkpoint = _fill(wrapped["checkpoint"], tensors, used)  # type: ignore[arg-type]
    if used[0] != len(tensors):
        raise DataError(
            f"{where} is damaged: its skeleton has {used[0]} tensor places for "
            f"{len(tensors)} tensors"
        )
    return checkpoint


# -- paths, ids and pointer files ----------------------------------------------------------------


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


# -- the CheckpointIO plugin ---------------------------------------------------------------------


class KVCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that keeps checkpoints in a kvckpt store.

    ``Trainer(plugins=[KVCheckpointIO("redis://ckpt-redis:6379/0?prefix=run7")])``: every
    checkpoint Lightning saves at a path goes to the store under ``checkpoint_id_for(path)``,
    with a pointer file written at the path (module docstring). Loads accept a pointer file,
    a path whose pointer file is gone (the id comes from the path), or an ordinary
    ``torch.save`` checkpoint file (read as Lightning's ``TorchCheckpointIO`` reads it).

    Args:
        store: a store URL (``lmdb:///dev/shm/ckpt``, ``redis://host:6379/0``) or an engine.
        checkpoint_id: a function from a path to a checkpoint id, instead of
            ``checkpoint_id_for``.
        weights_only: load the non-tensor part under ``torch.load(weights_only=True)`` rules
            unless the load itself asks otherwise (``trainer.fit(..., weights_only=False)``).
            Lightning's default ``weights_only=None`` counts as True.
        **writer_options: passed to ``KVStorageWriter`` (``checksums``, ``lease``, ``ttl``).

    Lightning looks for ``ckpt_path="last"`` and checks ``ModelCheckpoint``'s files on each
    rank's local filesystem, so in a multi-node job the pointer files belong on a filesystem
    every node sees, as Lightning's own checkpoint files do; or pass ``fit`` the path
    explicitly: a path without its pointer file loads from the store by its id.
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: Callable[[str], str] | None = None,
        weights_only: bool = True,
        **writer_options: Any,
    ) -> None:
        super().__init__()
        self.engine = _register(open_store(store))
        self._id_for = checkpoint_id or checkpoint_id_for
        self.weights_only = weights_only
        if "keep_last" in writer_options:
            raise TypeError(
                "KVCheckpointIO does not take keep_last: ModelCheckpoint(save_top_k=...) decides "
                "which checkpoints stay, and removes the others through this plugin"
            )
        self.writer_options = writer_options

    def __repr__(self) -> str:
        return f"KVCheckpointIO({self.engine.url!r})"

    def checkpoint_id(self, path: str | os.PathLike) -> str:
        """The store's checkpoint id for a Lightning path."""
        return validate_name(self._id_for(_full_path(path)))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "KVCheckpointIO.save_checkpoint takes no storage_options: give KVCheckpointIO "
                "writer options (checksums=, lease=, ttl=) when you create it"
            )
        saved = save_checkpoint(
            checkpoint,
            KVStorageWriter(self.engine, **self.writer_options),
            self.checkpoint_id(path),
        )
        write_pointer(path, self.engine, saved)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return _load_path(
            path,
            own=self.engine,
            id_for=self.checkpoint_id,
            weights_only=self.weights_only if weights_only is None else weights_only,
            map_location=map_location,
            fallback=TorchCheckpointIO(),
        )

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the store's checkpoint of ``path`` first, then its pointer file (a crash
        between the two leaves a pointer whose load fails clearly, never data nobody points
        to). A ``torch.save`` file at ``path`` is simply deleted, and so is a pointer that is
        not ``path``'s own: ``save_last="link"``'s symlink to a top-k checkpoint, or its copy
        where links are not available, whose removal must leave that checkpoint alone."""
        text = os.fspath(path)
        fs = get_filesystem(text)
        if os.path.islink(text):
            fs.rm(text)
            return
        try:
            pointer = read_pointer(text)
        except FileNotFoundError:
            pointer, exists = None, False
        else:
            exists = True
        if pointer is not None and pointer["checkpoint_id"] == self.checkpoint_id(text):
            engine, cid = _pointer_engine(pointer, text, self.engine), pointer["checkpoint_id"]
        elif exists:
            fs.rm(text)
            return
        else:
            engine, cid = self.engine, self.checkpoint_id(text)
        with contextlib.suppress(CheckpointNotFoundError):
            delete_checkpoint(engine, cid)
        if exists:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(text)

    def teardown(self) -> None:
        self.engine.close()


class _PointerAwareIO(CheckpointIO):
    """The Trainer's own ``CheckpointIO``, plus loads of pointer files: what ``KVCheckpoint``
    installs when the Trainer has no ``KVCheckpointIO``, so that ``auto_resume``'s answer
    loads either way."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, os.fspath(path), storage_options=storage_options)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return _load_path(
            path,
            own=None,
            id_for=checkpoint_id_for,
            weights_only=True if weights_only is None else weights_only,
            map_location=map_location,
            fallback=self.inner,
        )

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.inner.remove_checkpoint(os.fspath(path))

    def teardown(self) -> None:
        self.inner.teardown()


# -- the callback --------------------------------------------------------------------------------


StoreSpec = str | Engine | Tiers | Sequence[str | Engine]


class KVCheckpoint(Callback):
    """Frequent checkpoints into a kvckpt store, beside the user's own (file) checkpoints.

    Every ``every_n_train_steps`` optimizer steps (at ``on_train_batch_end``, where
    ``ModelCheckpoint(every_n_train_steps=...)`` saves too) the full Lightning checkpoint is
    saved as ``<name>-<global step, 9 digits>`` by global rank 0 (DDP ranks hold the same
    state; every rank builds the checkpoint dict, as ``trainer.save_checkpoint`` does, since a
    sharded strategy gathers optimizer state collectively). Load one with ``auto_resume``.

    Args:
        store: a store URL or engine; a list of them (fastest first: made into ``Tiers``); or
            a ``kvckpt.Tiers`` (copies to its slower stores run in its background thread).
        every_n_train_steps: save when the global step is a multiple of this.
        keep_last: after each save, delete this callback's checkpoints (ids ``<name>-<9
            digits>``) beyond the newest ``keep_last`` (by commit time) from every store; None
            keeps all. Other checkpoints in the same namespace are never touched.
        async_save: copy the tensors (a staging copy in host memory) and write them to the
            store in a background thread while training goes on. Only one save is in flight:
            the next save (and the end of fit) first waits for it, and raises its error if it
            failed.
        name: the checkpoint ids' prefix.
        writer_options: passed to ``KVStorageWriter`` (``checksums``, ``lease``, ``ttl``).

    Why not ``ModelCheckpoint`` + ``KVCheckpointIO``: this keeps the user's own checkpoints as
    they are (files, on durable storage) and adds cheap in-memory ones for restarts, with a
    retention of its own.

    In a multi-node job, give it a store every node reaches (Redis, or ``Tiers`` with a shared
    tier): global rank 0 alone saves, so a node-local LMDB store holds the checkpoints on rank
    0's node only.
    """

    def __init__(
        self,
        store: StoreSpec,
        *,
        every_n_train_steps: int,
        keep_last: int | None = 2,
        async_save: bool = False,
        name: str = "step",
        **writer_options: Any,
    ) -> None:
        super().__init__()
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, not {every_n_train_steps}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, not {keep_last}")
        self.tiers: Tiers | None
        #: The stores of a ``Tiers`` this callback built (and so closes at teardown).
        self._own_tiers: list[str | Engine] | None = None
        if isinstance(store, Tiers):
            self.tiers = store
        elif isinstance(store, str | Engine):
            self.tiers = None
        else:
            self._own_tiers = list(store)
        self.writer_options = writer_options
        self._open(store)
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.async_save = async_save
        self.name = validate_name(name, "checkpoint id prefix", 180)
        self._id_re = re.compile(rf"^{re.escape(self.name)}-(\d{{9}})$")
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_id: str | None = None
        self._last_step = -1
        self._installed: tuple[Any, CheckpointIO] | None = None

    def _open(self, store: StoreSpec) -> None:
        """The engines to save to; the ``Tiers`` this callback owns is built here (again, for
        a fit after the teardown that closed it)."""
        if self._own_tiers is not None:
            self.tiers = Tiers(self._own_tiers, **self.writer_options)
        self.engines = (
            list(self.tiers.engines) if self.tiers is not None else [open_store(store)]  # type: ignore[arg-type]
        )
        for engine in self.engines:
            _register(engine)

    def __repr__(self) -> str:
        return f"KVCheckpoint({[e.url for e in self.engines]}, every={self.every_n_train_steps})"

    def checkpoint_id(self, step: int) -> str:
        return f"{self.name}-{step:09d}"

    def owns(self, checkpoint_id: str) -> bool:
        """Whether an id is one of this callback's (retention deletes only these)."""
        return self._id_re.match(checkpoint_id) is not None

    # -- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._own_tiers is not None and self.tiers is None:  # a fit after teardown
            self._open(self._own_tiers)
        strategy = trainer.strategy
        io_plugin = strategy.checkpoint_io
        if not isinstance(io_plugin, KVCheckpointIO | _PointerAwareIO):
            strategy.checkpoint_io = _PointerAwareIO(io_plugin)
            self._installed = (strategy, io_plugin)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._drop_crashed()
        self._last_step = trainer.global_step  # no save of the step a resume starts from

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step <= 0 or step % self.every_n_train_steps or step == self._last_step:
            return
        self._last_step = step
        if trainer.is_global_zero:
            self.wait()  # one save in flight; its staging copy is freed before the next
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if not trainer.is_global_zero:
            return
        tensors, skeleton = split_checkpoint(checkpoint)
        del checkpoint
        checkpoint_id = self.checkpoint_id(step)
        if not self.async_save:
            self._save(checkpoint_id, tensors, skeleton)
            return
        # The staging copy: training may change the live tensors as soon as this returns.
        staged = {fqn: t.to("cpu", copy=True) for fqn, t in tensors.items()}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvckpt-lightning")
        self._pending_id = checkpoint_id
        self._pending = self._pool.submit(self._save, checkpoint_id, staged, skeleton)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wait()
        if self.tiers is not None and trainer.is_global_zero:
            self.tiers.wait()
            if self.keep_last is not None:
                self._retain()  # what retention skipped while copies were in flight

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self.wait()
        except Exception as e:  # the training error is the one to report
            logger.error("kvckpt.lightning: %s", e)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._installed is not None:
            strategy, original = self._installed
            strategy.checkpoint_io = original
            self._installed = None
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self.wait()
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._own_tiers is not None and self.tiers is not None:
            # Its copy thread ends here (after the copies queued, which on_train_end already
            # waited for unless training failed); a later fit builds it again in setup.
            tiers, self.tiers = self.tiers, None
            try:
                tiers.close()
            except Exception as e:  # a training error, if any, is the one to report
                logger.error("kvckpt.lightning: %s", e)

    # -- saving

    def wait(self) -> None:
        """Block until the background save (if any) is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:
            raise KVCheckpointError(
                f"kvckpt.lightning: the background save of checkpoint {self._pending_id!r} to "
                f"{self.engines[0].url} failed: {e}"
            ) from e

    def _writer(self) -> KVStorageWriter:
        if self.tiers is not None:
            return self.tiers.writer()
        return KVStorageWriter(self.engines[0], **self.writer_options)

    def _save(self, checkpoint_id: str, tensors: dict[str, torch.Tensor], skeleton: bytes) -> None:
        save_checkpoint((tensors, skeleton), self._writer(), checkpoint_id)
        if self.keep_last is not None:
            self._retain()

    def _retain(self) -> None:
        busy = self.tiers.busy_ids() if self.tiers is not None else set()
        for engine in self.engines:
            try:
                infos = list_checkpoints(engine)
            except StoreNotFoundError:
                continue
            # Newest first by commit time, as auto_resume chooses: after a resume from an
            # earlier step, the new branch's checkpoints are the ones to keep.
            mine = [i.checkpoint_id for i in infos if self.owns(i.checkpoint_id)]
            for checkpoint_id in mine[self.keep_last :]:
                if checkpoint_id in busy:
                    continue  # its copy to a slower tier is still running
                with contextlib.suppress(CheckpointNotFoundError):
                    delete_checkpoint(engine, checkpoint_id, reuse=True)

    def _drop_crashed(self) -> None:
        """Drop this callback's saves that never committed (a job killed mid-save), which
        would otherwise hold their ids' write leases and data until ``kvckpt gc``."""
        for engine in self.engines:
            try:
                infos = list_checkpoints(engine, include_incomplete=True)
            except StoreNotFoundError:
                continue
            for info in infos:
                if not info.complete and info.save_id and self.owns(info.checkpoint_id):
                    with contextlib.suppress(KVCheckpointError):
                        discard_save(engine, info.checkpoint_id, info.save_id)


# -- auto-resume ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    created_at: float
    order: int  # lower is preferred at equal times: the order sources were given in
    path: str | None = None  # a local file (a pointer file or a torch.save checkpoint)
    engine: Engine | None = None
    checkpoint_id: str | None = None


def _engines_of(source: Any) -> list[Engine]:
    if isinstance(source, KVCheckpointIO):
        return [source.engine]
    if isinstance(source, KVCheckpoint):
        return list(source.engines)
    if isinstance(source, Tiers):
        return list(source.engines)
    if isinstance(source, str | Engine):
        try:
            return [open_store(source, create=False)]
        except StoreNotFoundError:
            return []
    raise TypeError(
        "auto_resume takes store URLs, engines, Tiers, KVCheckpoint or KVCheckpointIO, not "
        f"{type(source).__name__}"
    )


def _is_lightning(engine: Engine, checkpoint_id: str) -> bool:
    try:
        record = KVStorageReader(engine, checkpoint_id=checkpoint_id).read_record()
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    return SKELETON_FQN in record.metadata.state_dict_metadata


def auto_resume(
    sources: Any,
    ckpt_dir: str | os.PathLike | None = None,
    *,
    pointer_dir: str | os.PathLike | None = None,
) -> str | None:
    """The newest complete checkpoint among ``sources`` and ``ckpt_dir``, as a path for
    ``trainer.fit(model, ckpt_path=auto_resume(...))``; None when there is none (a fresh start).

    Args:
        sources: one or a list of: store URLs, engines, ``kvckpt.Tiers``, ``KVCheckpoint``
            callbacks, ``KVCheckpointIO`` plugins. Every complete checkpoint saved by
            kvckpt.lightning there is a candidate, at the time its save committed. A store
            that does not exist yet (an LMDB directory never written) has none; one that
            cannot be reached raises, rather than silently restarting from scratch.
        ckpt_dir: a directory of Lightning checkpoint files (searched recursively for
            ``*.ckpt``): ``torch.save`` files count at their modification time, pointer files
            at their checkpoint's commit time (and only if the store still holds it).
        pointer_dir: where the pointer file for a store checkpoint is written (default: a
            ``kvckpt-lightning`` directory under the system temp directory); the name holds
            the process id, so ranks never write one file.

    The newest wins; at equal times, the earlier source (so list the fastest store first).
    Every process of the job must see the same candidates to make the same choice: a shared
    store (Redis), or LMDB with every rank on one node. The Trainer must be able to read the
    answer: ``KVCheckpointIO`` or ``KVCheckpoint`` among its plugins or callbacks.
    """
    if not isinstance(sources, list | tuple):
        sources = [sources]
    candidates: list[_Candidate] = []
    order = 0
    for source in sources:
        for engine in _engines_of(source):
            _register(engine)
            try:
                infos = list_checkpoints(engine)
            except StoreNotFoundError:  # an LMDB store never created: a fresh start
                infos = []
            for info in infos:
                if info.complete and not info.rank_local:
                    candidates.append(
                        _Candidate(
                            info.created_at, order, engine=engine, checkpoint_id=info.checkpoint_id
                        )
                    )
            order += 1
    if ckpt_dir is not None and Path(ckpt_dir).is_dir():
        candidates += _file_candidates(Path(ckpt_dir), order)
    candidates.sort(key=lambda c: (-c.created_at, c.order))
    for choice in candidates:
        if choice.path is not None:
            return choice.path
        assert choice.engine is not None and choice.checkpoint_id is not None
        if not _is_lightning(choice.engine, choice.checkpoint_id):
            continue
        return _resume_pointer(choice, pointer_dir)
    return None


def _file_candidates(directory: Path, order: int) -> list[_Candidate]:
    found: list[_Candidate] = []
    for path in sorted(directory.rglob("*.ckpt")):
        if not path.is_file():
            continue
        try:
            pointer = read_pointer(path)
        except (OSError, KVCheckpointError) as e:
            logger.warning("auto_resume skips %s: %s", path, e)
            continue
        if pointer is None:
            found.append(_Candidate(path.stat().st_mtime, order, path=str(path)))
            continue
        try:
            engine = _pointer_engine(pointer, str(path))
            infos = list_checkpoints(engine)
        except KVCheckpointError as e:
            logger.warning("auto_resume skips pointer file %s: %s", path, e)
            continue
        for info in infos:
            if info.checkpoint_id == pointer["checkpoint_id"] and info.complete:
                found.append(_Candidate(info.created_at, order, path=str(path)))
    return found


def _resume_pointer(choice: _Candidate, pointer_dir: str | os.PathLike | None) -> str:
    assert choice.engine is not None and choice.checkpoint_id is not None
    directory = (
        Path(pointer_dir)
        if pointer_dir is not None
        else Path(tempfile.gettempdir()) / "kvckpt-lightning"
    )
    store = hashlib.sha256(choice.engine.url.encode()).hexdigest()[:8]
    path = directory / f"resume-{choice.checkpoint_id}.{store}.{os.getpid()}.ckpt"
    write_pointer(path, choice.engine, Saved(choice.checkpoint_id, "", choice.created_at))
    logger.info(
        "auto_resume: checkpoint %r in %s (pointer file %s)",
        choice.checkpoint_id,
        choice.engine.url,
        path,
    )
    return str(path)
