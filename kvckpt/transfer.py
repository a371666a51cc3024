"""Moving checkpoints in and out: verify, copy between stores, export to / import from a
standard DCP directory, and a consolidated ``torch.save`` file.

Export writes the exact layout of DCP's ``FileSystemWriter`` (``.metadata`` plus
``__<rank>_0.distcp`` files of ``torch.save``'d chunks), so stock ``dcp.load`` and
``format_utils.dcp_to_torch_save`` read it. Import reads any such directory. DCP's ``.metadata``
is a pickle: import reads it with an unpickler that only admits DCP's metadata classes, and
tensors with ``torch.load(weights_only=True)``, so importing a directory runs no code from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)
from tqdm import tqdm

from .adapter import new_save_id
from .catalog import mark_pending, publish, read_index, read_lease
from .engines.base import Engine
from .errors import (
    CheckpointExistsError,
    DataError,
    KVCheckpointError,
    MetadataError,
    UnwritablePathError,
)
from .format import (
    CheckpointRecord,
    ItemLocation,
    checksum,
    chunk_of,
    chunk_table,
    index_name,
    new_checksum,
    part_ranges,
    spare_key,
)
from .reader import KVStorageReader, corrupted, damaged, read_checked
from .safe_load import check_weights_only
from .stores import open_store
from .urls import validate_name
from .writer import tensor_bytes

logger = logging.getLogger(__name__)

_BATCH_BYTES = 256 << 20


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        leave=False,
    )


#: How long a tool (verify, copy, export) holds its read lease; it does not renew it, so this
#: bounds how long a crashed tool delays the deletion of a retired checkpoint's data.
TOOL_READ_LEASE = 600.0


def _records(engine: Engine, checkpoint_id: str) -> list[CheckpointRecord]:
    """A checkpoint's metadata records: one for a collective save, one per rank otherwise.
    Callers hold a ``read_lease`` around this and their reads of the data."""
    reader = KVStorageReader(engine, checkpoint_id=checkpoint_id)
    try:
        return [reader.read_record()]
    except KVCheckpointError as first:
        from .manage import list_checkpoints

        infos = [i for i in list_checkpoints(engine) if i.checkpoint_id == checkpoint_id]
        if not infos or not infos[0].rank_local or infos[0].world_size is None:
            raise first from None
        return [reader.read_record(rank=r) for r in range(infos[0].world_size)]


def read_items(
    engine: Engine,
    record: CheckpointRecord,
    batch_bytes: int | None = None,
    *,
    verify: bool = True,
) -> Iterator[tuple[MetadataIndex, ItemLocation, memoryview]]:
    """Every item of a checkpoint as one buffer each, read in batches of at most
    ``batch_bytes`` (default 256 MiB; a larger item is a batch of its own).

    Every value is checked as it is read: a missing or wrongly sized one raises ``DataError``,
    and, where the save recorded checksums (and ``verify``), one that does not match its
    checksum raises ``IntegrityError``. Nothing of a batch is yielded before all of it passed.
    """
    limit = _BATCH_BYTES if batch_bytes is None else batch_bytes
    items = sorted(record.locations.items(), key=lambda kv: (kv[1].rank, kv[1].plan_position))
    start = 0
    while start < len(items):
        stop, size = start, 0
        while stop < len(items) and (stop == start or size + items[stop][1].nbytes <= limit):
            size += items[stop][1].nbytes
            stop += 1
        batch = items[start:stop]
        buffers = [memoryview(bytearray(loc.nbytes)) for _, loc in batch]
        keys: list[str] = []
        views: list[memoryview] = []
        sums: list[int | None] = []
        fqns: list[str] = []
        for (index, loc), buffer in zip(batch, buffers, strict=True):
            item_keys = loc.keys(engine.prefix, record.checkpoint_id, record.save_id)
            ranges = part_ranges(loc.nbytes, loc.part_bytes)
            for p, (key, (a, b)) in enumerate(zip(item_keys, ranges, strict=True)):
                keys.append(key)
                views.append(buffer[a:b])
                sums.append(loc.checksums[p] if loc.checksums else None)
                fqns.append(index.fqn)
        read_checked(
            engine, record.checkpoint_id, keys, views, sums, fqns.__getitem__, verify=verify
        )
        for (index, loc), buffer in zip(batch, buffers, strict=True):
            yield index, loc, buffer
        start = stop


def _as_tensor(view: memoryview, dtype: torch.dtype, sizes: list[int]) -> torch.Tensor:
    if view.nbytes == 0:
        return torch.empty(sizes, dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(sizes)


# -- verify -------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What ``verify`` found: ``ok`` only if every key is present with the right size."""

    checkpoint_id: str
    keys: int = 0
    total_bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def located(
    index: MetadataIndex,
    rank: int,
    n: int,
    view: memoryview,
    part_bytes: int,
    *,
    sums: bool,
) -> ItemLocation:
    """The location (current format: keys named by ``index``) of an item about to be
    written, with its parts' checksums if wanted."""
    ranges = part_ranges(view.nbytes, part_bytes)
    checksums = tuple(checksum(view[a:b]) for a, b in ranges) if sums else None
    return ItemLocation(rank, n, view.nbytes, part_bytes, checksums, index_name(index))


