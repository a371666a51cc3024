"""What a node's store holds of a checkpoint, and the newest checkpoint the job's surviving
stores hold whole between them (``Tiers(peers=K)``).

A node-local store holds its own ranks' share of each save, and with peer copies the shares of
K other nodes (``kvckpt.peer_copy``). No single store lists such a checkpoint whole, so the
choice of what to restore asks every node: each rank reports the saves whose metadata its
node's store keeps (the coordinator's node commits it; the nodes that keep copies of its share
keep it too), the job goes through them newest first, and for each every rank reports which
items its store holds whole. The first save every item of which some surviving store holds
wins. Every rank runs the same steps in the same order, so the collectives line up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from .catalog import peer_meta_prefix
from .engines.base import Engine
from .format import CheckpointRecord, decode_metadata
from .keys import meta_key
from .manage import list_checkpoints

logger = logging.getLogger(__name__)


def item_order(record: CheckpointRecord) -> list[MetadataIndex]:
    """A checkpoint's items in one order every rank agrees on, whichever store its metadata
    came from: the positions holdings and routes speak of."""
    return sorted(record.locations, key=lambda i: (i.fqn, tuple(i.offset or ()), i.index or 0))


def held_items(
    engine: Engine | None, record: CheckpointRecord, indexes: list[MetadataIndex]
) -> np.ndarray:
    """Which of ``indexes`` the store holds whole (every part, of the right size): key sizes
    only, no data read. A store that cannot answer holds nothing."""
    held = np.zeros(len(indexes), dtype=bool)
    if engine is None:
        return held
    keys: list[str] = []
    owner: list[tuple[int, int]] = []  # (item, expected size) of each key
    for i, index in enumerate(indexes):
        loc = record.locations[index]
        for p, key in enumerate(loc.keys(engine.prefix, record.checkpoint_id, record.save_id)):
            keys.append(key)
            owner.append((i, min(loc.part_bytes, loc.nbytes - p * loc.part_bytes)))
    try:
        sizes = engine.value_sizes(keys)
    except Exception as e:  # every rank must reach the collectives after this one
        logger.warning("kvckpt restore: %s holds nothing usable: %s", engine.url, e)
        return held
    held[:] = True
    for (i, want), got in zip(owner, sizes, strict=True):
        if got != want:
            held[i] = False
    return held


@dataclass(frozen=True)
class HeldSave:
    """A save that the job's node-local stores hold whole between them."""

    checkpoint_id: str
    save_id: str
    created_at: float
    #: the save's encoded metadata, as the coordinator committed it
    metadata: bytes


def _metadata_here(engine: Engine | None) -> dict[tuple[float, str, str], bytes]:
    """(created_at, checkpoint id, save id) -> encoded metadata, of the saves whose metadata
    this node's store keeps: committed there, or kept for a peer (``peer_meta_key``)."""
    found: dict[tuple[float, str, str], bytes] = {}
    if engine is None:
        return found
    try:
        raws = [
            engine.get(meta_key(engine.prefix, info.checkpoint_id))
            for info in list_checkpoints(engine)
            if info.complete and not info.rank_local
        ]
        raws += [engine.get(key) for key in engine.scan(peer_meta_prefix(engine.prefix))]
    except Exception as e:  # every rank must reach the collectives after this one
        logger.warning("kvckpt restore: %s lists nothing usable: %s", engine.url, e)
        return found
    for raw in raws:
        if raw is None:
            continue
        try:
            record = decode_metadata(raw, where=engine.url)
        except Exception:
            continue
        if record.rank is None and record.created_at is not None:
            found[(record.created_at, record.checkpoint_id, record.save_id)] = raw
    return found


def newest_held_whole(
    engine: Engine | None, newer_than: float | None, before: float | None = None
) -> HeldSave | None:
    """Collective over the default group, every rank with its node's store (None where the
    node has none): the newest save newer than ``newer_than`` (and saved before ``before``)
    whose every item some node's store holds whole, or None."""
    here = _metadata_here(engine)
    listed: list[list[tuple[float, str, str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(listed, sorted(here))
    owners: dict[tuple[float, str, str], int] = {}
    for rank, saves in enumerate(listed):
        for save in saves or []:
            owners.setdefault(tuple(save), rank)  # type: ignore[arg-type]
    for save in sorted(owners, reverse=True):
        created_at, checkpoint_id, save_id = save
        if newer_than is not None and created_at <= newer_than:
            break
        if before is not None and created_at >= before:
            continue
        raw = [here.get(save)]
        dist.broadcast_object_list(raw, src=owners[save])
        record = decode_metadata(raw[0], where=f"the metadata of {checkpoint_id!r}")  # type: ignore[arg-type]
        indexes = item_order(record)
        mine = np.packbits(held_items(engine, record, indexes))
        every: list[np.ndarray | None] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        held = np.zeros(len(indexes), dtype=bool)
        for bits in every:
            held |= np.unpackbits(bits, count=len(indexes)).astype(bool)  # type: ignore[arg-type]
        if held.all():
            return HeldSave(checkpoint_id, save_id, created_at, raw[0])  # type: ignore[arg-type]
        logger.info(
            "kvckpt restore: %r (save %s) is not held whole by the surviving nodes' stores "
            "(%d of %d items); trying an older one",
            checkpoint_id,
            save_id,
            int(held.sum()),
            len(indexes),
        )
    return None
