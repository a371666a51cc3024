"""Rank functions for tests/test_megatron.py (spawned, so they live in an importable module).

One model, saved at tensor-parallel 2 (world size 2) and loaded at world sizes 1 and 3 with
other shardings: a row-parallel weight, a column-parallel bf16 weight (loaded row-parallel), a
replicated bias, experts held as two local shards per rank (a ``LocalShardsContainer``), a
sharded object per rank (an RNG state) and common state.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

import torch.distributed.checkpoint as dcp  # noqa: E402
from megatron.core import dist_checkpointing as mdc  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies.checkpointable import (  # noqa: E402
    CheckpointableShardedTensor,
    LocalShardsContainer,
)

from kvckpt import KVStorageReader, KVStorageWriter, list_checkpoints  # noqa: E402
from kvckpt.megatron import (  # noqa: E402
    BackgroundSave,
    KVLoadCommonStrategy,
    KVLoadShardedStrategy,
    KVSaveShardedStrategy,
    register,
    save,
)
from tests._dist import _finish, _init  # noqa: E402

SYNC, THREAD, FORK = "iter_0000010", "iter_0000020", "iter_0000030"
#: Megatron's own save with only the sharded strategy ours: common state in common.pt (LMDB only)
PLAIN = "iter_0000040"
#: what each checkpoint's tensors are multiplied by, so that no load can pass with another's data
SCALE = {SYNC: 1.0, THREAD: 2.0, FORK: 3.0, PLAIN: 4.0}
UNSAFE = "iter_unsafe"
DCP_ID = "dcp-checkpointable"


class Opaque:
    """A class that torch.load(weights_only=True) refuses: stands for any arbitrary object."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)

    def __hash__(self) -> int:
        return 0


