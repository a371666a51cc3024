"""Copying a checkpoint between stores: ``copy_checkpoint`` (``kvckpt copy``), and
``copy_values``, the one copy of a save's values between stores that ``copy``, ``Tiers``'
replica copies and prefetch all go through.

A copy is committed at its destination the way a save is (metadata last, in one transaction),
and is refused before anything is written where the destination cannot take it safely: the
same ``Engine.preflight`` a save runs (a Redis that may evict keys, one without room), and a
store that cannot be created where its URL points.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from .adapter import new_save_id
from .catalog import mark_pending, publish, read_index, read_lease
from .engines.base import Engine
from .errors import (
    CheckpointExistsError,
    KVCheckpointError,
    StoreUnavailableError,
    UnwritablePathError,
)
from .format import CheckpointRecord, checksum, new_checksum
from .keys import ItemLocation, index_name, part_ranges, spare_key
from .manage import discard_save, preflight
from .reader import KVStorageReader, corrupted, damaged, read_checked
from .stores import open_store
from .urls import validate_name
from .verify import TOOL_READ_LEASE, checkpoint_records, progress_bar

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex

logger = logging.getLogger(__name__)


def copy_checkpoint(
    src: str | Engine,
    checkpoint_id: str,
    dst: str | Engine,
    new_id: str | None = None,
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> CheckpointRecord:
    """Copy a committed checkpoint to another store (or another id), committing it there the
    same way a save does. E.g. a node's LMDB to the shared Redis.

    The copy keeps the original's commit time (``created_at``), so ``latest_checkpoint``,
    listings and ``keep_last`` order it where the original stands, not as the newest. Every
    value is checked as it is read against the checksum its save recorded, and the copy records
    the same checksums; a mismatch raises ``IntegrityError`` naming the checkpoint, the key
    and the source, and leaves nothing of the copy in ``dst``. (A source saved without
    checksums is copied as read; the copy records checksums where ``dst`` records them by
    default, as a save there would.) A checkpoint that ``dst`` already holds under the target
    id is replaced only with ``overwrite=True``.

    Nothing is written to ``dst`` where it cannot take the copy: a store that may evict keys
    raises ``UnsafeStoreError`` and one without room ``StoreFullError`` (``Engine.preflight``,
    as for a save), and a store that cannot be created where its URL points
    ``UnwritablePathError``."""
    src_engine, dst_engine = open_store(src, create=False), open_store(dst)
    target = validate_name(new_id or checkpoint_id)
    if (
        src_engine.url == dst_engine.url
        and src_engine.prefix == dst_engine.prefix
        and target == checkpoint_id
    ):
        raise KVCheckpointError("copying a checkpoint onto itself: give a NEW_ID or another store")
    with read_lease(src_engine, checkpoint_id, TOOL_READ_LEASE):
        records = checkpoint_records(src_engine, checkpoint_id)
        prepare_destination(dst_engine, target, sum(r.total_bytes for r in records))
        if not overwrite:
            _refuse_existing(dst_engine, target)
        copies: list[tuple[CheckpointRecord, str, dict[MetadataIndex, ItemLocation]]] = []
        try:
            # Every record's data first, then the commits: a failed check on any rank's data
            # commits none of them.
            for record in records:
                save_id = new_save_id()
                mark_pending(dst_engine, target, save_id, record.rank)
                copies.append((record, save_id, {}))
                into = copies[-1][2]
                _copy_record(src_engine, record, dst_engine, target, save_id, into, progress)
        except BaseException:
            discard_copies(dst_engine, target, [(s, r.rank) for r, s, _ in copies])
            raise
        for record, save_id, locations in copies:
            publish(
                dst_engine,
                record.metadata,
                locations,
                checkpoint_id=target,
                save_id=save_id,
                world_size=record.world_size,
                rank=record.rank,
                created_at=record.created_at,
            )
    return KVStorageReader(dst_engine, checkpoint_id=target).read_record(rank=records[-1].rank)


def _refuse_existing(dst: Engine, target: str) -> None:
    """Refuse to copy over a checkpoint (any of its ranks) that ``dst`` holds."""
    if any(e.get("checkpoint_id") == target for e in read_index(dst).checkpoints.values()):
        raise CheckpointExistsError(
            f"checkpoint {target!r} already exists in {dst.url}: pass overwrite=True "
            "(kvckpt copy --force) to replace it, or copy under a NEW_ID"
        )


def prepare_destination(dst: Engine, checkpoint_id: str, nbytes: int) -> None:
    """Before a copy or an import writes ``nbytes`` of checkpoint ``checkpoint_id`` into
    ``dst``, with nothing written yet: refuse a store that cannot take them safely
    (``Engine.preflight``, as a save does: ``UnsafeStoreError`` for a Redis that may evict
    keys, ``StoreFullError`` for one without room, the spares that retention kept counted as
    room the copy writes over), then open it. A node-local store that cannot be opened or
    created where its URL points (an LMDB path under /proc, or under a file) is a destination
    that cannot be written (``UnwritablePathError``), not a store that is down."""
    try:
        preflight(dst, nbytes)
        read_index(dst)  # opens the store: an LMDB directory is created here
    except StoreUnavailableError as e:
        if dst.shared or e.__cause__ is None:
            raise
        cause = e.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else cause
        raise UnwritablePathError(
            f"cannot write checkpoint {checkpoint_id!r} to {dst.url}: {reason}; choose a "
            "store path you can write to (e.g. lmdb:///dev/shm/NAME)"
        ) from e


def discard_copies(dst: Engine, target: str, saves: list[tuple[str, int | None]]) -> None:
    """Remove the data and pending entries of copies (or imports) that will not commit."""
    for save_id, rank in saves:
        try:
            discard_save(dst, target, save_id, rank)
        except KVCheckpointError as e:  # gc removes it later
            logger.warning(
                "could not remove the failed copy of %r from %s: %s (run gc)", target, dst.url, e
            )


def _copy_record(
    src: Engine,
    record: CheckpointRecord,
    dst: Engine,
    target: str,
    save_id: str,
    locations: dict[MetadataIndex, ItemLocation],
    progress: bool,
) -> None:
    """Copy a record's values to ``dst`` as save ``save_id`` of ``target``, filling
    ``locations`` with where they went."""
    indexes = list(record.locations)
    with progress_bar(record.total_bytes, f"copy {target}", progress) as bar:
        into = CopyTarget(
            target,
            save_id,
            [index_name(index) for index in indexes],
            checksums=dst.checksums_by_default,
            progress=bar.update,
        )
        copied = copy_values(
            src,
            [dst],
            record.checkpoint_id,
            record.save_id,
            [record.locations[index] for index in indexes],
            to=into,
        )
    locations.update(zip(indexes, copied, strict=True))


# -- the one copy of a save's values between stores (copy, Tiers' copies, prefetch) ---------

_COPY_BATCH = 64 << 20


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class CopyTarget:
    """Where ``copy_values`` writes a save that changes its name on the way (``copy``): under
    another checkpoint id and save id, each item named as the current format names it, in the
    parts it has where every destination holds values that large, else in parts of the
    destinations' size."""

    checkpoint_id: str
    save_id: str
    #: Each location's item name in the current format (``keys.index_name``), in order.
    names: Sequence[str]
    #: Record checksums of values whose source recorded none (a destination that records
    #: them by default, as a save there would).
    checksums: bool
    #: Called with the bytes of each batch once it is written (a progress bar).
    progress: Callable[[int], None] | None = None


