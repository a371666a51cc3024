"""Rank functions for the multi-process tests (spawned, so they live in an importable module)."""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor import zeros as st_zeros
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kvckpt import KVStorageReader, KVStorageWriter

warnings.filterwarnings("ignore")


def expected() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "dt_shard0": torch.randn(7, 4, generator=g),  # 7 rows over 2 or 3 ranks: uneven
        "dt_shard1": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "dt_rep": torch.randn(6, generator=g),
        "st": torch.randn(10, 3, generator=g),
        "plain": torch.arange(12, dtype=torch.int64).reshape(3, 4),
    }


def _init(rank: int, world_size: int, port: int) -> None:
    import faulthandler

    faulthandler.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


def _finish() -> None:
    """Leave the job cleanly: all ranks done, then the process group torn down.

    The process then exits with os._exit: torch 2.13's gloo can abort in a C++ static destructor
    after the interpreter has finalized ("terminate called without an active exception"), which
    would turn a rank that finished its work into a failure.
    """
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spec(world_size: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])


def _sharded(full: torch.Tensor, world_size: int) -> ShardedTensor:
    st = st_zeros(_spec(world_size), *full.shape)
    for shard in st.local_shards():
        off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[off[0] : off[0] + size[0], off[1] : off[1] + size[1]])
    return st


def distributed_state_dict(world_size: int, fill_zeros: bool = False) -> dict:
    full = expected()
    if fill_zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "dt_shard0": distribute_tensor(full["dt_shard0"], mesh, [Shard(0)]),
        "dt_shard1": distribute_tensor(full["dt_shard1"], mesh, [Shard(1)]),
        "dt_rep": distribute_tensor(full["dt_rep"], mesh, [Replicate()]),
        "st": _sharded(full["st"], world_size),
        "plain": full["plain"],
        "obj": {"step": 0 if fill_zeros else 5, "name": "" if fill_zeros else "adamw"},
    }


def check_distributed(sd: dict) -> None:
    full = expected()
    for name in ("dt_shard0", "dt_shard1", "dt_rep"):
        t = sd[name]
        assert isinstance(t, DTensor)
        assert torch.equal(t.full_tensor(), full[name]), name
    for shard in sd["st"].local_shards():
        off, size = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        want = full["st"][off[0] : off[0] + size[0], off[1] : off[1] + size[1]]
        assert torch.equal(shard.tensor, want), "st"
    assert torch.equal(sd["plain"], full["plain"])
    assert sd["obj"] == {"step": 5, "name": "adamw"}, sd["obj"]


def save_worker(rank: int, world_size: int, port: int, url: str, cid: str) -> None:
    _init(rank, world_size, port)
    dcp.save(
        distributed_state_dict(world_size), storage_writer=KVStorageWriter(url), checkpoint_id=cid
    )
    _finish()


def load_worker(rank: int, world_size: int, port: int, url: str, cid: str) -> None:
    _init(rank, world_size, port)
    sd = distributed_state_dict(world_size, fill_zeros=True)
    dcp.load(sd, storage_reader=KVStorageReader(url), checkpoint_id=cid)
    check_distributed(sd)
    _finish()


def load_single_process(url: str, cid: str) -> None:
    """World size 1 without any process group: every tensor loads whole."""
    sd = {k: torch.zeros_like(v) for k, v in expected().items()}
    sd["obj"] = {"step": 0, "name": ""}
    dcp.load(sd, storage_reader=KVStorageReader(url), checkpoint_id=cid)
    for k, v in expected().items():
        assert torch.equal(sd[k], v), k
    assert sd["obj"] == {"step": 5, "name": "adamw"}