def full(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    tensors = {
        "decoder.weight": torch.randn(6, 4, generator=g),
        "decoder.proj": torch.randn(3, 4, generator=g),
        "decoder.bias": torch.randn(5, generator=g),
        "experts.weight": torch.randn(4, 2, generator=g),
    }
    out = {k: v * scale for k, v in tensors.items()}
    out["decoder.proj"] = out["decoder.proj"].to(torch.bfloat16)
    return out


def common(iteration: int) -> dict[str, Any]:
    return {"iteration": iteration, "args": {"lr": 0.5, "name": "gpt"}, "tokens": torch.arange(3)}


def rng_state(shard: int) -> dict[str, Any]:
    return {"seed": 1000 + shard, "state": torch.full((2,), shard)}


def sharded_state_dict(rank: int, world_size: int, scale: float | None) -> dict[str, Any]:
    """This rank's Megatron sharded state dict; ``scale=None`` for an empty one to load into.

    World size 2 is the saving layout (TP 2); 3 and 1 shard differently.
    """
    f = full(1.0 if scale is None else scale)

    def data(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if scale is None else t.clone()

    rows = 6 // world_size
    sd: dict[str, Any] = {
        "weight": ShardedTensor.from_rank_offsets(
            "decoder.weight",
            data(f["decoder.weight"][rank * rows : (rank + 1) * rows]),
            (0, rank, world_size),
        ),
        "bias": ShardedTensor.from_rank_offsets(
            "decoder.bias", data(f["decoder.bias"]), replica_id=rank
        ),
    }
    proj, experts = f["decoder.proj"], f["experts.weight"]
    if world_size == 2:  # column-parallel; two experts (rows) per rank, one shard each
        sd["proj"] = ShardedTensor.from_rank_offsets(
            "decoder.proj", data(proj[:, 2 * rank : 2 * rank + 2]), (1, rank, 2)
        )
        mine = [2 * rank, 2 * rank + 1]
    elif world_size == 3:  # row-parallel; ranks 0, 1 one expert each, rank 2 two
        sd["proj"] = ShardedTensor.from_rank_offsets(
            "decoder.proj", data(proj[rank : rank + 1]), (0, rank, 3)
        )
        mine = [rank] if rank < 2 else [2, 3]
    else:
        sd["proj"] = ShardedTensor.from_rank_offsets("decoder.proj", data(proj))
        mine = [0, 1, 2, 3]
    for e in mine:
        sd[f"expert{e}"] = ShardedTensor.from_rank_offsets(
            "experts.weight", data(experts[e : e + 1]), (0, e, 4)
        )
    if world_size == 2:
        sd["rng"] = ShardedObject("rng", rng_state(rank) if scale else None, (2,), (rank,))
    elif world_size == 3:  # rank 2 reads shard 1 too, as a replica
        sd["rng"] = ShardedObject("rng", None, (2,), (min(rank, 1),), replica_id=int(rank == 2))
    else:
        sd["rng0"] = ShardedObject("rng", None, (2,), (0,))
        sd["rng1"] = ShardedObject("rng", None, (2,), (1,))
    return sd


def check_loaded(loaded: dict[str, Any], rank: int, world_size: int, checkpoint_id: str) -> None:
    want = sharded_state_dict(rank, world_size, SCALE[checkpoint_id])
    for name, sh in want.items():
        got = loaded[name]
        if isinstance(sh, ShardedTensor):
            assert got.dtype == sh.data.dtype and torch.equal(got, sh.data), (checkpoint_id, name)
        else:
            shard = sh.global_offset[0]
            assert got["seed"] == 1000 + shard, (checkpoint_id, name, got)
            assert torch.equal(got["state"], torch.full((2,), shard)), (checkpoint_id, name)
    iteration = int(checkpoint_id.removeprefix("iter_"))
    want_common = common(iteration)
    assert loaded["iteration"] == iteration and loaded["args"] == want_common["args"], loaded
    assert torch.equal(loaded["tokens"], want_common["tokens"])


def to_save(rank: int, scale: float, iteration: int) -> dict[str, Any]:
    sd = sharded_state_dict(rank, 2, scale)
    sd.update(common(iteration))
    return sd


def checkpointable(rank: int, world_size: int, fill: bool) -> dict[str, torch.Tensor]:
    """Plain DCP state dict of Megatron's DCP-compatible wrappers: a CheckpointableShardedTensor
    and a LocalShardsContainer (several shards of one fqn on this rank)."""
    f = full()
    rows = 6 // world_size
    t = f["decoder.weight"][rank * rows : (rank + 1) * rows]
    single = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets(
            "w", t.clone() if fill else torch.zeros_like(t), (0, rank, world_size)
        )
    )
    experts = f["experts.weight"]
    mine = {2: [2 * rank, 2 * rank + 1], 3: [rank] if rank < 2 else [2, 3], 1: [0, 1, 2, 3]}
    shards = [
        CheckpointableShardedTensor.from_sh_ten(
            ShardedTensor.from_rank_offsets(
                "e",
                experts[e : e + 1].clone() if fill else torch.zeros(1, 2),
                (0, e, 4),
            )
        )
        for e in mine[world_size]
    ]
    return {"w": single, "e": LocalShardsContainer(shards)}


def check_checkpointable(sd: dict[str, torch.Tensor], rank: int, world_size: int) -> None:
    want = checkpointable(rank, world_size, fill=True)
    assert torch.equal(sd["w"]._sh_ten.data, want["w"]._sh_ten.data)
    for got, exp in zip(sd["e"]._local_shards, want["e"]._local_shards, strict=True):
        assert torch.equal(got._sh_ten.data, exp._sh_ten.data)


def _fork_and_run(request: Any) -> None:
    """What Megatron's TemporalAsyncCaller does on a GPU node, without its CUDA calls: stage,
    then write in a forked process."""
    args = list(request.async_fn_args)
    args[1] = request.preload_fn()
    proc = multiprocessing.get_context("fork").Process(target=request.async_fn, args=args)
    proc.start()
    proc.join()
    assert proc.exitcode == 0, proc.exitcode


def save_job(rank: int, world_size: int, port: int, urls: dict[str, str], root: str) -> None:
    """World size 2 (TP 2): every kind of save, to every store."""
    _init(rank, world_size, port)
    notes: dict[str, Any] = {}
    for name, url in urls.items():
        base = Path(root) / name
        strategy = KVSaveShardedStrategy(url)
        for cid in (SYNC, THREAD, FORK, UNSAFE, PLAIN):
            (base / cid).mkdir(parents=True, exist_ok=True)
        dist.barrier()

        save(to_save(rank, 1.0, 10), base / SYNC, strategy)

        register(url)  # the THREAD save names the registered strategy: ("kvckpt", 1)
        for cid, run in ((THREAD, BackgroundSave), (FORK, _fork_and_run)):
            sd = to_save(rank, SCALE[cid], int(cid.removeprefix("iter_")))
            how = ("kvckpt", 1) if cid == THREAD else strategy
            request = save(sd, base / cid, how, async_sharded_save=True)
            # Megatron's persistent worker gets the request pickled; the write must survive it.
            assert callable(pickle.loads(pickle.dumps(request.async_fn)))
            running = run(request)
            # Training goes on and changes the parameters: the staged copy is what is saved.
            for v in sd.values():
                if isinstance(v, ShardedTensor):
                    v.data.zero_()
            notes[f"{name}/{cid}"] = {
                "metadata_json_before_finalize": (base / cid / "metadata.json").exists(),
                "listed_before_finalize": cid in {i.checkpoint_id for i in list_checkpoints(url)},
            }
            if isinstance(running, BackgroundSave):
                running.finalize()
            else:
                for fn in request.finalize_fns:
                    fn()

        if name == "lmdb":
            unsafe = to_save(rank, 1.0, 0)
            unsafe["opaque"] = Opaque()
            save(unsafe, base / UNSAFE, strategy)
            mdc.save(to_save(rank, SCALE[PLAIN], 40), str(base / PLAIN), sharded_strategy=strategy)

        # Plain DCP with Megatron's DCP-compatible tensor wrappers.
        dcp.save(
            checkpointable(rank, world_size, fill=True),
            storage_writer=KVStorageWriter(url),
            checkpoint_id=DCP_ID,
        )
        back = checkpointable(rank, world_size, fill=False)
        dcp.load(back, storage_reader=KVStorageReader(url), checkpoint_id=DCP_ID)
        check_checkpointable(back, rank, world_size)
    if rank == 0:
        (Path(root) / "notes.json").write_text(json.dumps(notes))
    _finish()


def load_job(rank: int, world_size: int, port: int, urls: dict[str, str], root: str) -> None:
    """Load every checkpoint at this world size, with this world size's sharding."""
    _init(rank, world_size, port)
    for name, url in urls.items():
        base = Path(root) / name
        for cid in (SYNC, THREAD):
            loaded = mdc.load(
                sharded_state_dict(rank, world_size, None),
                str(base / cid),
                sharded_strategy=KVLoadShardedStrategy(url),
                common_strategy=KVLoadCommonStrategy(url),
            )
            check_loaded(loaded, rank, world_size, cid)
        register(url)  # Megatron finds both strategies from metadata.json
        loaded = mdc.load(sharded_state_dict(rank, world_size, None), str(base / FORK))
        check_loaded(loaded, rank, world_size, FORK)
        if name == "lmdb":  # sharded part in the store, common.pt loaded by Megatron
            loaded = mdc.load(
                sharded_state_dict(rank, world_size, None),
                str(base / PLAIN),
                sharded_strategy=KVLoadShardedStrategy(url),
            )
            check_loaded(loaded, rank, world_size, PLAIN)
        back = checkpointable(rank, world_size, fill=False)
        dcp.load(back, storage_reader=KVStorageReader(url), checkpoint_id=DCP_ID)
        check_checkpointable(back, rank, world_size)
    _finish()


os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def ready_job(rank: int, world_size: int, port: int, urls: dict[str, str], root: str) -> None:
    """``KVSaveShardedStrategy.get_ready`` before a job's first save: each rank makes room for
    its own part (its shard of a row-parallel weight, the main replica of a replicated bias on
    rank 0), and the Redis spares it makes are those of the values the first save writes."""
    from kvckpt.engines._redis_spares import wait_ahead
    from kvckpt.engines.base import Engine
    from kvckpt.engines.lmdb import LMDBEngine
    from kvckpt.keys import data_prefix, spare_key, spare_prefix

    _init(rank, world_size, port)
    asked: list[int] = []
    for cls in (Engine, LMDBEngine):  # (LMDB's own, and the one every other engine has)

        def record(self: Engine, nbytes: int, *args: Any, _original: Any = cls.get_ready) -> None:
            asked.append(nbytes)
            _original(self, nbytes, *args)

        cls.get_ready = record  # type: ignore[method-assign]
    weight = torch.full((64, 512), float(rank + 1))  # 128 KiB a rank: Redis keeps spares of it
    bias = torch.ones(8)

    def state() -> dict[str, Any]:
        return {
            "w": ShardedTensor.from_rank_offsets("w", weight, (0, rank, world_size)),
            "b": ShardedTensor.from_rank_offsets("b", bias, replica_id=rank),
        }

    for name, url in urls.items():
        asked.clear()
        strategy = KVSaveShardedStrategy(url, checkpoint_id=f"ready-{name}")
        strategy.get_ready(state())
        assert asked == [weight.nbytes + (bias.nbytes if rank == 0 else 0)], asked
        if name == "redis":
            wait_ahead()
        dist.barrier()
        engine = strategy.engine
        made = set(engine.scan(spare_prefix(engine.prefix)))
        (Path(root) / name).mkdir(parents=True, exist_ok=True)
        save(state(), Path(root) / name, strategy)
        if name == "redis":  # every rank's spares, every rank's values
            written = engine.scan(data_prefix(engine.prefix, f"ready-{name}"))
            large = [k for k in written if (engine.value_sizes([k])[0] or 0) >= 1 << 16]
            assert {spare_key(engine.prefix, k) for k in large} == made, (large, made)
            assert len(made) == world_size
    _finish()
