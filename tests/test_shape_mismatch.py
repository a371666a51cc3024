"""Loading a checkpoint into a state dict whose tensors have other shapes fails with one kvckpt
error naming the checkpoint, the store and its namespace, the first mismatched tensor with both
shapes, and ``?prefix=``; on real LMDB and Redis."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan

from kvckpt import KVStorageReader, KVStorageWriter, ShapeMismatchError, open_store
from kvckpt.catalog import live_readers, readers_key

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def with_prefix(url: str, prefix: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}prefix={prefix}"


def test_other_shapes_name_checkpoint_store_namespace_tensor_and_prefix(store_url: str) -> None:
    """Two jobs on the default namespace: the second loads the first's checkpoint."""
    saved = {"model": {"embed": torch.randn(10, 4), "head": torch.randn(4, 3)}, "step": 5}
    dcp.save(saved, storage_writer=KVStorageWriter(store_url), checkpoint_id="step-5")
    engine = open_store(store_url)

    other = {"model": {"embed": torch.zeros(12, 4), "head": torch.zeros(4, 2)}, "step": 0}
    with pytest.raises(BaseException) as info:  # DCP wraps it in its CheckpointException
        dcp.load(other, storage_reader=KVStorageReader(store_url), checkpoint_id="step-5")
    text = str(info.value)
    assert "ShapeMismatchError" in text, text
    assert "Size mismatch" not in text, text  # kvckpt's check runs before DCP's planner's
    assert "checkpoint 'step-5'" in text and engine.url in text
    assert "prefix 'kvckpt'" in text and "?prefix=NAME" in text
    assert "'model.embed' is [10, 4] in the checkpoint and [12, 4] in the state dict" in text
    assert "(and 1 more tensor)" in text
    assert torch.equal(other["model"]["embed"], torch.zeros(12, 4))  # nothing was loaded
    # The load's read lease is released: retention and re-saves are not held up.
    assert not live_readers(engine.get(readers_key(engine.prefix, "step-5")))

    # Each job in a namespace of its own: both save and load their own step-5.
    url = with_prefix(store_url, "job2")
    dcp.save(other, storage_writer=KVStorageWriter(url), checkpoint_id="step-5")
    back = {"model": {"embed": torch.ones(12, 4), "head": torch.ones(4, 2)}, "step": 1}
    dcp.load(back, storage_reader=KVStorageReader(url), checkpoint_id="step-5")
    assert torch.equal(back["model"]["embed"], other["model"]["embed"]) and back["step"] == 0


def test_the_error_class(lmdb_url: str) -> None:
    """The reader's own error, before DCP wraps it: a ShapeMismatchError (and a ValueError,
    as DCP's own size check raises)."""
    dcp.save({"w": torch.zeros(3)}, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="a")
    reader = KVStorageReader(lmdb_url, checkpoint_id="a")
    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.zeros(4)}, metadata, True)
    with pytest.raises(ShapeMismatchError, match=r"'w' is \[3\] in the checkpoint and \[4\]"):
        reader._check_shapes(metadata, planner)
    assert issubclass(ShapeMismatchError, ValueError)


def test_a_planner_with_its_own_plan_is_left_alone(lmdb_url: str) -> None:
    """A planner that overrides create_local_plan may accept other shapes (Megatron's does for
    the tensors it is told to): the reader does not refuse for it."""

    class Skips(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            return LoadPlan([])  # loads nothing, whatever the shapes

    dcp.save({"w": torch.zeros(3)}, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="a")
    target = {"w": torch.ones(4)}
    dcp.load(target, storage_reader=KVStorageReader(lmdb_url), checkpoint_id="a", planner=Skips())
    assert torch.equal(target["w"], torch.ones(4))


def test_same_shapes_and_resharding_still_load(store_url: str) -> None:
    """The check compares global shapes only: a load into other strides (a transposed view)
    or a partial state dict loads as before."""
    sd = {"w": torch.randn(6, 4), "b": torch.randn(4)}
    dcp.save(sd, storage_writer=KVStorageWriter(store_url), checkpoint_id="s")
    target = {"w": torch.zeros(4, 6).t()}
    dcp.load(target, storage_reader=KVStorageReader(store_url), checkpoint_id="s")
    assert torch.equal(target["w"], sd["w"])
