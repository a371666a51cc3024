"""The metadata codec of docs/FORMAT.md, and its checksums (the key schema is ``keys.py``).

Metadata is msgpack with an explicit schema, never pickle: a store that anyone can write to must
not be able to run code in the job that reads it. Decoding validates every field and raises
:class:`MetadataError` naming the checkpoint and the field.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from .errors import InvalidCheckpointIdError, MetadataError, UnsupportedFormatVersionError
from .keys import ITEM_NAME, MAX_ITEM_NAME, ItemLocation, data_prefix, item_keys, part_ranges
from .urls import validate_name

MAGIC = "kvckpt"
#: The checksum algorithm of docs/FORMAT.md: xxHash XXH3, 64 bits, seed 0, of each part.
CHECKSUM = "xxh3_64"
#: The format version new saves write; every older one stays readable (docs/FORMAT.md).
FORMAT_VERSION = 2
_EXT_TUPLE = 1
#: Bounds that keep a hostile metadata value from making the decoder allocate without limit.
MAX_METADATA_BYTES = 1 << 30
_MAX_NDIM = 64
MAX_PARTS = 1 << 20
#: Ranks a checkpoint's items may name (data keys stay within LMDB's 511 bytes: FORMAT.md).
MAX_RANKS = 1_000_000

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("kvckpt stores tensors little-endian and needs a little-endian machine")

# torch is imported by the functions that build or read DCP's objects, not by this module:
# ``decode_data_keys`` and ``decode_summary`` serve the command line's listing, inspecting and
# deleting (with ``keys.py``), which never need torch.
if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    #: name -> dtype for every torch dtype ("float32", "bfloat16", "float8_e4m3fn", "bool", ...).
    DTYPES: dict[str, torch.dtype]

_dtypes: dict[str, torch.dtype] | None = None


def _dtype_table() -> dict[str, torch.dtype]:
    """``DTYPES``, built (importing torch) on first use."""
    global _dtypes
    if _dtypes is None:
        import torch

        _dtypes = {
            str(v).removeprefix("torch."): v
            for v in vars(torch).values()
            if isinstance(v, torch.dtype)
        }
    return _dtypes


def __getattr__(name: str) -> Any:
    if name == "DTYPES":
        return _dtype_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- checksums ----------------------------------------------------------------------------


def checksum(data: memoryview | bytes) -> int:
    """The checksum of one value (one part of an item)."""
    return xxhash.xxh3_64_intdigest(data)


def new_checksum() -> xxhash.xxh3_64:
    """``checksum`` fed piece by piece (``update``, then ``intdigest``): the same digest."""
    return xxhash.xxh3_64()


@dataclass
class CheckpointRecord:
    """A decoded metadata value: DCP's ``Metadata`` plus kvckpt's own fields."""

    checkpoint_id: str
    save_id: str
    created_at: float
    world_size: int
    rank: int | None
    total_bytes: int
    metadata: Metadata  # storage_data: dict[MetadataIndex, ItemLocation]
    #: The format version the metadata was written in (docs/FORMAT.md).
    format_version: int = FORMAT_VERSION

    @property
    def locations(self) -> dict[MetadataIndex, ItemLocation]:
        return self.metadata.storage_data

    @cached_property
    def chunks(self) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]]:
        return chunk_table(self.metadata)

    def chunk(self, index: MetadataIndex) -> tuple[torch.dtype, list[int]]:
        """(dtype, sizes) of the stored chunk a tensor item holds."""
        return chunk_of(self.chunks, index)

    def data_keys(self, prefix: str) -> list[str]:
        return [
            key
            for loc in self.locations.values()
            for key in loc.keys(prefix, self.checkpoint_id, self.save_id)
        ]


def chunk_table(
    metadata: Metadata,
) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]]:
    """(fqn, chunk offsets) -> (dtype, chunk sizes) for every tensor chunk: one dict lookup per
    item, where scanning a tensor's chunk list per item would be quadratic in its chunks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        (fqn, tuple(chunk.offsets)): (md.properties.dtype, list(chunk.sizes))
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        for chunk in md.chunks
    }


