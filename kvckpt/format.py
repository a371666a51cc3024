"""The storage format of docs/FORMAT.md: key schema, value parts, and the metadata codec.

Metadata is msgpack with an explicit schema, never pickle: a store that anyone can write to must
not be able to run code in the job that reads it. Decoding validates every field and raises
:class:`MetadataError` naming the checkpoint and the field.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .errors import MetadataError, UnsupportedFormatVersionError
from .urls import validate_name

MAGIC = "kvckpt"
FORMAT_VERSION = 1
_EXT_TUPLE = 1
#: Bounds that keep a hostile metadata value from making the decoder allocate without limit.
MAX_METADATA_BYTES = 1 << 30
_MAX_NDIM = 64
MAX_PARTS = 1 << 20

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("kvckpt stores tensors little-endian and needs a little-endian machine")

#: name -> dtype for every torch dtype ("float32", "bfloat16", "float8_e4m3fn", "bool", ...).
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- keys ---------------------------------------------------------------------------------


def meta_prefix(prefix: str) -> str:
    return f"{{{prefix}}}/meta/"


def meta_key(prefix: str, checkpoint_id: str, rank: int | None = None) -> str:
    key = f"{{{prefix}}}/meta/{checkpoint_id}"
    return key if rank is None else f"{key}/rank/{rank}"


def parse_meta_key(prefix: str, key: str) -> tuple[str, int | None] | None:
    """(checkpoint id, rank or None) for a metadata key, None for any other key."""
    head = meta_prefix(prefix)
    if not key.startswith(head):
        return None
    rest = key[len(head) :].split("/")
    if len(rest) == 1:
        return rest[0], None
    if len(rest) == 3 and rest[1] == "rank" and rest[2].isdigit():
        return rest[0], int(rest[2])
    return None


def data_prefix(prefix: str, checkpoint_id: str | None = None, save_id: str | None = None) -> str:
    key = f"{prefix}/data/"
    if checkpoint_id is not None:
        key += f"{checkpoint_id}/"
        if save_id is not None:
            key += f"{save_id}/"
    return key


def part_ranges(nbytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of an item's parts; an empty item has one empty part."""
    count = max(1, math.ceil(nbytes / part_bytes))
    return [(i * part_bytes, min((i + 1) * part_bytes, nbytes)) for i in range(count)]


@dataclass(frozen=True)
class ItemLocation:
    """Where one write item's bytes live: DCP's per-item ``storage_data`` for kvckpt."""

    rank: int
    n: int
    nbytes: int
    part_bytes: int

    def keys(self, prefix: str, checkpoint_id: str, save_id: str) -> list[str]:
        base = f"{data_prefix(prefix, checkpoint_id, save_id)}{self.rank}/{self.n}/"
        return [f"{base}{i}" for i in range(len(part_ranges(self.nbytes, self.part_bytes)))]


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

    @property
    def locations(self) -> dict[MetadataIndex, ItemLocation]:
        return self.metadata.storage_data

    def data_keys(self, prefix: str) -> list[str]:
        return [
            key
            for loc in self.locations.values()
            for key in loc.keys(prefix, self.checkpoint_id, self.save_id)
        ]


# -- plain values (planner_data) ----------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, tuple):  # includes torch.Size
        return msgpack.ExtType(_EXT_TUPLE, _packb(list(obj)))
    if isinstance(obj, Mapping):
        return dict(obj)
    for base in (bool, int, float, str, list):
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(
        f"kvckpt stores metadata as msgpack and cannot store a {type(obj).__qualname__} "
        "(planner data may hold only None, bool, int, float, str, list, tuple and dict)"
    )


def _packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack_default, strict_types=True, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_TUPLE:
        raise MetadataError(f"unknown msgpack extension type {code}")
    return tuple(_unpackb(data))


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook, use_list=True)


# -- encode -------------------------------------------------------------------------------


