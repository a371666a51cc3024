"""``KVCheckpointIO``: Lightning's ``CheckpointIO`` plugin for a store."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from ..engines.base import Engine
from ..errors import (
    CheckpointNotFoundError,
)
from ..manage import delete_checkpoint
from ..stores import open_store
from ..urls import validate_name
from ..writer import KVStorageWriter
from .pointers import (
    _full_path,
    _load_path,
    _pointer_engine,
    _register,
    checkpoint_id_for,
    read_pointer,
    write_pointer,
)
from .store import save_checkpoint


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
