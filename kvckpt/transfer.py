"""Moving checkpoints in and out: verify, copy between stores, export to / import from a
standard DCP directory, and a consolidated ``torch.save`` file.

Export writes the exact layout of DCP's ``FileSystemWriter`` (``.metadata`` plus
``__<rank>_0.distcp`` files of ``torch.save``'d chunks), so stock ``dcp.load`` and
``format_utils.dcp_to_torch_save`` read it. Import reads any such directory. DCP's ``.metadata``
is a pickle: import reads it with an unpickler that only admits DCP's metadata classes, and
tensors with ``torch.load(weights_only=True)``, so importing a directory runs no code from it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from .catalog import mark_pending, publish, read_lease
from .engines.base import Engine
from .errors import DataError, KVCheckpointError, MetadataError
from .format import (
    CheckpointRecord,
    ItemLocation,
    checksum,
    chunk_of,
    chunk_table,
    index_name,
    part_ranges,
)
from .reader import KVStorageReader, check_weights_only, fetch_parts
from .stores import open_store
from .urls import validate_name
from .writer import tensor_bytes

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
    batch_bytes: int = _BATCH_BYTES,
) -> Iterator[tuple[MetadataIndex, ItemLocation, memoryview]]:
    """Every item of a checkpoint as one buffer each, read in batches of bounded size."""
    items = sorted(record.locations.items(), key=lambda kv: (kv[1].rank, kv[1].n))
    start = 0
    while start < len(items):
        stop, size = start, 0
        while stop < len(items) and (stop == start or size + items[stop][1].nbytes <= batch_bytes):
            size += items[stop][1].nbytes
            stop += 1
        batch = items[start:stop]
        buffers = [bytearray(loc.nbytes) for _, loc in batch]

        def copy_part(i: int, offset: int, view: memoryview, buffers: list = buffers) -> None:
            buffers[i][offset : offset + view.nbytes] = view

        fetch_parts(engine, record, batch, copy_part)
        for (index, loc), buf in zip(batch, buffers, strict=True):
            yield index, loc, memoryview(buf)
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
    progress: bool = False,
) -> CheckpointRecord:
    """Copy a committed checkpoint to another store (or another id), committing it there the
    same way a save does. E.g. a node's LMDB to the shared Redis."""
    src_engine, dst_engine = open_store(src, create=False), open_store(dst)
    target = validate_name(new_id or checkpoint_id)
    if (
        src_engine.url == dst_engine.url
        and src_engine.prefix == dst_engine.prefix
        and target == checkpoint_id
    ):
        raise KVCheckpointError("copying a checkpoint onto itself: give a NEW_ID or another store")
    last = None
    with read_lease(src_engine, checkpoint_id, TOOL_READ_LEASE):
        for record in _records(src_engine, checkpoint_id):
            last = _copy_record(src_engine, record, dst_engine, target, progress)
    assert last is not None
    return last


def _copy_record(
    src: Engine, record: CheckpointRecord, dst: Engine, target: str, progress: bool
) -> CheckpointRecord:
    save_id = new_save_id()
    part_bytes = int(dst.max_value_bytes)
    mark_pending(dst, target, save_id, record.rank)
    locations: dict[MetadataIndex, ItemLocation] = {}

    def values() -> Iterator[tuple[str, memoryview]]:
        with _progress(record.total_bytes, f"copy {target}", progress) as bar:
            for index, loc, view in read_items(src, record):
                new = located(
                    index,
                    loc.rank,
                    loc.n,
                    view,
                    part_bytes,
                    sums=loc.checksums is not None or dst.checksums_by_default,
                )
                locations[index] = new
                yield from new.split(view, dst.prefix, target, save_id)
                bar.update(loc.nbytes)

    dst.put_many(values())
    publish(
        dst,
        record.metadata,
        locations,
        checkpoint_id=target,
        save_id=save_id,
        world_size=record.world_size,
        rank=record.rank,
    )
    return KVStorageReader(dst, checkpoint_id=target).read_record(rank=record.rank)


# -- export / import of DCP directories -----------------------------------------------------


def export_checkpoint(
    store: str | Engine, checkpoint_id: str, directory: str | os.PathLike, *, progress: bool = False
) -> Path:
    """Write a checkpoint as a standard DCP directory (FileSystemWriter's layout)."""
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
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise KVCheckpointError(f"export directory {out} is not empty: choose a new one")
    md = record.metadata
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[int, BinaryIO] = {}
    try:
        with _progress(record.total_bytes, f"export {checkpoint_id}", progress) as bar:
            for index, loc, view in read_items(engine, record):
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
    return out


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
    """Import a directory written by DCP's ``FileSystemWriter`` (any world size)."""
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

    engine.put_many(values())
    publish(
        engine,
        dataclasses.replace(md, storage_data=None),
        locations,
        checkpoint_id=checkpoint_id,
        save_id=save_id,
        world_size=world_size,
    )
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
    """One ``torch.save`` file with full (unsharded) tensors, as ``dcp_to_torch_save`` does."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    engine = open_store(store, create=False)
    # A missing store or checkpoint fails here with kvckpt's own error, not wrapped by DCP.
    _records(engine, checkpoint_id)
    state_dict: dict[str, Any] = {}
    _load_state_dict(
        state_dict,
        storage_reader=KVStorageReader(engine, checkpoint_id=checkpoint_id),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    torch.save(state_dict, path)
    return Path(path)


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
