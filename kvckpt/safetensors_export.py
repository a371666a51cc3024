"""Export a checkpoint's weights as Hugging Face safetensors, for evaluation and serving.

The export writes consolidated full tensors (a checkpoint saved sharded over many ranks, FSDP
or DTensor, comes out whole), split into shard files of at most ``max_shard_bytes`` each, and
the ``model.safetensors.index.json`` that ``transformers`` reads to find them.

Each shard's layout (names, dtypes, shapes, offsets) is known from the checkpoint's metadata
before any data is read, so its header is written first and the tensors follow one batch at a
time, loaded by DCP's own resharding, each batch at most the largest tensor's size: peak
memory stays near the largest tensor, not the model. The safetensors library has no writer
that takes tensors one at a time, so the header is written here, as its format specifies (an
8-byte little-endian header length, a JSON header, then the bytes of each tensor in order);
each finished shard is opened with the library's own reader to check it. Every value is
checked against the checksum its save recorded.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .dcp_files import export_directory, load_in_process
from .engines.base import Engine
from .errors import KVCheckpointError
from .stores import open_store

#: The index file ``transformers`` reads to find a sharded model's files.
INDEX_NAME = "model.safetensors.index.json"

#: Shards of at most 5 GB, as ``transformers``' ``save_pretrained`` writes them by default.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

#: torch dtype -> safetensors dtype name (the safetensors format's ``dtype`` field)
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the export: its name in the checkpoint and in the files, what it is
    stored as and what it is written as."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    stored: torch.dtype
    written: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes as written."""
        return math.prod(self.shape) * self.written.itemsize

    @property
    def slot_bytes(self) -> int:
        """Bytes as stored, rounded up to ``_ALIGN``: its room in the arena a batch loads into."""
        return -(-math.prod(self.shape) * self.stored.itemsize // _ALIGN) * _ALIGN


def export_safetensors(
    store: str | Engine,
    checkpoint_id: str,
    directory: str | os.PathLike,
    *,
    prefix: str = "model.",
    include: str | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a checkpoint's tensors as Hugging Face safetensors shards plus their index.

    Args:
        prefix: export the tensors whose names start with it, named without it. The default
            ``"model."`` takes a trainer's model weights (torchtitan, Lightning's
            ``ModelCheckpoint`` through kvckpt, and any state dict of the form ``{"model":
            ..., "optimizer": ...}``) and leaves the optimizer state out. ``""`` exports every
            tensor under its own name.
        include: a regular expression; only names (after ``prefix`` is removed) that it
            matches (``re.search``) are exported.
        dtype: write floating-point tensors in this dtype (e.g. ``torch.bfloat16`` or
            ``"bfloat16"``); integer and boolean tensors keep theirs.
        max_shard_bytes: the most bytes of tensor data in one file (a larger tensor gets a
            file of its own).

    ``directory`` must be new or empty. Files are named ``model-00001-of-0000N.safetensors``,
    and ``model.safetensors.index.json`` maps each name to its file. Objects (non-tensor
    items) have no place in safetensors and are left out. A failed export removes what it
    wrote. A directory that is not empty, or that cannot be created or written, raises
    ``UnwritablePathError`` naming it. Returns ``directory``."""
    engine = open_store(store, create=False)
    out = Path(directory)
    written = _written_dtype(dtype)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    from .reader import KVStorageReader

    metadata = KVStorageReader(engine, checkpoint_id=checkpoint_id).read_metadata()
    tensors = _select(metadata.state_dict_metadata, checkpoint_id, prefix, include, written)
    shards = _shards(tensors, max_shard_bytes)
    names = [
        out / f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, 1 + len(shards))
    ]
    with export_directory(checkpoint_id, out):
        # One batch of tensors in memory at a time, of at most the largest tensor's bytes.
        budget = max(t.slot_bytes for t in tensors)
        for shard, name in zip(shards, names, strict=True):
            _write_shard(engine, checkpoint_id, shard, name, budget)
        weight_map = {t.name: p.name for shard, p in zip(shards, names, strict=True) for t in shard}
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": weight_map,
        }
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def _written_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point torch dtype (e.g. 'bfloat16')")
    return found


def _select(
    state: dict[str, Any],
    checkpoint_id: str,
    prefix: str,
    include: str | None,
    written: torch.dtype | None,
) -> list[_Tensor]:
    """The tensors to export, in the checkpoint's order."""
    pattern = re.compile(include) if include is not None else None
    chosen: list[_Tensor] = []
    for fqn, md in state.items():
        if not isinstance(md, TensorStorageMetadata) or not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix) :]
        if pattern is not None and not pattern.search(name):
            continue
        stored = md.properties.dtype
        if stored not in _DTYPES:
            raise KVCheckpointError(
                f"checkpoint {checkpoint_id!r}: tensor {fqn!r} is {stored}, which safetensors "
                "cannot hold; leave it out with include=..."
            )
        out = written if written is not None and stored.is_floating_point else stored
        chosen.append(_Tensor(fqn, name, tuple(md.size), stored, out))
    if not chosen:
        what = f"under {prefix!r}" if prefix else "at all"
        hint = "; pass prefix='' (--prefix '') to export every tensor" if prefix else ""
        also = f" matching {include!r}" if include is not None else ""
        raise KVCheckpointError(
            f"checkpoint {checkpoint_id!r} has no tensor {what}{also} to export{hint}"
        )
    return chosen