def chunk_of(
    table: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]],
    index: MetadataIndex,
) -> tuple[torch.dtype, list[int]]:
    found = table.get((index.fqn, tuple(index.offset or ())))
    if found is None:
        raise MetadataError(f"no tensor chunk of {index.fqn!r} at {list(index.offset or [])}")
    return found


# -- plain values (planner_data) ----------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, tuple):  # includes torch.Size
        return msgpack.ExtType(_EXT_TUPLE, _packb(list(obj)))
    if isinstance(obj, Mapping):
        return dict(obj)
    for base in (bool, int, float, str, list):
        if isinstance(obj, base):
            return base(obj)  # type: ignore[arg-type]  # a subclass, as its plain base
    raise TypeError(
        f"kvckpt stores metadata as msgpack and cannot store a {type(obj).__qualname__} "
        "(planner data may hold only None, bool, int, float, str, list, tuple and dict)"
    )


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default, strict_types=True, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_TUPLE:
        raise MetadataError(
            f"unknown msgpack extension type {code} (kvckpt metadata uses only type "
            f"{_EXT_TUPLE}, tuples)"
        )
    return tuple(_unpackb(data))


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook, use_list=True)


def _is_paths(value: Any) -> bool:
    """DCP's default planner data: {flat fqn: (key, key, ...)} with str or int keys."""
    return type(value) is dict and all(
        type(path) is tuple and all(type(p) is str or type(p) is int for p in path)
        for path in value.values()
    )


def _encode_planner_data(value: Any) -> dict[str, Any]:
    # The common shape gets a plain encoding (10,000 tuple extensions would cost more to decode
    # than everything else in the metadata); anything else goes through the tuple extension.
    if value is not None and _is_paths(value):
        return {"planner_paths": {k: list(v) for k, v in value.items()}}
    return {"planner_data": value}


def _decode_planner_data(chk: _Checker, doc: dict[str, Any]) -> Any:
    paths = doc.get("planner_paths")
    if paths is None:
        return doc.get("planner_data")
    if type(paths) is not dict or not all(type(v) is list for v in paths.values()):
        raise chk.fail("planner_paths should map strings to lists")
    return {k: tuple(v) for k, v in paths.items()}


# -- encode -------------------------------------------------------------------------------


def encode_metadata(*args: Any, **kwargs: Any) -> bytes:
    """Encode DCP ``Metadata`` and item locations as the msgpack metadata of docs/FORMAT.md."""
    with gc_paused():
        return _encode_metadata(*args, **kwargs)


def _encode_metadata(
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    *,
    checkpoint_id: str,
    save_id: str,
    world_size: int,
    rank: int | None = None,
    created_at: float | None = None,
) -> bytes:
    tensors, objects = _encode_tensors(metadata)
    items: list[list[Any]] = [
        [
            idx.fqn,
            None if idx.offset is None else list(idx.offset),
            loc.rank,
            loc.plan_position,
            loc.nbytes,
            loc.part_bytes,
            None if loc.checksums is None else list(loc.checksums),
            loc.name,
        ]
        for idx, loc in locations.items()
    ]
    version = _version_of(items, checkpoint_id)
    if version == 1:
        items = [item[:7] for item in items]
    sm = metadata.storage_meta
    doc = {
        "magic": MAGIC,
        "version": version,
        "checkpoint_id": checkpoint_id,
        "save_id": save_id,
        "created_at": time.time() if created_at is None else created_at,
        "world_size": world_size,
        "rank": rank,
        "total_bytes": sum(loc.nbytes for loc in locations.values()),
        "byteorder": "little",
        "checksum": CHECKSUM if any(loc.checksums for loc in locations.values()) else None,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "objects": objects,
        "items": items,
        **_encode_planner_data(metadata.planner_data),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": list(sm.modules),
        },
    }
    try:
        return _packb(doc)
    except TypeError as e:
        raise TypeError(f"cannot encode metadata of checkpoint {checkpoint_id!r}: {e}") from None


