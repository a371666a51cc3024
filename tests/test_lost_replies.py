"""A dropped connection at every step of a save, a delete and retention, injected for real: a
loopback proxy (``kvckpt.testing.DroppingProxy``) between kvckpt and a real redis-server drops
the connection at a chosen command, after the server ran it (a lost reply) or before.

Nothing may lose or corrupt a committed checkpoint, and a step that the server ran must not be
reported as failed."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

import kvckpt
from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.testing import DroppingProxy, RedisServer
from kvckpt.verify import verify


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[DroppingProxy]:
    p = DroppingProxy(redis_server.port)
    yield p
    p.close()


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(4)}


def _save(url: str, cid: str, seed: int, **options: object) -> None:
    dcp.save(_state(seed), storage_writer=KVStorageWriter(url, **options), checkpoint_id=cid)  # type: ignore[arg-type]


def _load(url: str, cid: str) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id=cid))
    return out


def _assert_is(url: str, cid: str, seed: int) -> None:
    loaded, want = _load(url, cid), _state(seed)
    assert all(torch.equal(loaded[k], want[k]) for k in want), f"{cid} is not save {seed}"


def test_a_lost_commit_reply_keeps_the_checkpoint(proxy: DroppingProxy, redis_url: str) -> None:
    url = proxy.url()
    _save(url, "step-1", seed=1)
    # The re-save's commit runs on the server; its reply never arrives.
    proxy.drop_on(b"EXEC", containing=b"/meta/")
    _save(url, "step-1", seed=2)
    assert proxy.dropped == 1
    assert kvckpt.latest_checkpoint(redis_url) == "step-1"
    _assert_is(redis_url, "step-1", seed=2)
    assert verify(redis_url, "step-1").ok
    # The replaced save's data went, as after any re-save: nothing but step-1's is left.
    report = kvckpt.gc(redis_url, incomplete_older_than=0)
    assert report.removed_incomplete == [] and report.deleted_keys == 0
    _save(url, "step-1", seed=3)  # and the id saves again
    _assert_is(redis_url, "step-1", seed=3)


#: The commands of a save and a re-save (pending entry, server run id, data, commit, deleting
#: the replaced save's data), each dropped before it reaches the server and after it ran.
_SAVE_STEPS = [
    (b"WATCH", b""),
    (b"EXEC", b"started_at"),
    (b"EXEC", b"/meta/"),
    (b"INFO", b""),
    (b"SET", b"/data/"),
    (b"UNLINK", b""),
]


@pytest.mark.parametrize("before", [True, False], ids=["before", "after"])
@pytest.mark.parametrize(("command", "containing"), _SAVE_STEPS, ids=lambda v: v.decode() or "-")
def test_one_dropped_connection_never_fails_a_save(
    proxy: DroppingProxy, redis_url: str, command: bytes, containing: bytes, before: bool
) -> None:
    url = proxy.url()
    _save(url, "step-1", seed=1)
    proxy.drop_on(command, containing=containing, before=before)
    _save(url, "step-1", seed=2)
    assert proxy.dropped == 1, "the step was never sent"
    _assert_is(redis_url, "step-1", seed=2)
    assert verify(redis_url, "step-1").ok
    kvckpt.gc(redis_url, incomplete_older_than=0)
    _assert_is(redis_url, "step-1", seed=2)


def test_a_lost_delete_reply_reports_the_delete(proxy: DroppingProxy, redis_url: str) -> None:
    _save(redis_url, "step-1", seed=1)
    _save(redis_url, "step-2", seed=2)
    data_keys = [k for k in redis_client_keys(redis_url) if "/data/step-1/" in k]
    assert data_keys
    proxy.drop_on(b"EXEC", containing=b"\r\nDEL\r\n")
    assert kvckpt.delete_checkpoint(proxy.url(), "step-1") == len(data_keys)
    assert proxy.dropped == 1
    assert [i.checkpoint_id for i in kvckpt.list_checkpoints(redis_url)] == ["step-2"]
    assert not [k for k in redis_client_keys(redis_url) if "step-1" in k]
    _assert_is(redis_url, "step-2", seed=2)


def test_a_commit_whose_cleanup_fails_still_succeeds(
    proxy: DroppingProxy, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = proxy.url()
    _save(url, "step-1", seed=1)
    for _ in range(8):  # more drops than the retries: the replaced save's data stays
        proxy.drop_on(b"UNLINK", before=True)
    _save(url, "step-1", seed=2)
    assert "is committed" in caplog.text and "kvckpt gc" in caplog.text
    _assert_is(redis_url, "step-1", seed=2)
    assert kvckpt.gc(redis_url).deleted_keys > 0  # the replaced save's data, left to gc
    _assert_is(redis_url, "step-1", seed=2)


def test_saves_under_repeated_client_kills_lose_nothing(
    redis_server: RedisServer, redis_url: str
) -> None:
    """A background thread kills every client connection every few milliseconds while saves
    and re-saves run: each save either commits whole or fails cleanly, and every committed
    checkpoint loads bit-exact."""
    stop = threading.Event()
    admin = redis_server.client()

    def kill() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                admin.client_kill_filter(_type="normal", skipme=True)
            time.sleep(random.uniform(0.001, 0.02))

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    committed: dict[str, int] = {}
    try:
        for n in range(24):
            cid = f"step-{n % 3}"
            try:
                _save(redis_url, cid, seed=n)
                committed[cid] = n
            except Exception as e:  # a failed save names the store; the old one stays
                assert "redis://" in str(e)
    finally:
        stop.set()
        killer.join()
        admin.close()
    assert committed
    for cid, seed in committed.items():
        _assert_is(redis_url, cid, seed)
        assert verify(redis_url, cid).ok


def redis_client_keys(url: str) -> list[str]:
    engine = kvckpt.open_store(url)
    try:
        return list(engine.scan(""))
    finally:
        engine.close()
