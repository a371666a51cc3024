"""Rank functions for restore-at-scale tests: gloo ranks on simulated hosts.

Each rank's host is ``KVCKPT_NODE=host<h>`` (``ranks_per_host`` consecutive ranks per host), and
each host has its own node-local LMDB store, ``<root>/host<h>``: what a job of several nodes
looks like from one machine. The state is half replicated (DDP: plain tensors every rank holds
whole) and half sharded (FSDP: DTensors sharded over the ranks on dim 0).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kvckpt import Tiers
from kvckpt.peer_copy import DEFAULT_BUDGET
from kvckpt.restore import TieredStorageReader

from ._dist import _finish, _init

#: the exchange's budget of the ``budget`` cases: less than one item of a 4 MiB state
BUDGET = 64 << 10


def full_state(mib: float) -> dict[str, Any]:
    """The whole state: ``mib`` MiB, half in 4 replicated tensors (DDP), half in 4 sharded ones
    (FSDP), one HSDP tensor (replicated over one mesh dimension, sharded over the other), and a
    few objects (stored as pickled bytes, loaded under ``weights_only`` rules)."""
    g = torch.Generator().manual_seed(7)
    rows = max(8, int(mib * (1 << 20) / 2 / 4 / 4 / 64))  # float32 x 64 columns
    state = {f"rep{i}": torch.randn(rows, 64, generator=g) for i in range(4)}
    state |= {f"shard{i}": torch.randn(rows * 8, 8, generator=g) for i in range(4)}
    state["hsdp"] = torch.randn(rows, 16, generator=g)
    return state | {"step": 7, "run": {"name": "scale", "lr": [0.1, 0.01]}}


def rank_state(world: int, mib: float, zeros: bool = False) -> dict[str, Any]:
    full = full_state(mib)
    if zeros:  # the same structure, other values
        full = {k: torch.zeros_like(v) for k, v in full.items() if isinstance(v, torch.Tensor)}
        full |= {"step": 0, "run": {"name": "", "lr": [0.0, 0.0]}}
    mesh = init_device_mesh("cpu", (world,))
    replicas = 2 if world % 2 == 0 else 1
    hsdp = init_device_mesh("cpu", (replicas, world // replicas))
    state = {
        k: distribute_tensor(v, mesh, [Shard(0)])
        if k.startswith("shard")
        else v.clone()
        if isinstance(v, torch.Tensor)
        else v
        for k, v in full.items()
    }
    state["hsdp"] = distribute_tensor(full["hsdp"], hsdp, [Replicate(), Shard(0)])
    return state


def bit_exact(state: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether a restored state (DTensors gathered whole) equals ``want``, bit for bit."""
    exact = True
    for k, v in state.items():
        got = v.full_tensor() if isinstance(v, DTensor) else v
        same = torch.equal(got, want[k]) if isinstance(got, torch.Tensor) else got == want[k]
        exact &= bool(same)
    return exact


def host_url(root: str, rank: int, ranks_per_host: int) -> str:
    return f"lmdb://{root}/host{rank // ranks_per_host}"


def _as_host(rank: int, ranks_per_host: int) -> None:
    os.environ["KVCKPT_NODE"] = f"host{rank // ranks_per_host}"


def save_worker(
    rank: int, world: int, port: int, root: str, redis_url: str, ranks_per_host: int, mib: float
) -> None:
    _as_host(rank, ranks_per_host)
    _init(rank, world, port)
    tiers = Tiers([host_url(root, rank, ranks_per_host), redis_url])
    dcp.save(rank_state(world, mib), storage_writer=tiers.writer(), checkpoint_id="step-1")
    tiers.close()
    _finish()


def restore_worker(
    rank: int,
    world: int,
    port: int,
    cases: list[tuple[str, str, str]],
    redis_url: str,
    ranks_per_host: int,
    mib: float,
    out: str,
) -> None:
    """Restore each case (name, root of its hosts' stores, how: ``reader`` alone, ``budget``
    (a reader whose exchange holds at most ``BUDGET`` bytes at once), ``tiers``, or ``prefetch``
    then ``tiers``) in turn; write each rank's counters, and what Redis served
    meanwhile, per case."""
    _as_host(rank, ranks_per_host)
    _init(rank, world, port)
    client = redis.Redis.from_url(redis_url)
    want = full_state(mib)
    for name, root, how in cases:
        state = rank_state(world, mib, zeros=True)
        stores = [host_url(root, rank, ranks_per_host), redis_url]
        dist.barrier()
        before = int(client.info("stats")["total_net_output_bytes"])
        dist.barrier()
        if how not in ("reader", "budget"):
            tiers = Tiers(stores)
            if how == "prefetch":
                tiers.prefetch(
                    local_rank=rank % ranks_per_host,
                    node_rank=rank // ranks_per_host,
                    ranks_per_node=ranks_per_host,
                )
            restored = tiers.restore(state)
            assert restored is not None and restored.checkpoint_id == "step-1"
            stats = tiers.last_restore_stats
            assert stats is not None
            tiers.close()
        else:
            budget = BUDGET if how == "budget" else DEFAULT_BUDGET
            reader = TieredStorageReader(stores, checkpoint_id="step-1", budget_bytes=budget)
            dcp.load(state, storage_reader=reader)
            stats = reader.stats
        dist.barrier()
        served = int(client.info("stats")["total_net_output_bytes"]) - before
        exact = bit_exact(state, want)
        Path(out, f"{name}.rank{rank}.json").write_text(
            json.dumps(
                {
                    "exact": exact,
                    "local": stats.local,
                    "shared": sum(stats.shared.values()),
                    "peers": stats.peers,
                    "from_other_nodes": stats.from_other_nodes,
                    "sent": stats.sent,
                    "fallbacks": stats.fallbacks,
                    "peak_buffered": stats.peak_buffered,
                    "served": served,
                }
            )
        )
    client.close()
    _finish()


class _RefusingPlanner(DefaultLoadPlanner):
    """A load planner that refuses one tensor: an error raised while an item is applied."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        if read_item.dest_index.fqn == self.fqn:
            raise RuntimeError(f"this planner refuses {self.fqn!r}")
        return super().resolve_tensor(read_item)


def refusing_restore_worker(
    rank: int, world: int, port: int, root: str, redis_url: str, fqn: str, out: str
) -> None:
    """Every rank restores through a reader whose exchange takes many steps; one rank's
    planner refuses ``fqn``. Writes what each rank's load raised."""
    _as_host(rank, 1)
    _init(rank, world, port)
    state = rank_state(world, 4.0, zeros=True)
    reader = TieredStorageReader(
        [host_url(root, rank, 1), redis_url], checkpoint_id="step-1", budget_bytes=BUDGET
    )
    planner = _RefusingPlanner(fqn) if rank == world - 1 else DefaultLoadPlanner()
    raised = ""
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except BaseException as e:
        raised = str(e)
    Path(out, f"refused.rank{rank}.json").write_text(json.dumps({"raised": raised}))
    _finish()