def encode_metadata(
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    *,
    checkpoint_id: str,
    save_id: str,
    world_size: int,
    rank: int | None = None,
    created_at: float | None = None,
) -> bytes:
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
    items = [
        [
            idx.fqn,
            None if idx.offset is None else list(idx.offset),
            loc.rank,
            loc.n,
            loc.nbytes,
            loc.part_bytes,
        ]
        for idx, loc in locations.items()
    ]
    sm = metadata.storage_meta
    doc = {
        "magic": MAGIC,
        "version": FORMAT_VERSION,
        "checkpoint_id": checkpoint_id,
        "save_id": save_id,
        "created_at": time.time() if created_at is None else created_at,
        "world_size": world_size,
        "rank": rank,
        "total_bytes": sum(loc.nbytes for loc in locations.values()),
        "byteorder": "little",
        "dcp_version": metadata.version,
        "tensors": tensors,
        "objects": objects,
        "items": items,
        "planner_data": metadata.planner_data,
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


# -- decode -------------------------------------------------------------------------------


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

    def ints(self, value: Any, name: str, max_len: int = _MAX_NDIM) -> list[int]:
        if (
            not isinstance(value, list)
            or len(value) > max_len
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        ):
            raise self.fail(f"{name} should be a list of at most {max_len} non-negative ints")
        return value


def decode_metadata(raw: bytes, *, where: str) -> CheckpointRecord:
    """Decode and validate a metadata value; ``where`` names the checkpoint in errors."""
    chk = _Checker(where)
    if len(raw) > MAX_METADATA_BYTES:
        raise chk.fail(f"{len(raw)} bytes is more than metadata can be")
    try:
        doc = _unpackb(raw)
    except MetadataError:
        raise
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

    checkpoint_id = validate_name(chk.get(doc, "checkpoint_id", str))
    save_id = chk.get(doc, "save_id", str)
    if len(save_id) != 32 or any(c not in "0123456789abcdef" for c in save_id):
        raise chk.fail("save_id should be 32 lowercase hex digits")
    created_at = float(chk.get(doc, "created_at", float, int))
    world_size = chk.get(doc, "world_size", int)
    rank = chk.get(doc, "rank", int, optional=True)
    if world_size < 1 or (rank is not None and not 0 <= rank < world_size):
        raise chk.fail(f"world_size {world_size} / rank {rank} out of range")
    if chk.get(doc, "byteorder", str, optional=True) not in (None, "little"):
        raise chk.fail("byteorder should be 'little'")

    sd_meta: dict[str, Any] = {}
    chunk_sizes: dict[tuple[str, tuple[int, ...]], tuple[list[int], torch.dtype]] = {}
    for fqn, t in chk.get(doc, "tensors", dict).items():
        if not isinstance(t, dict):
            raise chk.fail(f"tensor {fqn!r} should be a map")
        name = chk.get(t, "dtype", str)
        if name not in DTYPES:
            raise chk.fail(f"tensor {fqn!r} has unknown dtype {name!r}")
        dtype = DTYPES[name]
        size = chk.ints(chk.get(t, "size", list), f"size of {fqn!r}")
        chunks = []
        for c in chk.get(t, "chunks", list):
            if not (isinstance(c, list) and len(c) == 2):
                raise chk.fail(f"chunk of {fqn!r} should be [offsets, sizes]")
            off = chk.ints(c[0], f"chunk offsets of {fqn!r}")
            sz = chk.ints(c[1], f"chunk sizes of {fqn!r}")
            if (
                len(off) != len(size)
                or len(sz) != len(size)
                or any(o + s > g for o, s, g in zip(off, sz, size, strict=True))
            ):
                raise chk.fail(f"chunk {off}+{sz} of {fqn!r} lies outside its size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
            chunk_sizes[(fqn, tuple(off))] = (sz, dtype)
        props = TensorProperties(dtype=dtype, requires_grad=bool(t.get("requires_grad", False)))
        sd_meta[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
    for fqn in chk.get(doc, "objects", list):
        if not isinstance(fqn, str):
            raise chk.fail("objects should be a list of strings")
        sd_meta[fqn] = BytesStorageMetadata()

    locations: dict[MetadataIndex, ItemLocation] = {}
    for item in chk.get(doc, "items", list):
        if not (isinstance(item, list) and len(item) == 6 and isinstance(item[0], str)):
            raise chk.fail(
                f"item {str(item)[:80]} should be [fqn, offsets, rank, n, nbytes, part_bytes]"
            )
        fqn, offsets, irank, n, nbytes, part_bytes = item
        for label, v in (("rank", irank), ("n", n), ("nbytes", nbytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise chk.fail(f"item {fqn!r}: {label} should be a non-negative int")
        if not isinstance(part_bytes, int) or isinstance(part_bytes, bool) or part_bytes < 1:
            raise chk.fail(f"item {fqn!r}: part_bytes should be a positive int")
        if nbytes > MAX_PARTS * part_bytes:
            raise chk.fail(
                f"item {fqn!r}: {nbytes} bytes in parts of {part_bytes} is more "
                f"than {MAX_PARTS} parts"
            )
        if offsets is None:
            if not isinstance(sd_meta.get(fqn), BytesStorageMetadata):
                raise chk.fail(f"object item {fqn!r} is not declared in 'objects'")
            index = MetadataIndex(fqn)
        else:
            off = tuple(chk.ints(offsets, f"item offsets of {fqn!r}"))
            if (fqn, off) not in chunk_sizes:
                raise chk.fail(f"item {fqn!r} at {list(off)} matches no chunk of that tensor")
            sz, dtype = chunk_sizes[(fqn, off)]
            expected = math.prod(sz) * dtype.itemsize
            if nbytes != expected:
                raise chk.fail(
                    f"item {fqn!r} at {list(off)} declares {nbytes} bytes but its "
                    f"chunk {sz} of {dtype_name(dtype)} has {expected}"
                )
            index = MetadataIndex(fqn, off)
        locations[index] = ItemLocation(irank, n, nbytes, part_bytes)

    sm = chk.get(doc, "storage_meta", dict, optional=True)
    storage_meta = None
    if sm is not None:
        modules = sm.get("modules") or []
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise chk.fail("storage_meta.modules should be a list of strings")
        storage_meta = StorageMeta(
            checkpoint_id=sm.get("checkpoint_id")
            if isinstance(sm.get("checkpoint_id"), str)
            else None,
            save_id=sm.get("save_id") if isinstance(sm.get("save_id"), str) else None,
            modules=modules,
        )
    metadata = Metadata(
        state_dict_metadata=sd_meta,
        planner_data=doc.get("planner_data"),
        storage_data=locations,
        storage_meta=storage_meta,
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
    )