def copy_values(
    src: Engine,
    dsts: Sequence[Engine],
    checkpoint_id: str,
    save_id: str,
    locations: Sequence[ItemLocation],
    renew: Callable[[], None] = _nothing,
    *,
    to: CopyTarget | None = None,
) -> list[ItemLocation]:
    """Copy the values of a save's items from ``src`` to each of ``dsts``, in batches of at
    most 64 MiB; ``renew`` is called after each batch (the caller's read lease). Returns the
    items' locations in ``dsts``, to commit there.

    Without ``to`` the values keep their keys and locations (Tiers' copies and prefetch, whose
    tiers share one part size). With ``to`` they go under its names, in the parts they have
    where every destination holds values that large, with the checksums their save recorded;
    an item with larger parts is read whole, checked, split into parts of the destinations'
    size and checksummed anew.

    From a store that lends its own memory (``Engine.zero_copy_reads``: LMDB's map) the values
    are sent straight from it, each byte read once; from any other they are read into one
    reused buffer first. Every value is checked: a missing or wrongly sized one raises
    ``DataError`` before its batch is written, and one that does not match the checksum its
    save recorded ``IntegrityError``, both naming the checkpoint, the key and ``src``.
    Checksums are computed as the bytes go out where the destination hashes while writing,
    else before they are sent. A failed copy never commits: the caller discards what was
    written."""
    plan = _CopyPlan(src, dsts, checkpoint_id, save_id, locations, to)
    for dst in dsts:
        dst.reserve(plan.total)  # room for every batch at once, not batch by batch
    buffer = None
    if not src.zero_copy_reads and plan.parts:
        largest = max(part.size for part in plan.parts)
        buffer = memoryview(bytearray(max(min(_COPY_BATCH, plan.total), largest)))
    for batch in _batches(plan.parts):
        keys = [part.src_key for part in batch]
        if buffer is None:
            with src.borrow(keys) as lent:
                views = _lent_views(src, checkpoint_id, batch, lent)
                plan.digests.update(_send(src, dsts, checkpoint_id, batch, views, verify=True))
        else:
            views, offset = [], 0
            for part in batch:
                views.append(buffer[offset : offset + part.size])
                offset += part.size
            sums = [part.checksum for part in batch]
            read_checked(src, checkpoint_id, keys, views, sums, lambda i: None)
            plan.digests.update(_send(src, dsts, checkpoint_id, batch, views, verify=False))
        plan.written(sum(part.size for part in batch))
        renew()
    for i in plan.resplit:
        plan.copy_resplit(i)
        renew()
    for dst in dsts:
        dst.sync_replicas()
    return plan.result()