def _encode_tensors(metadata: Metadata) -> tuple[dict[str, Any], list[str]]:
    """The ``tensors`` map and ``objects`` list of a metadata value."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors: dict[str, Any] = {}
    objects: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": dtype_name(md.properties.dtype),
                "size": list(md.size),
                "requires_grad": bool(md.properties.requires_grad),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
            }
        elif isinstance(md, BytesStorageMetadata):
            objects.append(fqn)
        else:
            raise TypeError(f"unknown DCP storage metadata {type(md).__name__} for {fqn!r}")
    return tensors, objects


def _version_of(items: list[list[Any]], checkpoint_id: str) -> int:
    """The format version the encoded ``items`` are written in, checked.

    The metadata says where the data is: locations of a format 1 save (no names, keys by plan
    position; metadata rewritten in place, as Megatron's removal of tensors does) stay format
    1, and any other save is format 2 throughout."""
    version = FORMAT_VERSION
    if items and all(item[7] is None for item in items):
        version = 1
    elif bad := next((i for i in items if i[7] is None or not ITEM_NAME.fullmatch(i[7])), None):
        if bad[7] is not None:
            raise ValueError(
                f"checkpoint {checkpoint_id!r}: item {bad[0]!r} has the data key name "
                f"{bad[7]!r}, which is not an item name (docs/FORMAT.md, *Data keys*)"
            )
        raise ValueError(
            f"checkpoint {checkpoint_id!r}: items located by format 1 keys and by format 2 "
            "keys cannot be in one checkpoint"
        )
    if len({(item[2], item[3 if version == 1 else 7]) for item in items}) != len(items):
        raise ValueError(
            f"checkpoint {checkpoint_id!r}: two items of one rank have the same data keys "
            "(in format 2, a hash collision of two long fqns): rename one of them"
        )
    return version


# -- decode -------------------------------------------------------------------------------


def _shape(chk: _Checker, value: Any, what: str, fqn: str) -> tuple[int, ...]:
    """A list of at most 64 non-negative ints (not bools), as a tuple. The error names
    ``what`` of tensor ``fqn``, formatted only on failure: this runs 40,000 times for 10,000
    tensors."""
    if type(value) is list and len(value) <= _MAX_NDIM:
        for v in value:
            if type(v) is not int or v < 0:
                break
        else:
            return tuple(value)
    raise chk.fail(f"{what} of {fqn!r} should be a list of at most {_MAX_NDIM} non-negative ints")


class _Checker:
    """Field access with errors that name the checkpoint and the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> MetadataError:
        return MetadataError(f"malformed metadata for {self.where}: {what}")

    def get(self, doc: Mapping[str, Any], name: str, *types: type, optional: bool = False) -> Any:
        if name not in doc:
            if optional:
                return None
            raise self.fail(f"field {name!r} is missing")
        value = doc[name]
        if value is None and optional:
            return None
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise self.fail(f"field {name!r} should be {names}, not {type(value).__name__}")
        return value


@contextmanager
def gc_paused() -> Iterator[None]:
    """Building 100,000s of small objects would trigger the cyclic GC over and over, each
    pass walking every object of a process that holds a model: pause it (msgpack's advice)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def decode_metadata(raw: bytes, *, where: str) -> CheckpointRecord:
    """Decode and validate a metadata value; ``where`` names the checkpoint in errors."""
    with gc_paused():
        return _decode_metadata(raw, where)


def _decode_header(raw: bytes, where: str) -> tuple[_Checker, dict[str, Any], str, str]:
    """Unpack a metadata value and check what every reader of it relies on: that it is kvckpt
    metadata of a version this code reads, and its checkpoint and save ids."""
    chk = _Checker(where)
    if len(raw) > MAX_METADATA_BYTES:
        raise chk.fail(f"{len(raw)} bytes is more than metadata can be")
    try:
        doc = _unpackb(raw)
    except MetadataError as e:  # from _ext_hook, which does not know the checkpoint
        raise chk.fail(str(e)) from None
    except Exception as e:
        raise MetadataError(
            f"metadata for {where} is not valid kvckpt metadata (msgpack decoding failed: "
            f"{type(e).__name__}: {e}). The value was corrupted or overwritten; the checkpoint "
            "cannot be loaded."
        ) from None
    if not isinstance(doc, dict):
        raise chk.fail(f"expected a msgpack map, found {type(doc).__name__}")
    if doc.get("magic") != MAGIC:
        raise chk.fail("it is not kvckpt metadata (no 'magic': 'kvckpt' field)")
    version = chk.get(doc, "version", int)
    if version > FORMAT_VERSION:
        raise UnsupportedFormatVersionError(
            f"{where} was written in kvckpt format version {version}, but this kvckpt reads "
            f"versions up to {FORMAT_VERSION}: upgrade kvckpt (pip install -U kvckpt)"
        )
    if version < 1:
        raise chk.fail(f"format version {version} does not exist")

    checkpoint_id = chk.get(doc, "checkpoint_id", str)
    try:
        validate_name(checkpoint_id)
    except InvalidCheckpointIdError as e:
        raise chk.fail(f"field 'checkpoint_id': {e}") from None
    save_id = chk.get(doc, "save_id", str)
    if len(save_id) != 32 or any(c not in "0123456789abcdef" for c in save_id):
        raise chk.fail("save_id should be 32 lowercase hex digits")
    return chk, doc, checkpoint_id, save_id


def _item_fields(
    chk: _Checker, item: Any, version: int
) -> tuple[str, Any, int, int, int, int, Any, str | None]:
    """One entry of 'items', its scalar fields checked: (fqn, offsets, rank, n, nbytes,
    part_bytes, checksums, name); name is None in format 1."""
    if (
        type(item) is not list
        or len(item) not in ((6, 7) if version == 1 else (8,))
        or type(item[0]) is not str
    ):
        fields = "fqn, offsets, rank, n, nbytes, part_bytes, checksums"
        raise chk.fail(
            f"item {str(item)[:80]} should be [{fields}{', name' if version > 1 else ''}]"
        )
    name = None
    if version > 1:
        name = item[7]
        if type(name) is not str or not ITEM_NAME.fullmatch(name):
            raise chk.fail(
                f"item {item[0]!r}: name {str(name)[:80]!r} should be at most {MAX_ITEM_NAME} "
                "of A-Z a-z 0-9 . _ ~ % @ , + -"
            )
    fqn, offsets, irank, n, nbytes, part_bytes = item[:6]
    if (
        type(irank) is not int
        or type(n) is not int
        or type(nbytes) is not int
        or not 0 <= irank < MAX_RANKS
        or n < 0
        or nbytes < 0
    ):
        raise chk.fail(
            f"item {fqn!r}: rank (below {MAX_RANKS}), n and nbytes should be non-negative ints"
        )
    if type(part_bytes) is not int or part_bytes < 1:
        raise chk.fail(f"item {fqn!r}: part_bytes should be a positive int")
    if nbytes > MAX_PARTS * part_bytes:
        raise chk.fail(
            f"item {fqn!r}: {nbytes} bytes in parts of {part_bytes} is more than {MAX_PARTS} parts"
        )
    return fqn, offsets, irank, n, nbytes, part_bytes, item[6] if len(item) > 6 else None, name


def decode_data_keys(
    raw: bytes, prefix: str, checkpoint_id: str, *, where: str
) -> tuple[str, list[str]]:
    """The save id and data keys a metadata value of ``checkpoint_id`` names, for deleting
    them: for well-formed metadata what ``decode_metadata(raw).data_keys(prefix)`` returns,
    without building DCP's objects for every tensor (a quarter of the time with 10,000
    tensors, paid by every save that replaces or retires one). Metadata that names another
    checkpoint is refused, so a value planted under one checkpoint's key cannot get another
    checkpoint's data deleted."""
    with gc_paused():
        chk, doc, named, save_id = _decode_header(raw, where)
        if named != checkpoint_id:
            raise chk.fail(f"it names checkpoint {named!r}, not {checkpoint_id!r}")
        keys: list[str] = []
        version = doc["version"]
        head = data_prefix(prefix, checkpoint_id, save_id)
        for item in chk.get(doc, "items", list):
            _, _, irank, n, nbytes, part_bytes, _, name = _item_fields(chk, item, version)
            keys += item_keys(head, irank, n if name is None else name, nbytes, part_bytes)
        return save_id, keys


