"""``KVCheckpoint``: a callback that saves frequent checkpoints into a store or ``Tiers``."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from ..engines.base import Engine
from ..errors import (
    CheckpointNotFoundError,
    KVCheckpointError,
    StoreNotFoundError,
)
from ..manage import delete_checkpoint, discard_save, list_checkpoints
from ..stores import open_store
from ..tiered import Tiers
from ..urls import validate_name
from ..writer import KVStorageWriter
from .checkpoint_io import KVCheckpointIO, _PointerAwareIO
from .pointers import _register
from .skeleton import split_checkpoint
from .store import save_checkpoint

logger = logging.getLogger(__name__)


StoreSpec = str | Engine | Tiers | Sequence[str | Engine]


def _checkpoint_tensors(trainer: pl.Trainer) -> dict[str, Any]:
    """The parts of the checkpoint ``dump_checkpoint`` makes that hold tensors, in its order
    (so that ``split_checkpoint`` numbers their tensors as a save does), without the hooks it
    runs: the module's state, the loops', the callbacks', the optimizers' and the schedulers'."""
    from lightning.pytorch.trainer import call

    return {
        "state_dict": trainer.strategy.lightning_module_state_dict(),
        "loops": trainer._checkpoint_connector._get_loops_state_dict(),
        "callbacks": call._call_callbacks_state_dict(trainer),
        "optimizer_states": [trainer.strategy.optimizer_state(o) for o in trainer.optimizers],
        "lr_schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
    }


