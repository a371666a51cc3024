"""``auto_resume``: the newest complete checkpoint in any store or directory, as a path."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engines.base import Engine
from ..errors import (
    CheckpointNotFoundError,
    KVCheckpointError,
    StoreNotFoundError,
)
from ..manage import list_checkpoints
from ..reader import KVStorageReader
from ..stores import open_store
from ..tiered import Tiers
from .callback import KVCheckpoint
from .checkpoint_io import KVCheckpointIO
from .pointers import _pointer_engine, _register, read_pointer, write_pointer
from .skeleton import SKELETON_FQN
from .store import Saved

logger = logging.getLogger(__name__)


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
