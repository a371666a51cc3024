"""Prefetch: a replaced node's share of the newest checkpoint, from a shared tier into its
node-local store, while the job starts up (``Tiers.prefetch``).

A share is what the ranks of one node wrote. The copy moves only the values the local store
does not already hold whole, carries their checksums, and is recorded like the node's own part
of the save (``record_share``), or published whole where the share is the whole checkpoint; a
copy that fails leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from . import events
from .catalog import mark_pending, publish, read_lease, record_share, unregister
from .choice import Restore, choose_newest, lists_save
from .copying import copy_values
from .engines.base import Engine
from .errors import KVCheckpointError
from .format import CheckpointRecord
from .keys import ItemLocation, part_ranges
from .reader import KVStorageReader

logger = logging.getLogger(__name__)


def bring_share(
    engines: Sequence[Engine], durable: Path | None, share: range | None, timeout: float
) -> Restore | None:
    """Copy the ranks of ``share`` (None: every rank) of the shared tiers' newest checkpoint
    into ``engines[0]``; the choice, now read from the first tier, or None where there was
    nothing to bring."""
    choice = choose_newest(
        engines, durable, single_host=False
    )  # the newest checkpoint of a shared tier
    if choice is None or choice.tier == len(engines):
        return None
    src, dst = engines[choice.tier], engines[0]
    checkpoint_id = choice.checkpoint_id
    with read_lease(src, checkpoint_id, timeout) as renew:
        record = KVStorageReader(src, checkpoint_id=checkpoint_id).read_record()
        if record.created_at != choice.created_at:
            return None  # saved again meanwhile: the restore chooses afresh
        save_id = record.save_id
        whole = share is None or set(range(record.world_size)) <= set(share)
        mine = [loc for loc in record.locations.values() if share is None or loc.rank in share]
        missing = _not_held(dst, record, mine)
        if not missing and (not whole or lists_save(dst, choice)):
            return None
        dst.refuse_unsafe()
        mark_pending(dst, checkpoint_id, save_id, None, timeout)
        phase = events.Phase("prefetch", "copy", checkpoint_id, src.url, tier=choice.tier)
        try:
            copy_values(src, [dst], checkpoint_id, save_id, missing, renew)
            phase.end(sum(loc.nbytes for loc in missing))
            if whole:
                publish(
                    dst,
                    record.metadata,
                    record.locations,
                    checkpoint_id=checkpoint_id,
                    save_id=save_id,
                    world_size=record.world_size,
                    created_at=record.created_at,
                )
            else:
                # Recorded as another node's part of the save: kept by gc, dropped by the
                # coordinator's retention one save later (``tidy_remote_store``).
                record_share(dst, checkpoint_id, save_id, sorted({loc.rank for loc in mine}))
        except BaseException:
            _discard_prefetched(dst, record, missing)
            raise
    logger.info(
        "kvckpt tiers: prefetched %d of %d values of %r from %s into %s",
        len(missing),
        len(mine),
        checkpoint_id,
        src.url,
        dst.url,
    )
    return dataclasses.replace(choice, tier=0, source=dst.url)


def _not_held(
    engine: Engine, record: CheckpointRecord, locs: list[ItemLocation]
) -> list[ItemLocation]:
    """The items of ``locs`` that ``engine`` does not hold whole (every part, its size)."""
    keys = [loc.keys(engine.prefix, record.checkpoint_id, record.save_id) for loc in locs]
    sizes = engine.value_sizes([k for item in keys for k in item])
    missing, at = [], 0
    for loc, item in zip(locs, keys, strict=True):
        want = [b - a for a, b in part_ranges(loc.nbytes, loc.part_bytes)]
        if sizes[at : at + len(item)] != want:
            missing.append(loc)
        at += len(item)
    return missing


def _discard_prefetched(engine: Engine, record: CheckpointRecord, locs: list[ItemLocation]) -> None:
    """After a failed prefetch: delete the values it wrote (never the values the store held
    before) and its pending entry. Best effort: what stays is gc's."""
    try:
        engine.delete(
            key
            for loc in locs
            for key in loc.keys(engine.prefix, record.checkpoint_id, record.save_id)
        )
        unregister(engine, record.checkpoint_id, record.save_id)
    except KVCheckpointError as e:
        logger.warning("could not remove a failed prefetch from %s: %s (run gc)", engine.url, e)
