"""Which checkpoint a restart restores, and from which tier.

The newest complete checkpoint in any tier wins, read from the fastest tier that holds that
very save (same id and commit time: a tier holding an older save under the same id, a copy
that failed, does not count). ``Tiers.latest`` makes this choice on one rank and shares it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .engines.base import Engine
from .errors import KVCheckpointError
from .manage import list_checkpoints

logger = logging.getLogger(__name__)

#: written into each durable checkpoint directory: the time the checkpoint was taken
DURABLE_INFO = "kvckpt.json"


@dataclass(frozen=True)
class Restore:
    """Where a restart's checkpoint comes from: what ``Tiers.restore`` loaded and
    ``Tiers.latest`` would load (both return None when no tier holds a checkpoint).

    Attributes:
        checkpoint_id: the checkpoint's id, as it was saved (``"step-100"``): the training
            step is whatever the id says, or whatever the state dict holds.
        tier: where it is read from: an index into ``Tiers.stores`` (0 the fastest), or
            ``len(Tiers.stores)`` for the durable directory.
        source: that store's URL (password masked) or the checkpoint's durable directory.
        created_at: Unix time of the save's commit in the first tier (copies keep it).
    """

    checkpoint_id: str
    tier: int
    source: str
    created_at: float


def choose_newest(
    engines: Sequence[Engine],
    durable: Path | None,
    single_host: bool,
    before: float | None = None,
) -> Restore | None:
    """The newest complete checkpoint in ``engines`` (fastest first) and ``durable`` (saved
    before ``before``, where given), and the fastest tier that holds it. Off a single host,
    node-local stores are not searched: each holds only its own node's part of a save."""
    found: list[Restore] = []
    for i, engine in enumerate(engines):
        if not (engine.shared or single_host):
            continue
        try:
            infos = list_checkpoints(engine)
        except KVCheckpointError as e:
            logger.warning("restore skips %s: %s", engine.url, e)
            continue
        found += [
            Restore(info.checkpoint_id, i, engine.url, info.created_at)
            for info in infos
            if info.complete and not info.rank_local
        ]
    if durable is not None and durable.is_dir():
        for path in durable.iterdir():
            if path.name.startswith(".") or not (path / ".metadata").is_file():
                continue
            found.append(Restore(path.name, len(engines), str(path), _durable_time(path)))
    if before is not None:
        found = [r for r in found if r.created_at < before]
    if not found:
        return None
    newest = max(found, key=lambda r: r.created_at)
    # Copies keep their original's commit time.
    return min(
        (
            r
            for r in found
            if r.checkpoint_id == newest.checkpoint_id and r.created_at == newest.created_at
        ),
        key=lambda r: r.tier,
    )


def lists_save(engine: Engine, choice: Restore) -> bool:
    """Whether ``engine`` lists the chosen save as a complete checkpoint."""
    try:
        infos = list_checkpoints(engine)
    except KVCheckpointError:
        return False
    return any(
        i.checkpoint_id == choice.checkpoint_id and i.created_at == choice.created_at for i in infos
    )


def _durable_time(path: Path) -> float:
    try:
        info = json.loads((path / DURABLE_INFO).read_text())
        return float(info["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return (path / ".metadata").stat().st_mtime