class KVCheckpoint(Callback):
    """Frequent checkpoints into a kvckpt store, beside the user's own (file) checkpoints.

    Every ``every_n_train_steps`` optimizer steps (at ``on_train_batch_end``, where
    ``ModelCheckpoint(every_n_train_steps=...)`` saves too) the full Lightning checkpoint is
    saved as ``<name>-<global step, 9 digits>`` by global rank 0 (DDP ranks hold the same
    state; every rank builds the checkpoint dict, as ``trainer.save_checkpoint`` does, since a
    sharded strategy gathers optimizer state collectively). Load one with ``auto_resume``.

    Args:
        store: a store URL or engine; a list of them (fastest first: made into ``Tiers``); or
            a ``kvckpt.Tiers`` (copies to its slower stores run in its background thread).
        every_n_train_steps: save when the global step is a multiple of this.
        keep_last: after each save, delete this callback's checkpoints (ids ``<name>-<9
            digits>``) beyond the newest ``keep_last`` (by commit time) from every store; None
            keeps all. Other checkpoints in the same namespace are never touched.
        async_save: copy the tensors (a staging copy in host memory) and write them to the
            store in a background thread while training goes on. Only one save is in flight:
            the next save (and the end of fit) first waits for it, and raises its error if it
            failed.
        name: the checkpoint ids' prefix.
        writer_options: passed to ``KVStorageWriter`` (``checksums``, ``lease``, ``ttl``).

    After the first step that saves nothing, it gets the stores ready for its saves
    (``KVStorageWriter.get_ready``, in the background), so that its first save is as fast as
    the later ones.

    Why not ``ModelCheckpoint`` + ``KVCheckpointIO``: this keeps the user's own checkpoints as
    they are (files, on durable storage) and adds cheap in-memory ones for restarts, with a
    retention of its own.

    In a multi-node job, give it a store every node reaches (Redis, or ``Tiers`` with a shared
    tier): global rank 0 alone saves, so a node-local LMDB store holds the checkpoints on rank
    0's node only.
    """

    def __init__(
        self,
        store: StoreSpec,
        *,
        every_n_train_steps: int,
        keep_last: int | None = 2,
        async_save: bool = False,
        name: str = "step",
        **writer_options: Any,
    ) -> None:
        super().__init__()
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, not {every_n_train_steps}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, not {keep_last}")
        self.tiers: Tiers | None
        #: The stores of a ``Tiers`` this callback built (and so closes at teardown).
        self._own_tiers: list[str | Engine] | None = None
        if isinstance(store, Tiers):
            self.tiers = store
        elif isinstance(store, str | Engine):
            self.tiers = None
        else:
            self._own_tiers = list(store)
        self.writer_options = writer_options
        self._open(store)
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.async_save = async_save
        self.name = validate_name(name, "checkpoint id prefix", 180)
        self._id_re = re.compile(rf"^{re.escape(self.name)}-(\d{{9}})$")
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._pending_id: str | None = None
        self._last_step = -1
        #: whether the store was made ready for this fit's saves (``_get_ready``)
        self._ready = False
        self._installed: tuple[Any, CheckpointIO] | None = None

    def _open(self, store: StoreSpec) -> None:
        """The engines to save to; the ``Tiers`` this callback owns is built here (again, for
        a fit after the teardown that closed it)."""
        if self._own_tiers is not None:
            self.tiers = Tiers(self._own_tiers, **self.writer_options)
        self.engines = (
            list(self.tiers.engines) if self.tiers is not None else [open_store(store)]  # type: ignore[arg-type]
        )
        for engine in self.engines:
            _register(engine)

    def __repr__(self) -> str:
        return f"KVCheckpoint({[e.url for e in self.engines]}, every={self.every_n_train_steps})"

    def checkpoint_id(self, step: int) -> str:
        return f"{self.name}-{step:09d}"

    def owns(self, checkpoint_id: str) -> bool:
        """Whether an id is one of this callback's (retention deletes only these)."""
        return self._id_re.match(checkpoint_id) is not None

    # -- Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._own_tiers is not None and self.tiers is None:  # a fit after teardown
            self._open(self._own_tiers)
        strategy = trainer.strategy
        io_plugin = strategy.checkpoint_io
        if not isinstance(io_plugin, KVCheckpointIO | _PointerAwareIO):
            strategy.checkpoint_io = _PointerAwareIO(io_plugin)
            self._installed = (strategy, io_plugin)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._discard_crashed()
        self._last_step = trainer.global_step  # no save of the step a resume starts from
        self._ready = False

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step <= 0 or step == self._last_step:
            return
        if step % self.every_n_train_steps:
            if not self._ready:
                self._get_ready(trainer)
            return
        self._last_step = step
        self._ready = True
        if trainer.is_global_zero:
            self.wait()  # one save in flight; its staging copy is freed before the next
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if not trainer.is_global_zero:
            return
        tensors, skeleton = split_checkpoint(checkpoint)
        del checkpoint
        checkpoint_id = self.checkpoint_id(step)
        if not self.async_save:
            self._save(checkpoint_id, tensors, skeleton)
            return
        # The staging copy: training may change the live tensors as soon as this returns.
        staged = {fqn: t.to("cpu", copy=True) for fqn, t in tensors.items()}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvckpt-lightning")
        self._pending_id = checkpoint_id
        self._pending = self._pool.submit(self._save, checkpoint_id, staged, skeleton)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wait()
        if self.tiers is not None and trainer.is_global_zero:
            self.tiers.wait()
            if self.keep_last is not None:
                self._retain()  # what retention skipped while copies were in flight

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self.wait()
        except Exception as e:  # the training error is the one to report
            logger.error("kvckpt.lightning: %s", e)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._installed is not None:
            strategy, original = self._installed
            strategy.checkpoint_io = original
            self._installed = None
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self.wait()
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._own_tiers is not None and self.tiers is not None:
            # Its copy thread ends here (after the copies queued, which on_train_end already
            # waited for unless training failed); a later fit builds it again in setup.
            tiers, self.tiers = self.tiers, None
            try:
                tiers.close()
            except Exception as e:  # a training error, if any, is the one to report
                logger.error("kvckpt.lightning: %s", e)

    # -- saving

    def wait(self) -> None:
        """Block until the background save (if any) is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:
            raise KVCheckpointError(
                f"kvckpt.lightning: the background save of checkpoint {self._pending_id!r} to "
                f"{self.engines[0].url} failed: {e}"
            ) from e

    def _writer(self) -> KVStorageWriter:
        # Global rank 0 saves the whole checkpoint, the only process of its node to save.
        if self.tiers is not None:
            return self.tiers.writer(sole_saver=True)
        return KVStorageWriter(self.engines[0], **{**self.writer_options, "sole_saver": True})

    def _get_ready(self, trainer: pl.Trainer) -> None:
        """Get the store ready for this callback's saves (``KVStorageWriter.get_ready``: LMDB's
        pages mapped in, Redis's spares made, on a background thread), so that the first save
        is as fast as the later ones. Called once, at the end of the first step that saves
        nothing: the optimizer's state exists only after a step. The state is the tensors of
        a checkpoint of this step, named as a save names them, gathered as a save gathers them
        (on every rank: under a sharded strategy a collective) but without the checkpoint
        hooks a save runs (``on_save_checkpoint``)."""
        self._ready = True
        try:
            state = _checkpoint_tensors(trainer)
            if not trainer.is_global_zero:
                return
            tensors, _ = split_checkpoint(state)
            self._writer().get_ready(tensors)
        except Exception as e:  # a head start only: a save reports what is wrong with it
            logger.info("kvckpt.lightning: the stores were not made ready: %s", e)

    def _save(self, checkpoint_id: str, tensors: dict[str, torch.Tensor], skeleton: bytes) -> None:
        save_checkpoint((tensors, skeleton), self._writer(), checkpoint_id)
        if self.keep_last is not None:
            self._retain()

    def _retain(self) -> None:
        busy = self.tiers.busy_ids() if self.tiers is not None else set()
        for engine in self.engines:
            try:
                infos = list_checkpoints(engine)
            except StoreNotFoundError:
                continue
            # Newest first by commit time, as auto_resume chooses: after a resume from an
            # earlier step, the new branch's checkpoints are the ones to keep.
            mine = [i.checkpoint_id for i in infos if self.owns(i.checkpoint_id)]
            for checkpoint_id in mine[self.keep_last :]:
                if checkpoint_id in busy:
                    continue  # its copy to a slower tier is still running
                with contextlib.suppress(CheckpointNotFoundError):
                    delete_checkpoint(engine, checkpoint_id, reuse=True)

    def _discard_crashed(self) -> None:
        """Drop this callback's saves that never committed (a job killed mid-save), which
        would otherwise hold their ids' write leases and data until ``kvckpt gc``."""
        for engine in self.engines:
            try:
                infos = list_checkpoints(engine, include_incomplete=True)
            except StoreNotFoundError:
                continue
            for info in infos:
                if not info.complete and info.save_id and self.owns(info.checkpoint_id):
                    with contextlib.suppress(KVCheckpointError):
                        discard_save(engine, info.checkpoint_id, info.save_id)
