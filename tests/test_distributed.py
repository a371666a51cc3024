"""Real multi-process torch.distributed (gloo on CPU): resharding, async save, rank-local saves."""

from __future__ import annotations

import pytest

from kvckpt import KVStorageReader, list_checkpoints
from tests import _dist
from tests._spawn import spawn


def test_save_at_2_load_at_1_and_3(store_url: str) -> None:
    spawn(_dist.save_worker, 2, store_url, "resharded")
    record = KVStorageReader(store_url, checkpoint_id="resharded").read_record()
    assert record.world_size == 2 and record.rank is None
    _dist.load_single_process(store_url, "resharded")
    spawn(_dist.load_worker, 3, store_url, "resharded")
    spawn(_dist.load_worker, 2, store_url, "resharded")


def test_async_save_thread_and_process(store_url: str) -> None:
    spawn(_dist.async_worker, 2, store_url)


def test_use_collectives_false_rank_local(store_url: str) -> None:
    spawn(_dist.rank_local_worker, 2, store_url)
    for rank in (0, 1):
        record = KVStorageReader(store_url, checkpoint_id="local").read_record(rank=rank)
        assert record.rank == rank and record.world_size == 2


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def test_no_dist_save_in_a_group_records_the_world_size_of_the_save(store_url: str) -> None:
    """One rank of two saving with no_dist=True records world size 1."""
    spawn(_dist.solo_save_worker, 2, store_url)
    assert KVStorageReader(store_url, checkpoint_id="solo").read_record().world_size == 1
    (info,) = list_checkpoints(store_url)
    assert info.checkpoint_id == "solo" and info.world_size == 1 and info.complete