def verify(store: str | Engine, checkpoint_id: str, *, progress: bool = False) -> VerifyReport:
    """Check that every data key of a checkpoint exists and has the size its metadata says,
    and, where the save recorded checksums, that every value matches its checksum."""
    engine = open_store(store, create=False)
    report = VerifyReport(checkpoint_id)
    with read_lease(engine, checkpoint_id, TOOL_READ_LEASE):
        _verify(engine, checkpoint_id, report, progress)
    return report


def _verify(engine: Engine, checkpoint_id: str, report: VerifyReport, progress: bool) -> None:
    for record in _records(engine, checkpoint_id):
        if any(loc.checksums for loc in record.locations.values()):
            _verify_checksums(engine, record, report, progress)
            continue
        expected: list[tuple[str, str, int]] = []
        for index, loc in record.locations.items():
            for key, (a, b) in zip(
                loc.keys(engine.prefix, checkpoint_id, record.save_id),
                part_ranges(loc.nbytes, loc.part_bytes),
                strict=True,
            ):
                expected.append((key, index.fqn, b - a))
        with _progress(len(expected), "verify", progress) as bar:
            for start in range(0, len(expected), 4096):
                batch = expected[start : start + 4096]
                sizes = engine.value_sizes([k for k, _, _ in batch])
                for (key, fqn, want), got in zip(batch, sizes, strict=True):
                    if got is None:
                        report.problems.append(f"missing: {key} ({fqn})")
                    elif got != want:
                        report.problems.append(
                            f"wrong size: {key} ({fqn}) holds {got} bytes, expected {want}"
                        )
                bar.update(len(batch))
        report.keys += len(expected)
        report.total_bytes += record.total_bytes


def _verify_checksums(
    engine: Engine, record: CheckpointRecord, report: VerifyReport, progress: bool
) -> None:
    """Read every value once and compare it with its size and checksum."""
    items = list(record.locations.items())
    with _progress(record.total_bytes, "verify", progress) as bar:
        start = 0
        while start < len(items):
            stop, size = start, 0
            while stop < len(items) and (stop == start or size < _BATCH_BYTES):
                size += items[stop][1].nbytes
                stop += 1
            batch = items[start:stop]
            keys: list[str] = []
            slots: list[tuple[str, int, int | None]] = []
            for index, loc in batch:
                ranges = part_ranges(loc.nbytes, loc.part_bytes)
                for p, (key, (a, b)) in enumerate(
                    zip(
                        loc.keys(engine.prefix, record.checkpoint_id, record.save_id),
                        ranges,
                        strict=True,
                    )
                ):
                    keys.append(key)
                    slots.append((index.fqn, b - a, loc.checksums[p] if loc.checksums else None))

            def consume(
                k: int,
                view: memoryview | None,
                keys: list[str] = keys,
                slots: list[tuple[str, int, int | None]] = slots,
            ) -> None:
                fqn, want, expected = slots[k]
                if view is None:
                    report.problems.append(f"missing: {keys[k]} ({fqn})")
                elif view.nbytes != want:
                    report.problems.append(
                        f"wrong size: {keys[k]} ({fqn}) holds {view.nbytes} bytes, expected {want}"
                    )
                elif expected is not None and checksum(view) != expected:
                    report.problems.append(f"checksum mismatch: {keys[k]} ({fqn})")

            engine.get_many(keys, consume)
            report.keys += len(keys)
            bar.update(size)
            start = stop
    report.total_bytes += record.total_bytes