@dataclass(frozen=True)
class _Part:
    """One value a copy moves as it is: its key in the source and in each destination, its
    size, the checksum its save recorded, and which part of which item it is."""

    src_key: str
    dst_keys: tuple[str, ...]
    size: int
    checksum: int | None
    item: int
    #: Whether the copy records this value's checksum (its source recorded none).
    record: bool = False


class _CopyPlan:
    """The values ``copy_values`` moves and the locations they end up at."""

    def __init__(
        self,
        src: Engine,
        dsts: Sequence[Engine],
        checkpoint_id: str,
        save_id: str,
        locations: Sequence[ItemLocation],
        to: CopyTarget | None,
    ) -> None:
        self.src, self.dsts, self.checkpoint_id, self.save_id = src, dsts, checkpoint_id, save_id
        self.locations, self.to = list(locations), to
        self.targets = [self._target(i, loc) for i, loc in enumerate(self.locations)]
        self.parts: list[_Part] = []
        #: Items whose parts change size: each is read whole, then split anew.
        self.resplit: list[int] = []
        #: Checksums of the values sent whose source recorded none, by part.
        self.digests: dict[_Part, int] = {}
        for i, (loc, new) in enumerate(zip(self.locations, self.targets, strict=True)):
            ranges = part_ranges(loc.nbytes, loc.part_bytes)
            if ranges != part_ranges(new.nbytes, new.part_bytes):
                self.resplit.append(i)
                continue
            record = to is not None and loc.checksums is None and to.checksums
            src_keys = loc.keys(src.prefix, checkpoint_id, save_id)
            dst_keys = [self._keys(new, dst) for dst in dsts]
            for p, (a, b) in enumerate(ranges):
                expected = loc.checksums[p] if loc.checksums else None
                keys = tuple(k[p] for k in dst_keys)
                self.parts.append(_Part(src_keys[p], keys, b - a, expected, i, record))
        self.total = sum(loc.nbytes for loc in self.locations)

    def _target(self, i: int, loc: ItemLocation) -> ItemLocation:
        if self.to is None:
            return loc
        # The source's parts go as they are, checksums and all, wherever every destination
        # holds values that large; only larger ones are split anew.
        part_bytes = min(loc.part_bytes, *(int(dst.max_value_bytes) for dst in self.dsts))
        same = part_ranges(loc.nbytes, part_bytes) == part_ranges(loc.nbytes, loc.part_bytes)
        return ItemLocation(
            loc.rank,
            loc.plan_position,
            loc.nbytes,
            part_bytes,
            loc.checksums if same else None,
            self.to.names[i],
        )

    def _keys(self, loc: ItemLocation, dst: Engine) -> list[str]:
        if self.to is None:
            return loc.keys(dst.prefix, self.checkpoint_id, self.save_id)
        return loc.keys(dst.prefix, self.to.checkpoint_id, self.to.save_id)

    def written(self, nbytes: int) -> None:
        if self.to is not None and self.to.progress is not None:
            self.to.progress(nbytes)

    def copy_resplit(self, i: int) -> None:
        """Copy item ``i`` into parts of another size: read it whole (checked against the
        checksums its save recorded), checksum the new parts where wanted, write them."""
        assert self.to is not None
        loc, new = self.locations[i], self.targets[i]
        buffer = memoryview(bytearray(loc.nbytes))
        keys = loc.keys(self.src.prefix, self.checkpoint_id, self.save_id)
        ranges = part_ranges(loc.nbytes, loc.part_bytes)
        views = [buffer[a:b] for a, b in ranges]
        sums = list(loc.checksums) if loc.checksums else [None] * len(keys)
        read_checked(self.src, self.checkpoint_id, keys, views, sums, lambda _: None)
        if loc.checksums is not None or self.to.checksums:
            ranges = part_ranges(new.nbytes, new.part_bytes)
            sums_new = tuple(checksum(buffer[a:b]) for a, b in ranges)
            new = self.targets[i] = dataclasses.replace(new, checksums=sums_new)
        for dst in self.dsts:
            dst.put_many(new.split(buffer, dst.prefix, self.to.checkpoint_id, self.to.save_id))
        self.written(loc.nbytes)

    def result(self) -> list[ItemLocation]:
        """The items' locations in the destinations, with the checksums recorded on the way."""
        recorded: dict[int, list[int]] = {}
        for part in self.parts:
            if part.record:
                recorded.setdefault(part.item, []).append(self.digests[part])
        return [
            dataclasses.replace(new, checksums=tuple(recorded[i])) if i in recorded else new
            for i, new in enumerate(self.targets)
        ]


