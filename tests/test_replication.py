"""Redis replication: a save counts once N replicas acknowledged it (``WAIT``), tested with a
real primary and replica started by the test."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    StoreUnavailableError,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import lease_key
from kvckpt.keys import data_prefix
from kvckpt.testing import RedisServer


def wait_link_up(replica: RedisServer) -> None:
    client = replica.client()
    deadline = time.monotonic() + 30
    while client.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    client.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    primary = RedisServer(tmp_path / "primary")
    replica = RedisServer(tmp_path / "replica", "--replicaof", "127.0.0.1", str(primary.port))
    try:
        wait_link_up(replica)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def sd(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 18,), value + i) for i in range(8)}  # 8 MiB


def test_save_waits_for_the_replica(pair: tuple[RedisServer, RedisServer]) -> None:
    primary, replica = pair
    writer = KVStorageWriter(primary.url(wait_replicas=1))
    dcp.save(sd(1.0), storage_writer=writer, checkpoint_id="step-1")
    # WAIT returned, so the replica has every key already: no polling needed.
    assert latest_checkpoint(replica.url()) == "step-1"
    out = sd(0.0)
    dcp.load(out, storage_reader=KVStorageReader(replica.url(), checkpoint_id="step-1"))
    assert all(torch.equal(out[k], v) for k, v in sd(1.0).items())
    # Writes through the replica are refused clearly.
    with pytest.raises(BaseException, match=r"ReadOnlyStoreError.*read-only replica"):
        dcp.save(sd(2.0), storage_writer=KVStorageWriter(replica.url()), checkpoint_id="x")


def test_too_few_replicas_is_a_clear_error(pair: tuple[RedisServer, RedisServer]) -> None:
    primary, replica = pair
    dcp.save(sd(1.0), storage_writer=KVStorageWriter(primary.url()), checkpoint_id="old")
    replica.stop()
    url = primary.url(wait_replicas=1, wait_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(BaseException, match=r"only 0 of the 1 replicas") as info:
        dcp.save(sd(2.0), storage_writer=KVStorageWriter(url), checkpoint_id="new")
    assert time.monotonic() - started < 20
    assert "wait_timeout" in str(info.value)
    # The server answered: the error says so, not "cannot reach Redis".
    assert "cannot reach" not in str(info.value) and "redis-server running" not in str(info.value)
    # The data wait failed before the commit: "new" never existed; "old" is intact.
    assert [i.checkpoint_id for i in list_checkpoints(primary.url())] == ["old"]
    # The failed save is cleaned up at once, as other failed saves are: not listed as
    # incomplete, no data left, its write lease released.
    assert [i.checkpoint_id for i in list_checkpoints(primary.url(), include_incomplete=True)] == [
        "old"
    ]
    engine = open_store(primary.url())
    assert list(engine.scan(data_prefix(engine.prefix, "new"))) == []
    assert engine.get(lease_key(engine.prefix, "new")) is None


def test_too_few_replicas_keeps_its_own_diagnosis(redis_url: str) -> None:
    engine = open_store(redis_url + "?wait_replicas=1&wait_timeout=0.1")
    with pytest.raises(StoreUnavailableError) as info:
        engine.sync_replicas()
    message = str(info.value)
    assert message.startswith("only 0 of the 1 replicas"), message
    assert "cannot reach" not in message