# -- copy -----------------------------------------------------------------------------------


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
    id is replaced only with ``overwrite=True``."""
    src_engine, dst_engine = open_store(src, create=False), open_store(dst)
    target = validate_name(new_id or checkpoint_id)
    if (
        src_engine.url == dst_engine.url
        and src_engine.prefix == dst_engine.prefix
        and target == checkpoint_id
    ):
        raise KVCheckpointError("copying a checkpoint onto itself: give a NEW_ID or another store")
    with read_lease(src_engine, checkpoint_id, TOOL_READ_LEASE):
        records = _records(src_engine, checkpoint_id)
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
            _discard_copies(dst_engine, target, [(s, r.rank) for r, s, _ in copies])
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


def _discard_copies(dst: Engine, target: str, saves: list[tuple[str, int | None]]) -> None:
    """Remove the data and pending entries of copies that will not commit."""
    from .manage import discard_save

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
    with _progress(record.total_bytes, f"copy {target}", progress) as bar:
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
    another checkpoint id and save id, each item named as the current format names it and
    split into parts of the destinations' size."""

    checkpoint_id: str
    save_id: str
    #: Each location's item name in the current format (``format.index_name``), in order.
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
    tiers share one part size). With ``to`` they go under its names, in parts of the
    destinations' size, and keep the checksums their save recorded where the parts stay the
    same; an item whose parts change size is read whole, checked, and checksummed anew.

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
        part_bytes = min(int(dst.max_value_bytes) for dst in self.dsts)
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


# -- export / import of DCP directories -----------------------------------------------------


def export_checkpoint(
    store: str | Engine, checkpoint_id: str, directory: str | os.PathLike, *, progress: bool = False
) -> Path:
    """Write a checkpoint as a standard DCP directory (FileSystemWriter's layout).

    ``directory`` must be new or empty. Every value is checked as it is read against the
    checksum its save recorded (``IntegrityError`` on a mismatch). A failed export leaves
    nothing behind: the directories it created are removed, and so is what it wrote into an
    empty directory it was given. A directory it cannot write raises ``KVCheckpointError``
    naming the path."""
    engine = open_store(store, create=False)
    with read_lease(engine, checkpoint_id, TOOL_READ_LEASE):
        return _export(engine, checkpoint_id, Path(directory), progress)


def _export(engine: Engine, checkpoint_id: str, out: Path, progress: bool) -> Path:
    records = _records(engine, checkpoint_id)
    if len(records) != 1:
        raise KVCheckpointError(
            f"checkpoint {checkpoint_id!r} was saved rank-local (use_collectives=False); "
            "export supports checkpoints saved with collectives"
        )
    (record,) = records
    created = first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise KVCheckpointError(f"export directory {out} is not empty: choose a new one")
    except OSError as e:
        raise _unwritable(checkpoint_id, out, e) from None
    try:
        _write_export(engine, record, out, progress)
    except BaseException as e:
        undo_export(out, created)
        if isinstance(e, OSError) and not isinstance(e, KVCheckpointError):
            raise _unwritable(checkpoint_id, out, e) from e
        raise
    return out


def _write_export(engine: Engine, record: CheckpointRecord, out: Path, progress: bool) -> None:
    md = record.metadata
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[int, BinaryIO] = {}
    try:
        with _progress(record.total_bytes, f"export {record.checkpoint_id}", progress) as bar:
            for index, loc, view in read_items(engine, record):  # checked as read
                name = f"__{loc.rank}_0.distcp"
                stream = files.get(loc.rank)
                if stream is None:
                    stream = files[loc.rank] = open(out / name, "wb")  # noqa: SIM115
                offset = stream.tell()
                if index.offset is None:
                    stream.write(view)
                else:
                    torch.save(_as_tensor(view, *record.chunk(index)), stream)
                storage[index] = _StorageInfo(name, offset, stream.tell() - offset)
                bar.update(loc.nbytes)
    finally:
        for stream in files.values():
            stream.close()
    exported = dataclasses.replace(md, storage_data=storage, version=md.version or "1.0.0")
    with open(out / ".metadata", "wb") as f:
        pickle.dump(exported, f)


