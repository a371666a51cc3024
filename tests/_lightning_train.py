"""A small Lightning DDP run (2 CPU ranks, gloo) for tests/test_lightning_ddp.py, under torchrun.

Checkpoints go two ways into one store: ``KVCheckpoint`` every ``--every`` steps (ids
``step-...``, optionally in the background) and ``ModelCheckpoint`` (``save_last``, one kept)
through ``KVCheckpointIO``, with pointer files in ``--ckpt-dir``. ``--kill-at`` SIGKILLs global
rank 0 (the one that saves) at the start of that step; ``--resume`` restarts from
``auto_resume``'s choice. Rank 0 writes the final parameters and optimizer state to ``--out``;
every rank writes one JSON line per event to ``--events``.

Resuming is bit-exact here because the data of each epoch is a pure function of the epoch
(Lightning's ``DistributedSampler`` with ``set_epoch``), the model has no randomness, and the
callback saves at epoch ends (2 batches per epoch and rank, ``--every 2``): Lightning resumes a
mid-epoch checkpoint of a non-resumable DataLoader from the epoch's first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from kvckpt.lightning import KVCheckpoint, KVCheckpointIO, auto_resume, read_pointer

warnings.filterwarnings("ignore")


class Net(L.LightningModule):
    """An MLP with AdamW and a per-step LR schedule: optimizer and scheduler state both matter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(samples: int = 16, batch_size: int = 4, shuffle: bool = True) -> DataLoader:
    """Under DDP, Lightning turns the shuffle into a ``DistributedSampler`` (seeded, reshuffled
    by ``set_epoch``); a single-process test passes ``shuffle=False``, since the global RNG that
    a plain shuffle draws from is not part of a Lightning checkpoint."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


class Events(Callback):
    """JSON lines: where training started (step, checkpoint) and the steps taken."""

    def __init__(self, path: str, ckpt_path: str | None) -> None:
        self.path, self.ckpt_path = path, ckpt_path

    def write(self, trainer: L.Trainer, **event: Any) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"rank": trainer.global_rank, **event}) + "\n")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Each rank's auto_resume writes its own pointer file: compare what they point to.
        pointer = read_pointer(self.ckpt_path) if self.ckpt_path else None
        source = pointer["checkpoint_id"] if pointer else self.ckpt_path
        self.write(trainer, event="start", step=trainer.global_step, resumed_from=source)


class KillAt(Callback):
    """SIGKILL global rank 0 when the given step starts (no cleanup, no flush: a crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    L.seed_everything(0, verbose=False)
    model = Net()
    plugin = KVCheckpointIO(args.store)
    frequent = KVCheckpoint(
        args.store, every_n_train_steps=args.every, keep_last=2, async_save=args.async_save
    )
    ckpt_path = auto_resume([frequent, plugin], ckpt_dir=args.ckpt_dir) if args.resume else None
    callbacks: list[Callback] = [
        frequent,
        ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=4, save_last=True),
        Events(args.events, ckpt_path),
    ]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        plugins=[plugin],
        callbacks=callbacks,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.dirname(args.out),
    )
    trainer.fit(model, train_dataloaders=data(), ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "global_step": trainer.global_step,
            },
            args.out,
        )
    Events(args.events, ckpt_path).write(trainer, event="end", step=trainer.global_step)
    # torch 2.13's gloo can abort in a static destructor at interpreter exit (tests/_dist.py).
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