def _lent_views(
    src: Engine, checkpoint_id: str, batch: list[_Part], lent: list[memoryview | None]
) -> list[memoryview]:
    """The values ``src`` lent for ``batch``, each checked present with its size."""
    for part, view in zip(batch, lent, strict=True):
        if view is None or view.nbytes != part.size:
            got = None if view is None else view.nbytes
            raise damaged(src, checkpoint_id, part.src_key, None, got, part.size)
    return [view for view in lent if view is not None]


def _batches(parts: list[_Part]) -> Iterator[list[_Part]]:
    """Consecutive runs of ``parts`` of at most ``_COPY_BATCH`` bytes (a larger part alone)."""
    start = 0
    while start < len(parts):
        stop, size = start, 0
        while stop < len(parts) and (stop == start or size + parts[stop].size <= _COPY_BATCH):
            size += parts[stop].size
            stop += 1
        yield parts[start:stop]
        start = stop


def _send(
    src: Engine,
    dsts: Sequence[Engine],
    checkpoint_id: str,
    batch: list[_Part],
    views: list[memoryview],
    *,
    verify: bool,
) -> dict[_Part, int]:
    """Write one batch into each destination; with ``verify``, check each value against its
    checksum on the way (hashed as the first destination sends it, where it can). Returns
    the checksums of the values the copy records them for."""
    hashed = [
        i for i, part in enumerate(batch) if part.record or (verify and part.checksum is not None)
    ]
    digests: dict[int, int] = {}
    for t, dst in enumerate(dsts):
        items = ((part.dst_keys[t], view) for part, view in zip(batch, views, strict=True))
        if hashed and not dst.hashes_while_writing:
            digests = {i: checksum(views[i]) for i in hashed}
            hashed = []
            _check(src, checkpoint_id, batch, digests)
        got: dict[int, int | None] = {}
        dst.put_many(
            items,
            on_value=got.__setitem__ if hashed else None,
            hasher=new_checksum if hashed else None,
            # over the spares of the checkpoint the replica's retention dropped, where it can
            spare_of=partial(spare_key, dst.prefix),
        )
        if hashed:
            digests = {i: _or_hash(got.get(i), views[i]) for i in hashed}
            hashed = []
        _check(src, checkpoint_id, batch, digests)  # before the next destination gets it
    if hashed:  # no destination
        digests = {i: checksum(views[i]) for i in hashed}
        _check(src, checkpoint_id, batch, digests)
    return {batch[i]: digest for i, digest in digests.items() if batch[i].record}


def _or_hash(digest: int | None, view: memoryview) -> int:
    """The digest a destination reported, or (where it reported none) the view's checksum."""
    return checksum(view) if digest is None else digest


def _check(src: Engine, checkpoint_id: str, batch: list[_Part], digests: dict[int, int]) -> None:
    for i, digest in digests.items():
        if batch[i].checksum is not None and digest != batch[i].checksum:
            raise corrupted(src, checkpoint_id, batch[i].src_key, None)
