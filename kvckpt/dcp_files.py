"""DCP directories and ``torch.save`` files: export a checkpoint to a standard DCP directory,
import one, write a consolidated ``torch.save`` file, and read a directory safely.

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
import math
import os
import pickle
import re
import shutil
from collections.abc import Iterator
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

from .adapter import new_save_id
from .catalog import mark_pending, publish, read_lease
from .copying import discard_copies, prepare_destination
from .engines.base import Engine
from .errors import (
    DataError,
    KVCheckpointError,
    MetadataError,
    UnwritablePathError,
)
from .format import CheckpointRecord, checksum, chunk_of, chunk_table
from .keys import ItemLocation, index_name, part_ranges
from .reader import KVStorageReader
from .safe_load import check_weights_only
from .stores import open_store
from .urls import validate_name
from .verify import TOOL_READ_LEASE, checkpoint_records, progress_bar, read_items
from .writer import tensor_bytes


def export_checkpoint(
    store: str | Engine, checkpoint_id: str, directory: str | os.PathLike, *, progress: bool = False
) -> Path:
    """Write a checkpoint as a standard DCP directory (FileSystemWriter's layout).

    ``directory`` must be new or empty. Every value is checked as it is read against the
    checksum its save recorded (``IntegrityError`` on a mismatch). A failed export leaves
    nothing behind: the directories it created are removed, and so is what it wrote into an
    empty directory it was given. A directory that is not empty, or that it cannot create or
    write, raises ``UnwritablePathError`` naming the path."""
    engine = open_store(store, create=False)
    with read_lease(engine, checkpoint_id, TOOL_READ_LEASE):
        return _export(engine, checkpoint_id, Path(directory), progress)


def _export(engine: Engine, checkpoint_id: str, out: Path, progress: bool) -> Path:
    records = checkpoint_records(engine, checkpoint_id)
    if len(records) != 1:
        raise KVCheckpointError(
            f"checkpoint {checkpoint_id!r} was saved rank-local (use_collectives=False); "
            "export supports checkpoints saved with collectives"
        )
    (record,) = records
    with export_directory(checkpoint_id, out):
        _write_export(engine, record, out, progress)
    return out


def _write_export(engine: Engine, record: CheckpointRecord, out: Path, progress: bool) -> None:
    md = record.metadata
    storage: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[int, BinaryIO] = {}
    try:
        with progress_bar(record.total_bytes, f"export {record.checkpoint_id}", progress) as bar:
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


def not_empty(checkpoint_id: str, out: Path) -> UnwritablePathError:
    """The error for an export into a directory that holds files already: an export never
    mixes its files with others, nor replaces them."""
    return UnwritablePathError(
        f"cannot write checkpoint {checkpoint_id!r} to {out}: the directory is not empty; "
        "choose a new or empty directory"
    )


def _as_tensor(view: memoryview, dtype: torch.dtype, sizes: list[int]) -> torch.Tensor:
    if view.nbytes == 0:
        return torch.empty(sizes, dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(sizes)


def first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist (None: ``path`` exists):
    what a ``mkdir(parents=True)`` of ``path`` creates."""
    missing = None
    for p in (path.absolute(), *path.absolute().parents):
        if os.path.lexists(p):
            break
        missing = p
    return missing


def empty_output_dir(checkpoint_id: str, out: Path) -> Path | None:
    """Make ``out`` the empty directory an export writes into, or fail naming it and the fix;
    returns what it created (``undo_export`` removes it after a failure)."""
    created = first_missing(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        used = any(out.iterdir())
    except OSError as e:
        raise unwritable(checkpoint_id, out, e) from None
    if used:
        raise not_empty(checkpoint_id, out)
    return created


@contextlib.contextmanager
def export_directory(checkpoint_id: str, out: Path) -> Iterator[None]:
    """An export's empty directory (``empty_output_dir``) for the length of the block; a
    block that fails leaves nothing behind (``undo_export``), and an OS error it raised is
    named as a path that cannot be written."""
    created = empty_output_dir(checkpoint_id, out)
    try:
        yield
    except BaseException as e:
        undo_export(out, created)
        if isinstance(e, OSError) and not isinstance(e, KVCheckpointError):
            raise unwritable(checkpoint_id, out, e) from e
        raise


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


def unwritable(
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


def import_checkpoint(
    directory: str | os.PathLike, store: str | Engine, checkpoint_id: str, *, progress: bool = False
) -> CheckpointRecord:
    """Import a directory written by DCP's ``FileSystemWriter`` (any world size). A failed
    import leaves nothing of it in the store.

    Nothing is written where the store cannot take the checkpoint: a store that may evict
    keys raises ``UnsafeStoreError`` and one without room ``StoreFullError``
    (``Engine.preflight``, as for a save), and a store that cannot be created where its URL
    points ``UnwritablePathError``."""
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
    total = sum(int(info.length) for _, info in items)
    prepare_destination(engine, checkpoint_id, _stored_bytes(md, chunks, items))
    save_id = new_save_id()
    part_bytes = int(engine.max_value_bytes)
    mark_pending(engine, checkpoint_id, save_id, None)
    locations: dict[MetadataIndex, ItemLocation] = {}

    def values() -> Iterator[tuple[str, memoryview]]:
        handles: dict[str, BinaryIO] = {}
        try:
            with progress_bar(total, f"import {checkpoint_id}", progress) as bar:
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
        discard_copies(engine, checkpoint_id, [(save_id, None)])
        raise
    return KVStorageReader(engine, checkpoint_id=checkpoint_id).read_record()


def _stored_bytes(
    md: Metadata,
    chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]],
    items: list[tuple[MetadataIndex, Any]],
) -> int:
    """The bytes an import writes into the store: each tensor chunk's raw bytes (the files
    hold them wrapped by ``torch.save``), each object's as they are."""
    total = 0
    for index, info in items:
        if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            total += int(info.length)
        else:
            dtype, sizes = chunk_of(chunks, index)
            total += math.prod(sizes) * dtype.itemsize
    return total


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


def torch_save_checkpoint(store: str | Engine, checkpoint_id: str, path: str | os.PathLike) -> Path:
    """One ``torch.save`` file with full (unsharded) tensors, as ``dcp_to_torch_save`` does.

    Every value is checked against the checksum its save recorded. The file is written under
    a temporary name next to ``path`` and renamed when whole: a failed run leaves no file, and
    a path it cannot write (a directory, or one it cannot create) fails with
    ``UnwritablePathError`` naming it before anything is read."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    engine = open_store(store, create=False)
    # A missing store or checkpoint fails here with kvckpt's own error, not wrapped by DCP.
    checkpoint_records(engine, checkpoint_id)
    path = Path(path)
    if path.is_dir():
        raise UnwritablePathError(
            f"cannot write checkpoint {checkpoint_id!r} to {path}: it is a directory; give a "
            "file name"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        stream = open(tmp, "wb")  # noqa: SIM115
    except OSError as e:
        raise unwritable(checkpoint_id, path, e, name_file=False) from None
    try:
        with stream:
            state_dict: dict[str, Any] = {}
            load_in_process(engine, checkpoint_id, state_dict, _EmptyStateDictLoadPlanner())
            try:
                torch.save(state_dict, stream)
            except OSError as e:
                raise unwritable(checkpoint_id, path, e, name_file=False) from e
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise unwritable(checkpoint_id, path, e, name_file=False) from e
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
