"""Real multi-process torch.distributed (gloo on CPU): resharding, async save, rank-local saves."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from kvckpt import KVStorageReader
from tests import _dist
from tests.conftest import free_port


def spawn(fn, world_size: int, *args) -> None:
    mp.spawn(fn, args=(world_size, free_port(), *args), nprocs=world_size, join=True)


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
