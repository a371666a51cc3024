"""One Lightning checkpoint in a store: ``save_checkpoint`` and ``load_checkpoint``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..engines.base import Engine
from ..errors import (
    CheckpointNotFoundError,
    DataError,
    MetadataError,
    StoreNotFoundError,
)
from ..manage import discard_save, list_checkpoints
from ..reader import KVStorageReader
from ..stores import open_store
from ..writer import KVStorageWriter
from .skeleton import SKELETON_FQN, TENSOR_FQN, _fill, _unpickle_skeleton, split_checkpoint


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


def _discard_crashed_saves(engine: Engine, checkpoint_id: str) -> None:
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
    _discard_crashed_saves(writer.engine, checkpoint_id)
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
