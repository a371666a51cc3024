"""What makes a restart lose little: staging off the training loop's path
(``background_stager``), and the newest checkpoint brought into node-local memory while the job
starts up (``Tiers.prefetch``). Real LMDB, a real redis-server, real gloo ranks."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import kvckpt
from kvckpt import KVStorageReader, KVStorageWriter, Tiers, list_checkpoints, open_store
from kvckpt.catalog import read_index
from kvckpt.keys import data_prefix
from tests import _dist
from tests._spawn import spawn


def state(value: float) -> dict[str, object]:
    return {
        "w": torch.full((1 << 18,), value),
        "opt": {"m": torch.arange(1000, dtype=torch.float64) * value, "step": torch.tensor(7)},
        "step": int(value),
    }


def loaded(url: str, checkpoint_id: str) -> dict[str, object]:
    out = state(-1.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id=checkpoint_id))
    return out


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if isinstance(a[k], dict):
            if not same(a[k], b[k]):
                return False
        elif isinstance(a[k], torch.Tensor):
            if not torch.equal(a[k], b[k]):
                return False
        elif a[k] != b[k]:
            return False
    return True


def test_background_stager_saves_the_state_at_staging_bit_exact(store_url: str) -> None:
    """DCP's AsyncSaveResponse flow on a CPU-only host: ``stage()`` returns at once, the copy
    runs on a thread, and the state may change as soon as ``staging_completion`` is done. The
    checkpoint holds the state at staging, bit-exact, save after save through one reused
    staging copy."""
    stager = kvckpt.background_stager()
    live = state(1.0)
    try:
        for step in (1, 2, 3):
            expected = {
                "w": live["w"].clone(),  # type: ignore[union-attr]
                "opt": {k: v.clone() for k, v in live["opt"].items()},  # type: ignore[union-attr]
                "step": live["step"],
            }
            response = dcp.async_save(
                live,
                storage_writer=KVStorageWriter(store_url, keep_last=2),
                checkpoint_id=f"step-{step}",
                async_stager=stager,
            )
            assert isinstance(response, AsyncSaveResponse)
            response.staging_completion.result()
            # What an optimizer step does right after: change every tensor in place.
            live["w"].add_(0.5)  # type: ignore[union-attr]
            live["opt"]["m"].mul_(3)  # type: ignore[index]
            live["opt"]["step"].add_(1)  # type: ignore[index]
            live["step"] = step + 1
            response.upload_completion.result()
            assert same(loaded(store_url, f"step-{step}"), expected)
        assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["step-3", "step-2"]
    finally:
        stager.close()


def test_background_stager_reuses_one_staging_copy() -> None:
    stager = kvckpt.background_stager()
    live = state(1.0)
    try:
        first = stager.stage(live).result()  # type: ignore[union-attr]
        live["w"].add_(1)  # type: ignore[union-attr]
        second = stager.stage(live).result()  # type: ignore[union-attr]
        assert first["w"].data_ptr() == second["w"].data_ptr() != live["w"].data_ptr()
        assert torch.equal(second["w"], live["w"])  # type: ignore[arg-type]
        assert not first["w"].is_pinned()  # no accelerator here: plain memory
    finally:
        stager.close()


def saved_tiers(tmp_path: Path, redis_url: str) -> Tiers:
    tiers = Tiers([f"lmdb://{tmp_path / 'old-node'}", redis_url], keep_last=2)
    for step in (1, 2):
        dcp.save(state(float(step)), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}")
    tiers.wait()
    tiers.close()
    return tiers


def test_prefetch_brings_the_newest_checkpoint_into_the_local_tier(
    tmp_path: Path, redis_url: str
) -> None:
    saved_tiers(tmp_path, redis_url)
    new_node = f"lmdb://{tmp_path / 'new-node'}"  # a replaced node: its local store is empty
    tiers = Tiers([new_node, redis_url], keep_last=2)
    future = tiers.prefetch()
    assert future is not None
    brought = future.result()
    assert brought is not None and (brought.checkpoint_id, brought.tier) == ("step-2", 0)
    (local,) = list_checkpoints(new_node)
    (shared,) = [i for i in list_checkpoints(redis_url) if i.checkpoint_id == "step-2"]
    assert (local.checkpoint_id, local.created_at, local.save_id) == (
        "step-2",
        shared.created_at,
        shared.save_id,
    )
    out = state(-1.0)
    choice = tiers.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-2", 0)
    assert same(out, state(2.0))
    # Nothing more to bring now: the first tier holds the newest.
    again = Tiers([new_node, redis_url])
    assert again.prefetch().result() is None  # type: ignore[union-attr]
    # The next save goes on as usual, retention included.
    dcp.save(state(3.0), storage_writer=tiers.writer(), checkpoint_id="step-3")
    tiers.close()
    assert [i.checkpoint_id for i in list_checkpoints(new_node)] == ["step-3", "step-2"]


def test_prefetch_waits_for_a_spare_core(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every core of the node has a rank to start, a copy into local memory would only
    compete with the start-up: ``prefetch()`` copies nothing and the restore reads the shared
    tier; ``force=True`` copies all the same. The copy runs below the caller's priority."""
    saved_tiers(tmp_path, redis_url)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(os.sched_getaffinity(0))))
    tiers = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    assert tiers.prefetch() is None
    out = state(-1.0)
    choice = tiers.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-2", 1)
    assert same(out, state(2.0))
    assert tiers.last_restore_stats.shared and not tiers.last_restore_stats.local

    future = tiers.prefetch(force=True)
    assert future is not None
    brought = future.result()
    assert brought is not None and (brought.checkpoint_id, brought.tier) == ("step-2", 0)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    theirs = tiers._pool.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ).result()
    assert theirs == min(19, mine + kvckpt.node.BACKGROUND_NICENESS)
    tiers.close()


