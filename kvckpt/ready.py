"""What a rank's saves of a state dict will write, known at the start of a job without
collectives: how many bytes (``share_bytes``), and the values of its first save
(``first_save_values``). ``KVStorageWriter.get_ready`` uses them to get the store ready
before the first save: LMDB allocates the pages, Redis makes spares of those values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.tensor import DTensor

from .keys import ItemLocation, index_name, part_ranges, spare_key

logger = logging.getLogger(__name__)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors(v)


def replicas(value: DTensor) -> int:
    """How many ranks hold each chunk of ``value``: the sizes of the mesh dimensions it is not
    sharded over. DCP saves one copy of each chunk."""
    n = 1
    for dim, placement in enumerate(value.placements):
        if not placement.is_shard():
            n *= value.device_mesh.size(dim)
    return n


def share_bytes(state_dict: dict[str, Any], world: int) -> int:
    """This rank's share of a save: its local shards of sharded tensors (and of tensors that
    plan their own save), and its part of the replicated tensors, which DCP spreads evenly
    over the ranks that save them (a DTensor replicated over some mesh dimensions, as under
    HSDP, counts once per replica)."""
    shards = replicated = 0
    for value in tensors(state_dict):
        if isinstance(value, DTensor):
            shards += -(-value.to_local().nbytes // replicas(value))
        elif isinstance(value, ShardedTensor):
            shards += sum(s.tensor.nbytes for s in value.local_shards())
        elif hasattr(value, "__create_write_items__"):
            shards += _chunk_bytes(value)
        else:
            replicated += value.nbytes
    return shards + -(-replicated // world)


def _chunk_bytes(value: torch.Tensor) -> int:
    """The bytes of the chunks a tensor that plans its own save (DCP's ``_Checkpointable``
    protocol, as Megatron's ``CheckpointableShardedTensor`` and ``LocalShardsContainer``) holds
    on this rank: what its write items write."""
    total = 0
    for item in value.__create_write_items__("", value):  # type: ignore[attr-defined]
        if item.tensor_data is not None:
            data = item.tensor_data
            total += math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
    return total


def first_save_values(
    state_dict: dict[str, Any], rank: int, world: int, prefix: str, part_bytes: int
) -> list[tuple[str, int]]:
    """The spare name (``keys.spare_key``) and size of each value that rank ``rank``'s first
    save of ``state_dict`` writes, where that is known without collectives: every value in a
    job of one rank; in a larger one, those of the chunks of sharded tensors that have no
    replicas (DCP gives each replicated tensor to one rank once it has every rank's plan).
    Read from DCP's default planner's local plan: a save with another planner may name its
    values otherwise, and then writes without these spares, which expire. A state dict the
    planner cannot plan gives none (logged): this is a head start, never a reason to fail."""
    planner = DefaultSavePlanner()
    try:
        planner.set_up_planner(state_dict, is_coordinator=rank == 0)
        items = planner.create_local_plan().items
    except Exception as e:  # a head start only: the save itself reports what is wrong
        logger.info("no spares made ahead of the first save: %s", e)
        return []
    values: list[tuple[str, int]] = []
    for item in items:
        if item.tensor_data is None:
            continue  # bytes a planner resolves at the save
        if world > 1:
            value = planner.state_dict.get(item.index.fqn)
            if item.type != WriteItemType.SHARD or (
                isinstance(value, DTensor) and replicas(value) > 1
            ):
                continue
        data = item.tensor_data
        nbytes = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
        loc = ItemLocation(rank, 0, nbytes, part_bytes, name=index_name(item.index))
        ranges = part_ranges(nbytes, part_bytes)
        for key, (start, stop) in zip(loc.keys(prefix, "next", "next"), ranges, strict=True):
            values.append((spare_key(prefix, key), stop - start))
    return values