def async_worker(rank: int, world_size: int, port: int, url: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    _init(rank, world_size, port)
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        cid = f"async-{kind.name.lower()}"
        sd = distributed_state_dict(world_size)
        fut = dcp.async_save(
            sd, storage_writer=KVStorageWriter(url), checkpoint_id=cid, async_checkpointer_type=kind
        )
        # Training would go on here and may modify sd: the staged copy is what gets saved.
        sd["dt_rep"].to_local().zero_()
        fut.result()
        loaded = distributed_state_dict(world_size, fill_zeros=True)
        dcp.load(loaded, storage_reader=KVStorageReader(url), checkpoint_id=cid)
        check_distributed(loaded)
    _finish()


def rank_local_worker(rank: int, world_size: int, port: int, url: str) -> None:
    _init(rank, world_size, port)
    mine = {"w": torch.full((4,), float(rank)), "rank": {"id": rank}}
    dcp.save(
        mine, storage_writer=KVStorageWriter(url), checkpoint_id="local", use_collectives=False
    )
    out = {"w": torch.zeros(4), "rank": {"id": -1}}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="local")
    assert torch.equal(out["w"], torch.full((4,), float(rank))), out
    assert out["rank"] == {"id": rank}
    _finish()


def solo_save_worker(rank: int, world_size: int, port: int, url: str) -> None:
    """Rank 0 saves alone (``no_dist=True``) inside an initialised process group."""
    _init(rank, world_size, port)
    if rank == 0:
        dcp.save(
            {"w": torch.ones(4)},
            storage_writer=KVStorageWriter(url),
            checkpoint_id="solo",
            no_dist=True,
        )
    _finish()


def fs_save_worker(rank: int, world_size: int, port: int, directory: str) -> None:
    """Stock DCP: FileSystemWriter at this world size (the source for `kvckpt import`)."""
    _init(rank, world_size, port)
    dcp.save(distributed_state_dict(world_size), checkpoint_id=directory)
    _finish()


def tiered_worker(rank: int, world_size: int, port: int, local: str, shared: str) -> None:
    """A 2-rank async save through Tiers, then a restore that every rank agrees on."""
    from kvckpt import Tiers

    _init(rank, world_size, port)
    tiers = Tiers([local, shared])
    sd = distributed_state_dict(world_size)
    fut = dcp.async_save(sd, storage_writer=tiers.writer(), checkpoint_id="tiered")
    fut.result()
    tiers.wait()
    dist.barrier()
    out = distributed_state_dict(world_size, fill_zeros=True)
    choice = tiers.restore(out)
    assert choice is not None and choice.checkpoint_id == "tiered" and choice.tier == 0
    check_distributed(out)
    tiers.close()
    _finish()