def decode_summary(raw: bytes, *, where: str) -> dict[str, Any]:
    """What ``kvckpt info`` shows of a metadata value, without importing torch or building
    DCP's objects: kvckpt's fields, each tensor's dtype name, size and chunk count, the object
    names, and every item's fields (``fqn``, ``offsets``, ``rank``, ``n``, ``nbytes``,
    ``part_bytes``, ``name``; ``name`` is None in format 1).

    The header, the types and ranges of every field and the sizes are checked as
    ``decode_metadata`` checks them; what needs torch (that a dtype name is a dtype torch
    knows, that each item matches a chunk of its tensor) is left to ``decode_metadata``, which
    every load and ``kvckpt verify`` run."""
    with gc_paused():
        chk, doc, checkpoint_id, save_id = _decode_header(raw, where)
        created_at, world_size, rank = _decode_save(chk, doc)
        tensors: dict[str, dict[str, Any]] = {}
        for fqn, t in chk.get(doc, "tensors", dict).items():
            if type(t) is not dict:
                raise chk.fail(f"tensor {fqn!r} should be a map")
            dtype = t.get("dtype")
            if type(dtype) is not str:
                raise chk.fail(f"tensor {fqn!r} has unknown dtype {dtype!r}")
            size = _shape(chk, t.get("size"), "size", fqn)
            raw_chunks = t.get("chunks")
            if type(raw_chunks) is not list:
                raise chk.fail(f"field 'chunks' of {fqn!r} should be a list")
            for c in raw_chunks:
                if type(c) is not list or len(c) != 2:
                    raise chk.fail(f"chunk of {fqn!r} should be [offsets, sizes]")
                _shape(chk, c[0], "chunk offsets", fqn)
                _shape(chk, c[1], "chunk sizes", fqn)
            tensors[fqn] = {"dtype": dtype, "size": list(size), "chunks": len(raw_chunks)}
        objects = chk.get(doc, "objects", list)
        if not all(type(fqn) is str for fqn in objects):
            raise chk.fail("objects should be a list of strings")
        items: list[dict[str, Any]] = []
        version = doc["version"]
        for item in chk.get(doc, "items", list):
            fqn, offsets, irank, n, nbytes, part_bytes, _, name = _item_fields(chk, item, version)
            if offsets is not None:
                offsets = list(_shape(chk, offsets, "item offsets", fqn))
            items.append(
                {
                    "fqn": fqn,
                    "offsets": offsets,
                    "rank": irank,
                    "n": n,
                    "nbytes": nbytes,
                    "part_bytes": part_bytes,
                    "name": name,
                }
            )
        return {
            "checkpoint_id": checkpoint_id,
            "save_id": save_id,
            "created_at": created_at,
            "world_size": world_size,
            "rank": rank,
            "total_bytes": chk.get(doc, "total_bytes", int),
            "format_version": version,
            "tensors": tensors,
            "objects": list(objects),
            "items": items,
        }