def first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist (None: ``path`` exists):
    what a ``mkdir(parents=True)`` of ``path`` creates."""
    missing = None
    for p in (path.absolute(), *path.absolute().parents):
        if os.path.lexists(p):
            break
        missing = p
    return missing


def undo_export(out: Path, created: Path | None) -> None:
    """Undo a failed export: the directories it created, or else (a directory that was empty
    when it began) everything in it."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    with contextlib.suppress(OSError):
        for entry in out.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _unwritable(
    checkpoint_id: str, path: Path, error: OSError, *, name_file: bool = True
) -> UnwritablePathError:
    """The error for a path that cannot be written (``name_file``: add the file the OS named,
    when it is another one, such as a file inside an export directory)."""
    reason = error.strerror or str(error)
    named = name_file and error.filename and str(error.filename) != str(path)
    where = f" ({error.filename})" if named else ""
    return UnwritablePathError(
        f"cannot write checkpoint {checkpoint_id!r} to {path}: {reason}{where}; choose a "
        "path you can write to"
    )


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's ``.metadata`` is made of; anything else is refused."""

    _ALLOWED = {
        (dcp_metadata.__name__, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout
        ("collections", "OrderedDict"),
        # StorageMeta.checkpoint_id is the save's path:
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
    }
    _TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), self._TORCH_VALUES):
            return getattr(torch, name)
        raise MetadataError(
            f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata "
            "format: refusing to unpickle it"
        )


def read_dcp_metadata(directory: str | os.PathLike) -> Metadata:
    """Read a DCP directory's ``.metadata`` without running code from it."""
    path = Path(directory) / ".metadata"
    if not path.exists():
        ranked = sorted(Path(directory).glob("__*.metadata"))
        hint = (
            (
                " (it holds rank-local metadata from use_collectives=False; import supports "
                "directories saved with collectives)"
            )
            if ranked
            else ""
        )
        raise KVCheckpointError(f"{directory} is not a DCP checkpoint: no .metadata{hint}")
    with open(path, "rb") as f:
        try:
            md = _DCPMetadataUnpickler(f).load()
        except MetadataError:
            raise
        except Exception as e:
            raise MetadataError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise MetadataError(f"{path} does not hold DCP Metadata with storage data")
    return md


def import_checkpoint(
    directory: str | os.PathLike, store: str | Engine, checkpoint_id: str, *, progress: bool = False
) -> CheckpointRecord:
    """Import a directory written by DCP's ``FileSystemWriter`` (any world size). A failed
    import leaves nothing of it in the store."""
    engine = open_store(store)
    validate_name(checkpoint_id)
    src = Path(directory)
    md = read_dcp_metadata(src)
    chunks = chunk_table(md)
    items = sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))
    ranks = {
        int(m.group(1))
        for _, info in items
        if (m := re.match(r"__(\d+)_", str(info.relative_path)))
    }
    world_size = max(ranks) + 1 if ranks else 1
    save_id = new_save_id()
    part_bytes = int(engine.max_value_bytes)
    mark_pending(engine, checkpoint_id, save_id, None)
    locations: dict[MetadataIndex, ItemLocation] = {}
    total = sum(int(info.length) for _, info in items)

    def values() -> Iterator[tuple[str, memoryview]]:
        handles: dict[str, BinaryIO] = {}
        try:
            with _progress(total, f"import {checkpoint_id}", progress) as bar:
                for n, (index, info) in enumerate(items):
                    view = _read_dcp_item(src, md, chunks, index, info, handles)
                    loc = located(index, 0, n, view, part_bytes, sums=engine.checksums_by_default)
                    locations[index] = loc
                    yield from loc.split(view, engine.prefix, checkpoint_id, save_id)
                    bar.update(int(info.length))
        finally:
            for handle in handles.values():
                handle.close()

    try:
        engine.put_many(values())
        publish(
            engine,
            dataclasses.replace(md, storage_data=None),
            locations,
            checkpoint_id=checkpoint_id,
            save_id=save_id,
            world_size=world_size,
        )
    except BaseException:
        _discard_copies(engine, checkpoint_id, [(save_id, None)])
        raise
    return KVStorageReader(engine, checkpoint_id=checkpoint_id).read_record()