def racing_load_worker(rank: int, world_size: int, port: int, url: str, flag: str) -> None:
    """A 2-rank load of checkpoint "race" during which it is re-saved: rank 0 re-saves it after
    reading the metadata, rank 1 reads the metadata only after that. The load must refuse to
    mix the two saves; the next load gets the new one whole."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    _init(rank, world_size, port)

    class ResaveAfterMetadata(DefaultLoadPlanner):
        def create_local_plan(self):  # type: ignore[no-untyped-def]
            plan = super().create_local_plan()
            if rank == 0:
                new = {"t": torch.full((64,), 2.0)}
                dcp.save(
                    new, storage_writer=KVStorageWriter(url), checkpoint_id="race", no_dist=True
                )
                open(flag, "w").close()
            return plan

    class LateReader(KVStorageReader):
        def read_metadata(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            while rank == 1 and not os.path.exists(flag):
                time.sleep(0.01)
            return super().read_metadata(*args, **kwargs)

    out = {"t": torch.zeros(64)}
    try:
        dcp.load(
            out, storage_reader=LateReader(url, checkpoint_id="race"), planner=ResaveAfterMetadata()
        )
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        assert "was re-saved while this load started" in str(e), e
    else:
        raise AssertionError("a load across a re-save was not refused")
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="race"))
    assert torch.equal(out["t"], torch.full((64,), 2.0))
    _finish()


def two_node_lmdb_worker(rank: int, world_size: int, port: int, base: str) -> None:
    """Each rank saves into its own "node's" LMDB store (rank 0's is the coordinator's), four
    checkpoints with keep_last=1."""
    _init(rank, world_size, port)
    url = f"lmdb://{base}/node{rank}"
    for step in range(4):
        sd = {f"r{rank}": torch.full((1 << 12,), float(step)), "shared": torch.zeros(4)}
        dcp.save(sd, storage_writer=KVStorageWriter(url, keep_last=1), checkpoint_id=f"step-{step}")
    _finish()


def prefetch_two_nodes_worker(
    rank: int, world_size: int, port: int, locals_: list[str], shared: str, prefetch: list[bool]
) -> None:
    """Each rank plays a node of its own (its own hostname and node-local store) that
    ``prefetch``es or not: a node that holds the checkpoint serves it to one that does not, so
    the restore reads nothing from the shared tier either way."""
    import socket

    from kvckpt import Tiers

    socket.gethostname = lambda: f"node{rank}"  # type: ignore[assignment]
    tiers = Tiers([locals_[rank], shared])
    if prefetch[rank]:
        assert tiers.prefetch(local_rank=0) is not None
    _init(rank, world_size, port)
    out = {
        "w": torch.zeros(1 << 18),
        "opt": {"m": torch.zeros(1000, dtype=torch.float64), "step": torch.tensor(0)},
        "step": 0,
    }
    choice = tiers.restore(out)
    assert choice is not None and choice.checkpoint_id == "step-2"
    assert choice.tier == 1, choice  # the newest checkpoint of the shared tier
    stats = tiers.last_restore_stats
    assert stats is not None and sum(stats.shared.values()) == 0, stats
    if prefetch[rank]:  # its own node holds every item
        assert stats.peers == 0 and stats.local > 0, stats
    assert torch.equal(out["w"], torch.full((1 << 18,), 2.0)) and out["step"] == 2
    tiers.close()
    _finish()


def subgroup_restore_worker(rank: int, world_size: int, port: int, url: str, out: str) -> None:
    """Ranks 1 and 2 of 3 load through ``TieredStorageReader`` over a subgroup of their own:
    with the subgroup passed to the reader too (items exchanged between them, by their ranks
    in the subgroup), and without (a clear error). Writes what each of the two got."""
    import json

    from kvckpt.restore import TieredStorageReader

    _init(rank, world_size, port)
    sub = dist.new_group([1, 2], backend="gloo")
    if rank in (1, 2):
        want = {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}
        state = {k: torch.zeros(64, 64) for k in want}
        reader = TieredStorageReader([url], checkpoint_id="whole", process_group=sub)
        dcp.load(state, storage_reader=reader, process_group=sub)
        exact = all(torch.equal(state[k], want[k]) for k in want)
        raised = ""
        try:
            dcp.load(
                state,
                storage_reader=TieredStorageReader([url], checkpoint_id="whole"),
                process_group=sub,
            )
        except BaseException as e:
            raised = str(e)
        with open(os.path.join(out, f"sub.rank{rank}.json"), "w") as f:
            json.dump({"exact": exact, "peers": reader.stats.peers, "raised": raised}, f)
    _finish()


def first_save_spares_worker(rank: int, world_size: int, port: int, url: str) -> None:
    """get_ready makes Redis spares for the values only this rank saves (its chunks of an
    unreplicated DTensor; DCP picks who saves a replicated tensor only from every rank's
    plan), and the first save writes over them."""
    import redis

    from kvckpt.engines._redis_spares import wait_ahead

    _init(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(7)
    sd = {
        "w": distribute_tensor(torch.randn(64, 1024, generator=g), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.randn(64 * 1024, generator=g), mesh, [Replicate()]),
        "plain": torch.randn(64 * 1024, generator=g),
    }
    writer = KVStorageWriter(url)
    writer.get_ready(sd)
    wait_ahead()
    dist.barrier()
    client = redis.Redis.from_url(url)
    spares = sorted(k.decode() for k in client.scan_iter(match="kvckpt/spare/*"))
    assert [s.split("/")[2] for s in spares] == [str(r) for r in range(world_size)], spares
    assert all("/w@" in s for s in spares), spares
    dist.barrier()
    dcp.save(sd, storage_writer=writer, checkpoint_id="first")
    assert not list(client.scan_iter(match="kvckpt/spare/*"))  # every one written over
    loaded = {
        "w": distribute_tensor(torch.zeros(64, 1024), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros(64 * 1024), mesh, [Replicate()]),
        "plain": torch.zeros(64 * 1024),
    }
    dcp.load(loaded, storage_reader=KVStorageReader(url), checkpoint_id="first")
    for name in sd:
        assert torch.equal(
            loaded[name].full_tensor() if name != "plain" else loaded[name],
            sd[name].full_tensor() if name != "plain" else sd[name],
        ), name
    _finish()