def _decode_save(chk: _Checker, doc: dict[str, Any]) -> tuple[float, int, int | None]:
    """A metadata value's commit time, world size and rank (None: saved by every rank), checked."""
    created_at = float(chk.get(doc, "created_at", float, int))
    world_size = chk.get(doc, "world_size", int)
    rank = chk.get(doc, "rank", int, optional=True)
    if world_size < 1 or (rank is not None and not 0 <= rank < world_size):
        raise chk.fail(f"world_size {world_size} / rank {rank} out of range")
    return created_at, world_size, rank


def _decode_metadata(raw: bytes, where: str) -> CheckpointRecord:
    from torch.distributed.checkpoint.metadata import Metadata

    chk, doc, checkpoint_id, save_id = _decode_header(raw, where)
    created_at, world_size, rank = _decode_save(chk, doc)
    if chk.get(doc, "byteorder", str, optional=True) not in (None, "little"):
        raise chk.fail("byteorder should be 'little'")
    if chk.get(doc, "checksum", str, optional=True) not in (None, CHECKSUM):
        raise chk.fail(f"unknown checksum algorithm {doc.get('checksum')!r}")
    # The loops of the functions below run once per tensor and per item (10,000s): they check
    # types with ``type(x) is int`` (bool is a subclass of int and must not pass) and build
    # each DCP object once, because decoding is on the critical path of every load.
    sd_meta, chunks = _decode_tensors(chk, doc)
    metadata = Metadata(
        state_dict_metadata=sd_meta,
        planner_data=_decode_planner_data(chk, doc),
        storage_data=_decode_locations(chk, doc, sd_meta, chunks),
        storage_meta=_decode_storage_meta(chk, doc),
        version=chk.get(doc, "dcp_version", str, optional=True),
    )
    return CheckpointRecord(
        checkpoint_id=checkpoint_id,
        save_id=save_id,
        created_at=created_at,
        world_size=world_size,
        rank=rank,
        total_bytes=chk.get(doc, "total_bytes", int),
        metadata=metadata,
        format_version=doc["version"],
    )


