"""Rank functions for the peer-copy tests: gloo ranks on simulated hosts.

Each rank is a host of its own (``KVCKPT_NODE=host<h>``, ``ranks_per_host`` consecutive ranks
per host) with its own node-local LMDB store, ``<root>/host<h>``; a real redis-server is the
shared tier, and its own byte counters say what crossed into it and out of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor

from kvckpt import ReplicationError, Tiers

from ._dist import _finish, _init
from ._hosts import _as_host, bit_exact, full_state, host_url, rank_state

MIB = 0.5


def step_state(world: int, step: int, zeros: bool = False) -> dict[str, Any]:
    """The state at ``step``: every tensor offset by the step, so checkpoints differ."""
    state = rank_state(world, MIB, zeros=zeros)
    if not zeros:
        for v in state.values():
            if isinstance(v, DTensor):
                v.to_local().add_(step)
            elif isinstance(v, torch.Tensor):
                v.add_(step)
        state["step"] = step
    return state


def expected(step: int) -> dict[str, Any]:
    full = full_state(MIB)
    return {k: v + step if isinstance(v, torch.Tensor) else v for k, v in full.items()} | {
        "step": step
    }


def _stores(root: str, rank: int, ranks_per_host: int, redis_url: str | None) -> list[str]:
    local = host_url(root, rank, ranks_per_host)
    return [local] if redis_url is None else [local, redis_url]


def save_worker(
    rank: int,
    world: int,
    port: int,
    root: str,
    redis_url: str | None,
    ranks_per_host: int,
    peers: int,
    shared_every: int,
    steps: int,
    out: str,
) -> None:
    """Save ``steps`` checkpoints through ``Tiers(peers=, shared_every=)``; write the bytes
    the shared tier took in over each save and its copies."""
    _as_host(rank, ranks_per_host)
    _init(rank, world, port)
    client = None if redis_url is None else redis.Redis.from_url(redis_url)
    tiers = Tiers(
        _stores(root, rank, ranks_per_host, redis_url),
        peers=peers,
        shared_every=shared_every,
        keep_last=2,
    )
    into_shared = []
    for step in range(1, steps + 1):
        dist.barrier()
        before = 0 if client is None else int(client.info("stats")["total_net_input_bytes"])
        dcp.save(
            step_state(world, step), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}"
        )
        tiers.wait()
        dist.barrier()
        after = 0 if client is None else int(client.info("stats")["total_net_input_bytes"])
        into_shared.append(after - before)
    tiers.close()
    if rank == 0:
        Path(out, "saves.json").write_text(json.dumps({"into_shared": into_shared}))
    _finish()


def restore_worker(
    rank: int,
    world: int,
    port: int,
    cases: list[tuple[str, str]],
    redis_url: str | None,
    ranks_per_host: int,
    peers: int,
    out: str,
) -> None:
    """Restore each case (name, root of its hosts' stores) through ``Tiers(peers=)``; write
    what was restored, whether bit-exact, and where each rank's bytes came from."""
    _as_host(rank, ranks_per_host)
    _init(rank, world, port)
    client = None if redis_url is None else redis.Redis.from_url(redis_url)
    for name, root in cases:
        state = step_state(world, 0, zeros=True)
        dist.barrier()
        before = 0 if client is None else int(client.info("stats")["total_net_output_bytes"])
        tiers = Tiers(_stores(root, rank, ranks_per_host, redis_url), peers=peers)
        restored = tiers.restore(state)
        stats = tiers.last_restore_stats
        tiers.close()
        dist.barrier()
        served = 0 if client is None else int(client.info("stats")["total_net_output_bytes"])
        step = int(state["step"])
        want = expected(step)
        exact = bit_exact(state, want)
        Path(out, f"{name}.rank{rank}.json").write_text(
            json.dumps(
                {
                    "checkpoint_id": None if restored is None else restored.checkpoint_id,
                    "step": step,
                    "exact": exact,
                    "local": 0 if stats is None else stats.local,
                    "shared": 0 if stats is None else sum(stats.shared.values()),
                    "peers": 0 if stats is None else stats.peers,
                    "served": served - before,
                }
            )
        )
    if client is not None:
        client.close()
    _finish()


class _DamagedOnTheWay:
    """An engine whose lent values arrive damaged at the peers: one byte of each flipped."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @contextlib.contextmanager
    def borrow(self, keys: Any) -> Iterator[list[memoryview | None]]:
        with self._engine.borrow(keys) as views:
            damaged = []
            for view in views:
                if view is None or not view.nbytes:
                    damaged.append(view)
                    continue
                copy = bytearray(view)
                copy[0] ^= 0xFF
                damaged.append(memoryview(copy))
            yield damaged


def _save_step_2(tiers: Tiers, world: int) -> str:
    """Save step-2 and wait for its copies: what ``tiers.wait()`` reported ("" for nothing)."""
    dcp.save(step_state(world, 2), storage_writer=tiers.writer(), checkpoint_id="step-2")
    try:
        tiers.wait()
    except ReplicationError as e:
        return str(e)
    return ""


def damaged_copy_worker(
    rank: int, world: int, port: int, root: str, redis_url: str, out: str
) -> None:
    """Save step-1 (to every store), then step-2, whose copy from host0 arrives damaged."""
    _as_host(rank, 1)
    _init(rank, world, port)
    tiers = Tiers(_stores(root, rank, 1, redis_url), peers=1, shared_every=2)
    dcp.save(step_state(world, 1), storage_writer=tiers.writer(), checkpoint_id="step-1")
    tiers.wait()
    if rank == 0:
        tiers.peer_copies.engine = _DamagedOnTheWay(tiers.peer_copies.engine)
    reported = _save_step_2(tiers, world)
    tiers.close()
    Path(out, f"damaged.rank{rank}.json").write_text(json.dumps({"reported": reported}))
    _finish()


class _FailsOnOneRank(DefaultSavePlanner):
    """A planner whose write fails on ``rank``: the whole save fails there and commits nowhere."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing = rank

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.failing:
            raise RuntimeError("a write that fails on one rank")
        return super().resolve_data(write_item)


def async_and_failed_saves_worker(
    rank: int, world: int, port: int, root: str, ranks_per_host: int, out: str
) -> None:
    """Several ranks per host, no shared tier: an async save, a save that fails on one rank,
    then another async save; the copies stay in step through all three. Each save waits for
    the copies before it (``tiers.wait()``): a save planned while an earlier copy still runs
    is not copied to the peers (as ``copy="newest"``), and on a loaded machine it would be."""
    _as_host(rank, ranks_per_host)
    _init(rank, world, port)
    tiers = Tiers(_stores(root, rank, ranks_per_host, None), peers=1)
    group = dist.new_group(backend="gloo")  # async saves' own collectives
    dcp.async_save(
        step_state(world, 1), storage_writer=tiers.writer(), checkpoint_id="step-1",
        process_group=group,
    ).result()  # fmt: skip
    tiers.wait()
    failed = ""
    try:
        dcp.save(
            step_state(world, 2), storage_writer=tiers.writer(), checkpoint_id="step-2",
            planner=_FailsOnOneRank(world - 1), process_group=group,
        )  # fmt: skip
    except BaseException as e:
        failed = type(e).__name__
    tiers.wait()
    dcp.async_save(
        step_state(world, 3), storage_writer=tiers.writer(), checkpoint_id="step-3",
        process_group=group,
    ).result()  # fmt: skip
    tiers.wait()
    tiers.close()
    Path(out, f"saves.rank{rank}.json").write_text(json.dumps({"failed": failed}))
    _finish()


def killed_mid_copy_worker(
    rank: int, world: int, port: int, root: str, redis_url: str, victim: int, out: str
) -> None:
    """Save step-1 (to every store), then step-2, during whose peer copy ``victim`` is
    SIGKILLed as its first chunk lands. The others write what ``Tiers.wait()`` reported, and
    leave without a barrier (the job is broken: a real one would be restarted)."""
    _as_host(rank, 1)
    _init(rank, world, port)
    tiers = Tiers(
        _stores(root, rank, 1, redis_url),
        peers=1,
        shared_every=1000,
        peer_budget_bytes=64 << 10,  # many chunks: the kill lands mid-copy
        replicate_timeout=30,
    )
    dcp.save(step_state(world, 1), storage_writer=tiers.writer(), checkpoint_id="step-1")
    tiers.wait()
    if rank == victim:
        copier = tiers.peer_copies

        def dying(*args: Any) -> int:
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        copier._store = dying  # type: ignore[method-assign]
    reported = _save_step_2(tiers, world)
    Path(out, f"killed.rank{rank}.json").write_text(json.dumps({"reported": reported}))
    sys.stdout.flush()
    os._exit(0)
