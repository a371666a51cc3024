"""The training job of tests/test_torchtitan.py, as torchtitan's ``Trainer`` runs it on CPU, in a
module of its own so that spawned ranks (``rank_main``) import it without pytest."""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import (
    LRSchedulersContainer,
    OptimizersContainer,
    default_adamw,
)

from kvckpt.torchtitan import KVCheckpointManager

TOTAL_STEPS = 10


class TrainState(Stateful):
    """The trainer's own ``train_state`` (``Trainer.state_dict``): step and tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class Batches(IterableDataset):
    """An endless, seeded stream: a restored dataloader must continue where the saved one was."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(7)
        while True:
            x = torch.randn(8, generator=g)
            yield x, torch.tanh(x[:4] * 2)


@dataclass
class Job:
    """One training job as torchtitan's ``Trainer`` runs it, on CPU."""

    model: nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    checkpointer: KVCheckpointManager
    batches: Iterator[Any] | None = None
    snapshots: dict[int, dict[str, Any]] = field(default_factory=dict)

    def train(self, until: int, *, snapshot_at: tuple[int, ...] = ()) -> None:
        """``Trainer.train``'s loop from the current step to ``until``."""
        if self.batches is None:  # the trainer's batch generator starts after the load
            self.batches = iter(self.dataloader)
        while self.train_state.step < until:
            self.train_state.step += 1
            x, y = next(self.batches)
            loss = nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            self.train_state.ntokens_seen += x.shape[0]
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            if self.train_state.step in snapshot_at:
                self.snapshots[self.train_state.step] = snapshot(self)
            self.checkpointer.save(
                self.train_state.step, last_step=self.train_state.step == TOTAL_STEPS
            )

    def stop(self) -> None:
        """The end of a job that did not reach its last step (a crash or preemption after the
        last save finished)."""
        self.checkpointer.maybe_wait_for_saving()
        self.checkpointer.close()


def make_job(
    config: KVCheckpointManager.Config,
    tmp_path: Path,
    seed: int = 0,
    dp: tuple[int, int] = (0, 1),
) -> Job:
    """A job built as the trainer builds one; ``dp``: (data-parallel rank, degree)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt_config = default_adamw(lr=1e-2)
    opt_config.implementation = "for-loop"
    optimizers = opt_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=TOTAL_STEPS
    )
    dataloader = ParallelAwareDataloader(
        Batches(), dp_rank=dp[0], dp_world_size=dp[1], batch_size=2
    )
    train_state = TrainState()
    # Exactly the trainer's call (torchtitan/trainer.py, "build checkpointer").
    checkpointer = config.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(tmp_path / "dump"),
    )
    assert type(checkpointer) is KVCheckpointManager
    return Job(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer)


def snapshot(job: Job) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": job.model.state_dict(),
            "optimizer": job.optimizers.state_dict(),
            "lr": job.lr_schedulers.state_dict(),
            "train": job.train_state.state_dict(),
        }
    )


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested state (tensors with ``torch.equal``)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def config(url: str, **kw: Any) -> KVCheckpointManager.Config:
    kw.setdefault("interval", 3)
    kw.setdefault("keep_latest_k", 0)
    return KVCheckpointManager.Config(enable=True, store_url=url, **kw)


def rank_main(rank: int, world_size: int, port: int, url: str, out: str, async_mode: str) -> None:
    """One rank of a data-parallel job (``ParallelAwareDataloader`` at dp rank ``rank``): it
    trains to step 8 saving at 3 and 6, then a new job on the same rank resumes from the store
    (rank 0 picks the step for all) and trains to step 8 again. Writes both jobs' snapshots."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    tmp = Path(out) / f"rank{rank}"
    first = make_job(config(url, async_mode=async_mode), tmp, dp=(rank, world_size))
    assert first.checkpointer.load() is False
    first.train(8, snapshot_at=(6, 8))
    first.stop()
    dist.barrier()
    second = make_job(config(url, async_mode=async_mode), tmp, seed=1, dp=(rank, world_size))
    assert second.checkpointer.load() is True
    restored = snapshot(second)
    second.train(8, snapshot_at=(8,))
    second.stop()
    torch.save(
        {"first": first.snapshots, "restored": restored, "continued": second.snapshots[8]},
        Path(out) / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in a static destructor after a clean finish (tests/_dist.py)