#: (fqn, offsets) -> (offsets as torch.Size, bytes, sizes, dtype) of every chunk of a tensor
_Chunks = dict[tuple[str, tuple[int, ...]], tuple[Any, int, tuple[int, ...], Any]]


def _decode_tensors(chk: _Checker, doc: dict[str, Any]) -> tuple[dict[str, Any], _Chunks]:
    """DCP's ``state_dict_metadata`` of a metadata value (tensors and objects), checked, and
    every tensor chunk by (fqn, offsets), for matching items to chunks."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd_meta: dict[str, Any] = {}
    chunk_sizes: _Chunks = {}
    properties: dict[tuple[torch.dtype, bool], TensorProperties] = {}
    # One torch.Size per distinct checked shape (immutable, so tensors may share it).
    sizes: dict[tuple[int, ...], torch.Size] = {}
    dtypes = _dtype_table()
    for fqn, t in chk.get(doc, "tensors", dict).items():
        if type(t) is not dict:
            raise chk.fail(f"tensor {fqn!r} should be a map")
        dtype = dtypes.get(t.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise chk.fail(f"tensor {fqn!r} has unknown dtype {t.get('dtype')!r}")
        size = _shape(chk, t.get("size"), "size", fqn)
        raw_chunks = t.get("chunks")
        if type(raw_chunks) is not list:
            raise chk.fail(f"field 'chunks' of {fqn!r} should be a list")
        chunks = []
        for c in raw_chunks:
            off, sz = _chunk_shape(chk, c, fqn, size)
            offsets = sizes.get(off) or sizes.setdefault(off, torch.Size(off))
            chunk_size = sizes.get(sz) or sizes.setdefault(sz, torch.Size(sz))
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=chunk_size))
            chunk_sizes[(fqn, off)] = (offsets, math.prod(sz) * dtype.itemsize, sz, dtype)
        grad = t.get("requires_grad") is True
        props = properties.get((dtype, grad))
        if props is None:
            props = properties[(dtype, grad)] = TensorProperties(dtype=dtype, requires_grad=grad)
        tensor_size = sizes.get(size) or sizes.setdefault(size, torch.Size(size))
        sd_meta[fqn] = TensorStorageMetadata(properties=props, size=tensor_size, chunks=chunks)
    for fqn in chk.get(doc, "objects", list):
        if type(fqn) is not str:
            raise chk.fail("objects should be a list of strings")
        sd_meta[fqn] = BytesStorageMetadata()
    return sd_meta, chunk_sizes


def _chunk_shape(
    chk: _Checker, c: Any, fqn: str, size: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chunk's (offsets, sizes), checked to lie inside its tensor's ``size``."""
    if type(c) is not list or len(c) != 2:
        raise chk.fail(f"chunk of {fqn!r} should be [offsets, sizes]")
    off = _shape(chk, c[0], "chunk offsets", fqn)
    sz = _shape(chk, c[1], "chunk sizes", fqn)
    whole = sz == size and len(off) == len(size) and not any(off)  # the usual case
    if not whole and (
        len(off) != len(size)
        or len(sz) != len(size)
        or any(o + s > g for o, s, g in zip(off, sz, size, strict=True))
    ):
        raise chk.fail(
            f"chunk {list(off)}+{list(sz)} of {fqn!r} lies outside its size {list(size)}"
        )
    return off, sz