def test_prefetch_runs_on_local_rank_0_only(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_tiers(tmp_path, redis_url)
    monkeypatch.setenv("LOCAL_RANK", "1")
    tiers = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    assert tiers.prefetch() is None
    assert list_checkpoints(tiers.engines[0]) == []
    # A shared first tier, or a single tier: nothing to bring.
    assert Tiers([redis_url], keep_last=2).prefetch(local_rank=0) is None
    tiers.close()


def test_prefetch_with_nothing_saved(tmp_path: Path, redis_url: str) -> None:
    tiers = Tiers([f"lmdb://{tmp_path / 'node'}", redis_url])
    assert tiers.prefetch().result() is None  # type: ignore[union-attr]
    assert tiers.restore(state(0.0)) is None
    tiers.close()


def test_a_failed_prefetch_leaves_nothing_and_the_restore_reads_the_shared_tier(
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved_tiers(tmp_path, redis_url)
    tiers = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    real_put_many = tiers.engines[0].put_many
    calls = []

    def put_many_then_fail(items, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        real_put_many(items, **kwargs)
        raise kvckpt.StoreFullError("no room left (simulated)")

    monkeypatch.setattr(tiers.engines[0], "put_many", put_many_then_fail)
    with caplog.at_level(logging.WARNING, logger="kvckpt.tiered"):
        tiers.prefetch()
        out = state(-1.0)
        choice = tiers.restore(out)
    assert calls and "prefetch failed" in caplog.text and "no room left" in caplog.text
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-2", 1)
    assert same(out, state(2.0))
    local = open_store(tiers.engines[0])
    assert list(local.scan(data_prefix(local.prefix))) == []
    assert read_index(local).pending == {} and list_checkpoints(local) == []
    tiers.close()


def test_a_cleanup_racing_the_prefetch_never_publishes_missing_data(
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restart's cleanup (``gc(incomplete_older_than=0)`` on the local store) while the
    prefetch copies into it: the copy must fail, not commit metadata whose data gc deleted
    (what a CI run of benchmarks/goodput.py once hit as a damaged 'step-2')."""
    saved_tiers(tmp_path, redis_url)
    tiers = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    real_put_many = tiers.engines[0].put_many

    def put_many_then_cleanup(items, **kwargs):  # type: ignore[no-untyped-def]
        real_put_many(items, **kwargs)
        kvckpt.gc(tiers.engines[0], incomplete_older_than=0, scan_orphans=False)

    monkeypatch.setattr(tiers.engines[0], "put_many", put_many_then_cleanup)
    with caplog.at_level(logging.WARNING, logger="kvckpt.tiered"):
        tiers.prefetch()
        out = state(-1.0)
        choice = tiers.restore(out)
    assert "prefetch failed" in caplog.text and "removed as incomplete" in caplog.text
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-2", 1)
    assert same(out, state(2.0))
    local = open_store(tiers.engines[0])
    assert list(local.scan(data_prefix(local.prefix))) == []
    assert read_index(local).pending == {} and list_checkpoints(local) == []
    tiers.close()


@pytest.mark.parametrize("prefetch", [[True, True], [True, False]])
def test_every_node_prefetched_so_every_rank_reads_its_own_node(
    tmp_path: Path, redis_url: str, prefetch: list[bool]
) -> None:
    """Two ranks on two (simulated) nodes: a node that prefetched the checkpoint reads it from
    its own store and serves the other node, so the shared tier serves no data."""
    saved_tiers(tmp_path, redis_url)
    locals_ = [f"lmdb://{tmp_path / f'node{r}'}" for r in range(2)]
    spawn(_dist.prefetch_two_nodes_worker, 2, locals_, redis_url, prefetch)
    for r, did in enumerate(prefetch):
        assert [i.checkpoint_id for i in list_checkpoints(locals_[r])] == (
            ["step-2"] if did else []
        )
