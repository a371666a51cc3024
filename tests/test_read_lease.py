"""Retention and re-saves while a load is in flight: the reader's lease keeps its data.

The planner hook runs the deletion inside a real ``dcp.load``, after the reader has read the
metadata and before it reads any data: the worst moment for the data to disappear.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    delete_checkpoint,
    gc,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import read_index, release_read_lease, take_read_lease
from kvckpt.keys import data_prefix


def state(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 14,), value + i) for i in range(8)}


def save(url: str, cid: str, value: float, **kw) -> None:
    dcp.save(state(value), storage_writer=KVStorageWriter(url, **kw), checkpoint_id=cid)


def save_keys(url: str, cid: str, save_id: str) -> list[str]:
    engine = open_store(url)
    return sorted(engine.scan(data_prefix(engine.prefix, cid, save_id)))


class MidLoad(DefaultLoadPlanner):
    """Runs ``action`` between the reader's metadata read and its data reads."""

    def __init__(self, action: Callable[[], None]) -> None:
        super().__init__()
        self.action = action

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        self.action()
        return plan


def writer_keep_last(url: str) -> None:
    save(url, "b", 5.0, keep_last=1)
    save(url, "c", 6.0, keep_last=1)


def gc_keep_last(url: str) -> None:
    save(url, "b", 5.0)
    gc(url, keep_last=1)


def delete(url: str) -> None:
    delete_checkpoint(url, "a")


def resave(url: str) -> None:
    save(url, "a", 7.0)


ACTIONS = {
    "writer keep_last": writer_keep_last,
    "gc keep_last": gc_keep_last,
    "delete_checkpoint": delete,
    "re-save of the id": resave,
}


@pytest.mark.parametrize("action", ACTIONS)
def test_retention_waits_for_a_reader_mid_load(store_url: str, action: str) -> None:
    save(store_url, "a", 1.0)
    (info,) = list_checkpoints(store_url)
    old_keys = save_keys(store_url, "a", info.save_id)
    assert old_keys

    out = state(0.0)
    dcp.load(
        out,
        storage_reader=KVStorageReader(store_url, checkpoint_id="a"),
        planner=MidLoad(lambda: ACTIONS[action](store_url)),
    )
    # The load returned the save it started on, bit for bit, although that save was retired.
    assert all(torch.equal(out[k], v) for k, v in state(1.0).items())

    # The retired save is invisible to listings, and its data is gone once the reader is done:
    # collected by the next gc (or the next commit, for the re-save).
    listed = {i.checkpoint_id: i.save_id for i in list_checkpoints(store_url)}
    assert listed.get("a") != info.save_id
    assert save_keys(store_url, "a", info.save_id) == old_keys  # kept while it was read
    if action == "re-save of the id":
        save(store_url, "z", 9.0)  # any commit collects retired data
    else:
        gc(store_url, scan_orphans=False)
    assert save_keys(store_url, "a", info.save_id) == []
    assert read_index(open_store(store_url)).retired == {}


def test_without_readers_retention_deletes_at_once(store_url: str) -> None:
    save(store_url, "a", 1.0)
    (info,) = list_checkpoints(store_url)
    assert delete_checkpoint(store_url, "a") > 0
    assert save_keys(store_url, "a", info.save_id) == []
    assert read_index(open_store(store_url)).retired == {}


def test_a_crashed_readers_lease_lapses(store_url: str) -> None:
    engine = open_store(store_url)
    save(store_url, "a", 1.0)
    (info,) = list_checkpoints(store_url)
    take_read_lease(engine, "a", "crashed-reader", 0.5)  # a reader that never releases it
    assert delete_checkpoint(store_url, "a") == 0  # data deferred, metadata gone
    assert list_checkpoints(store_url) == []
    gc(store_url, scan_orphans=False)
    assert save_keys(store_url, "a", info.save_id) != []  # the lease still holds it
    time.sleep(0.6)
    gc(store_url, scan_orphans=False)
    assert save_keys(store_url, "a", info.save_id) == []


def test_orphan_scan_spares_data_a_reader_holds(store_url: str) -> None:
    engine = open_store(store_url)
    save(store_url, "a", 1.0)
    (info,) = list_checkpoints(store_url)
    take_read_lease(engine, "a", "reader", 60)
    delete_checkpoint(store_url, "a")
    gc(store_url)  # full gc with the orphan scan
    assert save_keys(store_url, "a", info.save_id) != []
    release_read_lease(engine, "a", "reader")
    gc(store_url)
    assert save_keys(store_url, "a", info.save_id) == []


def test_ranks_that_find_different_saves_refuse_to_mix_them(store_url: str, tmp_path: Path) -> None:

    from tests import _dist
    from tests._spawn import spawn

    dcp.save(
        {"t": torch.full((64,), 1.0)},
        storage_writer=KVStorageWriter(store_url),
        checkpoint_id="race",
    )
    flag = str(tmp_path / "resaved")
    spawn(_dist.racing_load_worker, 2, store_url, flag)