def _shards(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``max_shard_bytes`` (a larger one alone)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(shard: list[_Tensor]) -> bytes:
    """The safetensors header of ``shard``: its length (8 bytes, little-endian), then the
    JSON, padded with spaces to a multiple of 8 bytes, as the library writes it."""
    fields: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        fields[t.name] = {
            "dtype": _DTYPES[t.written],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_shard(
    engine: Engine, checkpoint_id: str, shard: list[_Tensor], path: Path, budget: int
) -> None:
    with open(path, "wb") as f:
        f.write(_header(shard))
        arena = torch.empty(budget, dtype=torch.uint8)  # every batch's tensors, in turn
        convert = torch.empty(_CONVERT_BYTES, dtype=torch.uint8)
        for batch in _batches(shard, budget):
            for t, tensor in zip(batch, _load(engine, checkpoint_id, batch, arena), strict=True):
                _write_tensor(f, tensor, t.written, convert)
    _check_shard(path, shard)


def _batches(shard: list[_Tensor], budget: int) -> Iterator[list[_Tensor]]:
    """Runs of tensors loaded together, each of at most ``budget`` bytes as stored (a larger
    tensor alone)."""
    batch: list[_Tensor] = []
    size = 0
    for t in shard:
        n = t.slot_bytes
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += n
    if batch:
        yield batch


#: Bytes converted to another dtype at a time, into one reused buffer, so that a conversion
#: holds no second copy of a whole tensor.
_CONVERT_BYTES = 1 << 20

#: Where each tensor of a batch starts in the arena: a multiple of this (any dtype's alignment).
_ALIGN = 64


def _write_tensor(
    f: BinaryIO, tensor: torch.Tensor, dtype: torch.dtype, convert: torch.Tensor
) -> None:
    flat = tensor.view(-1)
    if dtype == flat.dtype:
        f.write(flat.view(torch.uint8).numpy().data)
        return
    out = convert[: _CONVERT_BYTES // dtype.itemsize * dtype.itemsize].view(dtype)
    for start in range(0, flat.numel(), out.numel()):
        piece = flat[start : start + out.numel()]
        out[: piece.numel()].copy_(piece)
        f.write(out[: piece.numel()].view(torch.uint8).numpy().data)


def _load(
    engine: Engine, checkpoint_id: str, batch: list[_Tensor], arena: torch.Tensor
) -> list[torch.Tensor]:
    """The full tensors of ``batch``, in ``arena``'s memory, assembled by DCP from whatever
    chunks the ranks saved, every value checked against its checksum."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state: dict[str, torch.Tensor] = {}
    at = 0
    for t in batch:
        n = math.prod(t.shape) * t.stored.itemsize
        state[t.fqn] = arena[at : at + n].view(t.stored).view(t.shape)
        at += t.slot_bytes
    load_in_process(engine, checkpoint_id, state, DefaultLoadPlanner())
    return [state[t.fqn] for t in batch]


def _check_shard(path: Path, shard: list[_Tensor]) -> None:
    """Open the finished file with the safetensors library, which checks the header and the
    offsets, and compare what it lists with what was meant to be written."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        got = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    if got != {t.name: t.shape for t in shard}:
        raise KVCheckpointError(f"the safetensors file {path} does not hold what was written")