def _read_dcp_item(
    src: Path,
    md: Metadata,
    chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]],
    index: MetadataIndex,
    info: Any,
    handles: dict[str, BinaryIO],
) -> memoryview:
    if not isinstance(info, _StorageInfo):
        raise MetadataError(
            f"{index.fqn!r}: storage data of type {type(info).__name__} is not FileSystemWriter's"
        )
    if info.transform_descriptors:
        raise KVCheckpointError(
            f"{index.fqn!r} was written with stream transforms {info.transform_descriptors}; "
            "import reads plain FileSystemWriter checkpoints"
        )
    rel = str(info.relative_path)
    if "/" in rel or "\\" in rel or rel.startswith(".."):
        raise MetadataError(f"{index.fqn!r} points outside the directory: {rel!r}")
    handle = handles.get(rel)
    if handle is None:
        handle = handles[rel] = open(src / rel, "rb")  # noqa: SIM115
    handle.seek(int(info.offset))
    raw = handle.read(int(info.length))
    if len(raw) != int(info.length):
        raise DataError(
            f"{src / rel} is truncated: {index.fqn!r} needs bytes "
            f"{info.offset}..{info.offset + info.length}"
        )
    smd = md.state_dict_metadata.get(index.fqn)
    if isinstance(smd, BytesStorageMetadata):
        return memoryview(raw)
    dtype, sizes = chunk_of(chunks, index)
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise KVCheckpointError(
            f"cannot read tensor {index.fqn!r} from {src / rel}: {type(e).__name__}: {e} "
            "(import reads FileSystemWriter's default torch.save format)"
        ) from None
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or list(tensor.shape) != sizes:
        raise DataError(f"{src / rel}: {index.fqn!r} is not a {sizes} {dtype} tensor")
    return tensor_bytes(tensor)


# -- consolidated torch.save ------------------------------------------------------------------


def torch_save_checkpoint(store: str | Engine, checkpoint_id: str, path: str | os.PathLike) -> Path:
    """One ``torch.save`` file with full (unsharded) tensors, as ``dcp_to_torch_save`` does.

    Every value is checked against the checksum its save recorded. The file is written under
    a temporary name next to ``path`` and renamed when whole: a failed run leaves no file, and
    a path it cannot write fails (``KVCheckpointError`` naming it) before anything is read."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    engine = open_store(store, create=False)
    # A missing store or checkpoint fails here with kvckpt's own error, not wrapped by DCP.
    _records(engine, checkpoint_id)
    path = Path(path)
    if path.is_dir():
        raise KVCheckpointError(
            f"cannot write checkpoint {checkpoint_id!r} to {path}: it is a directory; give a "
            "file name"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        stream = open(tmp, "wb")  # noqa: SIM115
    except OSError as e:
        raise _unwritable(checkpoint_id, path, e, name_file=False) from None
    try:
        with stream:
            state_dict: dict[str, Any] = {}
            load_in_process(engine, checkpoint_id, state_dict, _EmptyStateDictLoadPlanner())
            try:
                torch.save(state_dict, stream)
            except OSError as e:
                raise _unwritable(checkpoint_id, path, e, name_file=False) from e
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise _unwritable(checkpoint_id, path, e, name_file=False) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_in_process(
    engine: Engine, checkpoint_id: str, state_dict: dict[str, Any], planner: Any
) -> None:
    """``dcp.load`` of a checkpoint into ``state_dict`` by this process alone, every value
    checked against its checksum; a failure raises kvckpt's own error, not DCP's wrapper."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        _load_state_dict(
            state_dict,
            storage_reader=KVStorageReader(engine, checkpoint_id=checkpoint_id, verify=True),
            planner=planner,
            no_dist=True,
        )
    except CheckpointException as e:  # one process: one failure, its own error
        failures = list(e.failures.values())
        if len(failures) != 1:
            raise
        raise failures[0][0] from None


class DirectoryReader(FileSystemReader):
    """DCP's ``FileSystemReader`` without its two unrestricted unpicklings: ``.metadata`` is
    read by the restricted unpickler above, and object items load only if
    ``torch.load(weights_only=True)`` accepts them (``weights_only=False`` to opt out). Used to
    restore from a durable tier that more than one party can write to."""

    def __init__(self, path: str | os.PathLike, *, weights_only: bool = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.weights_only:
            planner = _WeightsOnlyPlanner(planner, str(self.path))
        return super().read_data(plan, planner)


class _WeightsOnlyPlanner:
    """Checks each object item under ``weights_only`` rules before the real planner sees it."""

    def __init__(self, planner: Any, where: str) -> None:
        self._planner = planner
        self._where = where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        check_weights_only(
            data,
            f"object {read_item.dest_index.fqn!r} in {self._where}",
            "DirectoryReader(..., weights_only=False)",
        )
        self._planner.load_bytes(read_item, io.BytesIO(data))
