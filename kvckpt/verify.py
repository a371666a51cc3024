"""Reading a checkpoint's values checked, and ``verify``: every key present, every size right,
every checksum its save recorded matching.

The tools that move a checkpoint out of a store (copy, export, torch-save) read through here:
``checkpoint_records`` finds its metadata (one record, or one per rank of a rank-local save)
and ``read_items`` hands out its values only once they passed their checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from .catalog import read_lease
from .engines.base import Engine
from .errors import KVCheckpointError
from .format import CheckpointRecord, checksum
from .keys import ItemLocation, part_ranges
from .manage import list_checkpoints
from .reader import KVStorageReader, read_checked
from .stores import open_store

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex

#: The most bytes ``read_items`` and ``verify`` hold in memory at once (a larger item alone).
_BATCH_BYTES = 256 << 20

#: How long a tool (verify, copy, export) holds its read lease; it does not renew it, so this
#: bounds how long a crashed tool delays the deletion of a retired checkpoint's data.
TOOL_READ_LEASE = 600.0


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A byte-counting progress bar on stderr, gone when done (``enabled=False``: none)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        leave=False,
    )


def checkpoint_records(engine: Engine, checkpoint_id: str) -> list[CheckpointRecord]:
    """A checkpoint's metadata records: one for a collective save, one per rank otherwise.
    Callers hold a ``read_lease`` around this and their reads of the data."""
    reader = KVStorageReader(engine, checkpoint_id=checkpoint_id)
    try:
        return [reader.read_record()]
    except KVCheckpointError as first:
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


def verify(store: str | Engine, checkpoint_id: str, *, progress: bool = False) -> VerifyReport:
    """Check that every data key of a checkpoint exists and has the size its metadata says,
    and, where the save recorded checksums, that every value matches its checksum."""
    engine = open_store(store, create=False)
    report = VerifyReport(checkpoint_id)
    with read_lease(engine, checkpoint_id, TOOL_READ_LEASE):
        _verify(engine, checkpoint_id, report, progress)
    return report


def _verify(engine: Engine, checkpoint_id: str, report: VerifyReport, progress: bool) -> None:
    for record in checkpoint_records(engine, checkpoint_id):
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
        with progress_bar(len(expected), "verify", progress) as bar:
            for start in range(0, len(expected), 4096):
                batch = expected[start : start + 4096]
                sizes = engine.value_sizes([k for k, _, _ in batch])
                for (key, fqn, want), got in zip(batch, sizes, strict=True):
                    if got is None:
                        report.problems.append(f"missing: {key} ({fqn})")
                    elif got != want:
                        report.problems.append(_wrong_size(key, fqn, got, want))
                bar.update(len(batch))
        report.keys += len(expected)
        report.total_bytes += record.total_bytes


def _verify_checksums(
    engine: Engine, record: CheckpointRecord, report: VerifyReport, progress: bool
) -> None:
    """Read every value once and compare it with its size and checksum."""
    items = list(record.locations.items())
    with progress_bar(record.total_bytes, "verify", progress) as bar:
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
                    report.problems.append(_wrong_size(keys[k], fqn, view.nbytes, want))
                elif expected is not None and checksum(view) != expected:
                    report.problems.append(f"checksum mismatch: {keys[k]} ({fqn})")

            engine.get_many(keys, consume)
            report.keys += len(keys)
            bar.update(size)
            start = stop
    report.total_bytes += record.total_bytes


def _wrong_size(key: str, fqn: str, got: int, want: int) -> str:
    def nbytes(n: int) -> str:
        return f"{n} byte" if n == 1 else f"{n} bytes"

    return f"wrong size: {key} ({fqn}) holds {nbytes(got)}, expected {nbytes(want)}"