def _decode_locations(
    chk: _Checker, doc: dict[str, Any], sd_meta: dict[str, Any], chunks: _Chunks
) -> dict[Any, ItemLocation]:
    """Every item's ``MetadataIndex`` and location, checked against the tensors' chunks."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    locations: dict[MetadataIndex, ItemLocation] = {}
    version = doc["version"]
    named: set[tuple[int, int | str]] = set()
    for item in chk.get(doc, "items", list):
        fqn, offsets, irank, n, nbytes, part_bytes, sums, name = _item_fields(chk, item, version)
        slot = (irank, n if name is None else name)
        if slot in named:
            raise chk.fail(f"item {fqn!r}: another item of rank {irank} has the same data keys")
        named.add(slot)
        if offsets is None:
            if type(sd_meta.get(fqn)) is not BytesStorageMetadata:
                raise chk.fail(f"object item {fqn!r} is not declared in 'objects'")
            index = MetadataIndex(fqn)
        else:
            # The chunk's offsets, checked above, are what the index gets: a list that only
            # compares equal to them (1.0 or True for 1) is looked up, never used.
            chunk = chunks.get((fqn, tuple(offsets))) if type(offsets) is list else None
            if chunk is None:
                off = _shape(chk, offsets, "item offsets", fqn)
                raise chk.fail(f"item {fqn!r} at {list(off)} matches no chunk of that tensor")
            size_offsets, expected, sz, dtype = chunk
            if nbytes != expected:
                raise chk.fail(
                    f"item {fqn!r} at {list(size_offsets)} declares {nbytes} bytes but its "
                    f"chunk {list(sz)} of {dtype_name(dtype)} has {expected}"
                )
            index = MetadataIndex(fqn, size_offsets)
        if sums is not None:
            if (
                type(sums) is not list
                or len(sums) != len(part_ranges(nbytes, part_bytes))
                or not all(type(x) is int and 0 <= x < 1 << 64 for x in sums)
            ):
                raise chk.fail(f"item {fqn!r}: checksums should be one 64-bit int per part")
            sums = tuple(sums)
        locations[index] = ItemLocation(irank, n, nbytes, part_bytes, sums, name)
    return locations


def _decode_storage_meta(chk: _Checker, doc: dict[str, Any]) -> Any:
    """DCP's ``StorageMeta`` of a metadata value, or None."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    sm = chk.get(doc, "storage_meta", dict, optional=True)
    if sm is None:
        return None
    modules = sm.get("modules") or []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise chk.fail("storage_meta.modules should be a list of strings")
    return StorageMeta(
        checkpoint_id=sm.get("checkpoint_id") if isinstance(sm.get("checkpoint_id"), str) else None,
        save_id=sm.get("save_id") if isinstance(sm.get("save_id"), str) else None,
        modules=modules,
    )
