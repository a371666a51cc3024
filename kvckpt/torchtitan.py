"""A torchtitan 0.3 checkpoint manager that keeps a run's checkpoints in a kvckpt store
(``pip install 'kvckpt[torchtitan]'``: torchtitan 0.3.x).

torchtitan picks its checkpoint manager by the class of ``Trainer.Config.checkpoint``: every
manager is a ``Configurable`` whose nested ``Config`` builds it. So a config function selects
this one by naming its config, with the store URL in it::

    from kvckpt.torchtitan import KVCheckpointManager

    def llama3_kv() -> Trainer.Config:
        config = llama3_debugmodel()
        config.checkpoint = KVCheckpointManager.Config(
            enable=True, store_url="redis://ckpt-redis:6379/0?prefix=run7",
            interval=500, keep_latest_k=3, async_mode="async",
        )
        return config

``KVCheckpointManager`` is torchtitan's own ``CheckpointManager`` with its storage replaced, and
only that: the save policy (``interval``, ``enable_first_step_checkpoint``, the last step's
model-only export, ``load_only``), what is saved and loaded (``ModelWrapper``'s flat model
state, ``exclude_from_loading``, the model-only step 0 seed) and the async modes' bookkeeping
(``maybe_wait_for_staging`` / ``maybe_wait_for_saving``) all run torchtitan's code. What differs:

- Step ``N`` is the kvckpt checkpoint ``step-N`` in ``store_url`` (a ``?prefix=`` per run keeps
  runs that share a store apart), written by ``KVStorageWriter``: a reader sees all of a step
  or none of it, so no folder scan has to guess which steps are whole.
- ``keep_latest_k`` is kvckpt retention (``KVStorageWriter(keep_last=k)``), applied right after
  each commit, instead of torchtitan's purge thread deleting directories. It keeps the newest
  ``k`` complete checkpoints of the store's namespace (by commit time), whatever their ids.
- A restart resumes from the highest complete ``step-N`` in the store's catalog (one read), as
  torchtitan resumes from the highest ``step-N`` folder with a ``.metadata`` file.
- ``replica_urls`` adds slower stores that every checkpoint is copied to in the background
  (``kvckpt.Tiers``): node-local LMDB in ``store_url`` and a shared Redis replica, and a job
  on a replaced node resumes from Redis. A step is read from the fastest store that holds it.
- Loads go through ``KVStorageReader`` with ``weights_only`` rules (``DirectoryReader`` for a DCP
  directory): a store that others can write to cannot run code in the trainer.
- ``async_with_pinned_mem`` stages through ``kvckpt.background_stager()``, DCP's
  ``DefaultStager`` with what the host supports (pinned memory and a side stream where an
  accelerator is, plain memory on a CPU-only host, where torchtitan's own stager fails), and
  uploads on a thread of the trainer's process rather than in a second process.
- After the first training step that does not save, the store gets ready for the run's saves
  in the background (``Tiers.get_ready``), so the first checkpoint writes into memory made
  ready while the steps before it ran, as every later one does.

``initial_load_path`` takes, besides torchtitan's DCP directory, a kvckpt store:
``<store URL>#<checkpoint id>``, or ``<store URL>`` alone for its newest complete checkpoint.

This module is imported explicitly (``import kvckpt.torchtitan``); ``import kvckpt`` never imports
torchtitan.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.stateful import Stateful

try:
    from torchtitan.components.checkpointer.base import MODEL
    from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
    from torchtitan.tools import filesystem
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import GarbageCollection
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvckpt.torchtitan needs torchtitan 0.3.x: pip install 'kvckpt[torchtitan]' ({e})"
    ) from e

from .dcp_files import DirectoryReader
from .errors import (
    CheckpointNotFoundError,
    KVCheckpointError,
    ReplicationError,
    StoreNotFoundError,
)
from .manage import list_checkpoints, stored_checkpoints
from .node import node_id
from .reader import KVStorageReader
from .staging import background_stager
from .stores import BUILTIN_SCHEMES, ENTRY_POINT_GROUP, open_store
from .tiered import Tiers
from .urls import mask_url
from .writer import KVStorageWriter

__all__ = [
    "KVCheckpointManager",
    "checkpoint_id_for_step",
    "describe",
    "is_store_url",
    "split_store_path",
    "step_of",
]

_STEP_ID = re.compile(r"step-(\d+)")


def checkpoint_id_for_step(step: int) -> str:
    """The kvckpt checkpoint id of training step ``step``: torchtitan's folder name, ``step-N``."""
    return f"step-{step}"


def step_of(checkpoint_id: str) -> int | None:
    """The training step a checkpoint id names (``step-100`` -> 100), or None for other ids."""
    m = _STEP_ID.fullmatch(checkpoint_id)
    return int(m.group(1)) if m else None


def is_store_url(path: str) -> bool:
    """Whether ``path`` names a kvckpt store (a scheme kvckpt has an engine for), as opposed to
    a DCP directory, local or fsspec (``gs://...``)."""
    if "://" not in path:
        return False
    scheme = path.split("://", 1)[0].lower()
    if scheme in BUILTIN_SCHEMES:
        return True
    return any(ep.name == scheme for ep in entry_points(group=ENTRY_POINT_GROUP))


def describe(path: str) -> str:
    """A checkpoint path for messages: a store URL's password masked, its ``#<id>`` kept."""
    if not is_store_url(path):
        return path
    url, checkpoint_id = split_store_path(path)
    return mask_url(url) + ("" if checkpoint_id is None else f"#{checkpoint_id}")


def split_store_path(path: str) -> tuple[str, str | None]:
    """``<store URL>#<checkpoint id>`` -> (URL, id); a URL without ``#`` -> (URL, None)."""
    url, sep, checkpoint_id = path.rpartition("#")
    if not sep:
        return path, None
    return url, checkpoint_id or None


def _is_directory(path: str) -> bool:
    """Whether fsspec finds a directory at ``path``; False for a protocol it does not know
    (a mistyped store scheme, whose error would otherwise hide the message below)."""
    try:
        return bool(filesystem.isdir(path))
    except (ValueError, ImportError):
        return False


def _latest_stored(url: str) -> str | None:
    """``latest_checkpoint``, raising ``StoreNotFoundError`` for a store that does not exist."""
    infos = stored_checkpoints(open_store(url, create=False))
    complete = [i for i in infos if i.complete]
    return complete[0].checkpoint_id if complete else None


def _on_rank_0(choose: Any) -> Any:
    """``choose()`` on rank 0, its answer on every rank (``choose()`` alone without a group)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return choose()
    found: list[Any] = [None, None]
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            found[0] = choose()
        except Exception as e:  # every rank raises, none waits for the others
            error, found[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(found, src=0)
    if error is not None:
        raise error
    if found[1] is not None:
        raise KVCheckpointError(f"rank 0 failed: {found[1]}")
    return found[0]


class KVCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` saving to and loading from a kvckpt store.

    Built by torchtitan from ``KVCheckpointManager.Config`` (``config.checkpoint.build(...)``),
    with the same arguments as ``CheckpointManager``. Only the storage methods are overridden
    (``dcp_save``, ``dcp_load``, ``_find_load_step``, ``_create_checkpoint_id``, ``_load``,
    ``_purge_stale_checkpoints``, ``_close``), and ``save``, which gets the store ready at its
    first call; the module docstring lists what that changes.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        store_url: str = ""
        """kvckpt store URL the checkpoints go to and resume from (``lmdb:///dev/shm/ckpt``,
        ``redis://host:6379/0?prefix=run7``). Required when ``enable`` is set."""

        replica_urls: list[str] = field(default_factory=list)
        """Slower stores that each checkpoint is copied to in the background once it commits
        in ``store_url`` (``kvckpt.Tiers``): node-local LMDB in ``store_url``, a shared Redis
        here, so that a job whose node was replaced resumes from Redis. Retention
        (``keep_latest_k``) applies to every store."""

        weights_only: bool = True
        """Load stored objects (optimizer hyperparameters, dataloader and train state) under
        ``torch.load(weights_only=True)`` rules. Set False only for a store you trust with
        objects that need unrestricted unpickling."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            self.store_url = self.store_url.strip()
            if self.enable and not self.store_url:
                raise ValueError(
                    "checkpoint.store_url is required: KVCheckpointManager saves to a kvckpt "
                    "store, e.g. --checkpoint.store_url lmdb:///dev/shm/ckpt or "
                    "redis://host:6379/0"
                )
            self.replica_urls = [u.strip() for u in self.replica_urls if u.strip()]
            for name, url in [("store_url", self.store_url)] + [
                ("replica_urls", u) for u in self.replica_urls
            ]:
                if url and not is_store_url(url):
                    raise ValueError(
                        f"checkpoint.{name} {mask_url(url)!r} is not a kvckpt store URL: use "
                        f"one of the schemes {', '.join(BUILTIN_SCHEMES)} (a directory belongs "
                        "in torchtitan's CheckpointManager.Config.folder)"
                    )

        def to_dict(self) -> dict:
            """torchtitan's serialized config, with the store URLs' passwords masked: the
            trainer prints it, saves it and hands it to its metrics backends (WandB,
            TensorBoard)."""
            out = CheckpointManager.Config.to_dict(self)
            out["store_url"] = mask_url(self.store_url) if self.store_url else ""
            out["replica_urls"] = [mask_url(u) for u in self.replica_urls]
            return out

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.store_url = config.store_url
        self.replica_urls = list(config.replica_urls)
        self.weights_only = config.weights_only
        #: built at the first save, so that a load_only job creates no store
        self.tiers: Tiers | None = None
        #: whether ``save`` has had its first call (``_get_ready``)
        self._first_call_done = False
        # Retention is the writer's (keep_last), right after each commit: torchtitan's purge
        # thread, which deletes step-N directories, has nothing to do.
        purge_thread: threading.Thread | None = getattr(self, "purge_thread", None)
        if purge_thread is not None:
            self.purge_queue.put(None)
            purge_thread.join()
            self.purge_thread = None
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # torchtitan builds a DefaultStager that pins unconditionally on its first save,
            # which fails without an accelerator; this one pins only where that works.
            self.stager = background_stager()
        logger.info(
            "Checkpointing to kvckpt store %s%s (keep_latest_k=%d, async_mode=%s)",
            mask_url(self.store_url),
            "".join(f", copied to {mask_url(u)}" for u in self.replica_urls),
            self.keep_latest_k,
            self.async_mode.value,
        )

    # -- where a step lives -----------------------------------------------------------------

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """``step-N`` in the store; with ``folder`` (a Hugging Face export), torchtitan's path."""
        if folder:
            return super()._create_checkpoint_id(step, folder)
        return checkpoint_id_for_step(step)

    def stored_steps(self) -> dict[int, str]:
        """The steps with a complete checkpoint, ascending, each with the store to read it from:
        the fastest that holds its newest save ({} before the first save: an LMDB store that
        does not exist yet is not created by looking). With ``replica_urls``, a node-local
        store (LMDB) counts only when every rank runs on one host, as in ``Tiers.latest``.

        Collective in a job of several ranks: rank 0 reads the catalogs and every rank gets its
        answer, so a save or retention between two ranks' reads cannot have them resume from
        different steps."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self._read_steps(single_host=True)
        single_host = True
        if self.replica_urls:
            hosts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, node_id())
            single_host = len(set(hosts)) == 1
        found: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                found[0] = self._read_steps(single_host)
            except Exception as e:  # every rank raises it, none waits for the others
                found[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(found, src=0)
        if isinstance(found[0], str):
            raise KVCheckpointError(
                f"rank 0 could not list the checkpoints of {mask_url(self.store_url)}: {found[0]}"
            )
        return dict(found[0])

    def _read_steps(self, single_host: bool) -> dict[int, str]:
        urls = [self.store_url, *self.replica_urls]
        best: dict[int, tuple[float, int]] = {}  # step -> (commit time, -tier)
        for tier, url in enumerate(urls):
            try:
                engine = open_store(url, create=False)
                try:  # opened for this listing only: its connections close with it
                    if len(urls) > 1 and not (engine.shared or single_host):
                        continue  # another node's ranks wrote to their own node's store
                    infos = list_checkpoints(engine)
                finally:
                    engine.close()
            except StoreNotFoundError:
                continue
            except KVCheckpointError as e:
                if len(urls) == 1:
                    raise
                logger.warning("kvckpt: resuming without %s: %s", mask_url(url), e)
                continue
            for info in infos:
                step = step_of(info.checkpoint_id)
                if step is None or not info.complete or info.rank_local:
                    continue
                # the newest save of the step (a failed copy can leave an older one in a
                # replica), from the fastest store that holds it
                best[step] = max(best.get(step, (-1.0, 0)), (info.created_at, -tier))
        return {step: urls[-best[step][1]] for step in sorted(best)}

    def _find_load_step(self, folder: str = "") -> int:
        """The highest complete ``step-N`` in the store (torchtitan's rule for its folders),
        or -1. ``folder``: torchtitan's scan of that directory."""
        if folder:
            return super()._find_load_step(folder)
        return max(self.stored_steps(), default=-1)

    def _purge_stale_checkpoints(self) -> None:
        """Nothing to do: ``KVStorageWriter(keep_last=keep_latest_k)`` already applied
        retention when the save committed."""

    # -- DCP calls ----------------------------------------------------------------------------

    def _reader(self, url: str, checkpoint_id: str) -> KVStorageReader:
        reader = KVStorageReader(url, checkpoint_id=checkpoint_id, weights_only=self.weights_only)
        # A refused object's error tells the user the switch they have: this config's.
        reader.weights_only_opt_out = "KVCheckpointManager.Config(weights_only=False)"
        return reader

    def _writer(self) -> KVStorageWriter:
        # One Tiers (one store, or the store and its replicas) for the whole run: its engines,
        # and their connections, are opened once and closed by ``_close``.
        if self.tiers is None:
            self.tiers = Tiers(
                [self.store_url, *self.replica_urls], keep_last=self.keep_latest_k or None
            )
        return self.tiers.writer()

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """torchtitan's ``save``, which the trainer calls after every step. At its first call,
        where that step saves nothing, the store gets ready for the run's saves first
        (``_get_ready``)."""
        if self.enable and not self.load_only and not self._first_call_done:
            self._first_call_done = True
            if not self._should_save(curr_step, last_step):
                self._get_ready()
        return super().save(curr_step, last_step)

    def _get_ready(self) -> None:
        """Start getting the store ready for saves of the state torchtitan saves
        (``KVStorageWriter.get_ready``: LMDB's pages mapped in, Redis's spares made, on a
        background thread). Called after a training step, when the optimizer's state exists:
        reading the state dicts for their sizes then changes nothing (before the first step,
        torchtitan's optimizer would make its state with a step of its own). A store that
        cannot be made ready is logged, not raised: the save reports what is wrong with it."""
        states = {
            k: v.state_dict() if isinstance(v, Stateful) else v
            for k, v in self._flattened_model_states_sd().items()
        }
        try:
            self._writer().get_ready(states)
        except KVCheckpointError as e:
            logger.warning(
                "kvckpt: %s was not made ready ahead of the first save: %s",
                mask_url(self.store_url),
                e,
            )

    def _close(self) -> None:
        """torchtitan's close, then (with ``replica_urls``) wait for the background copies:
        a job that ends leaves every checkpoint in every store. A copy that failed is logged,
        not raised: the checkpoint is committed in ``store_url`` all the same."""
        super()._close()
        tiers, self.tiers = self.tiers, None
        if tiers is not None:
            try:
                tiers.close()
            except ReplicationError as e:
                logger.error("kvckpt: %s", e)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        """torchtitan's ``dcp_save`` with a ``KVStorageWriter``: ``None`` when synchronous, a
        ``Future`` for ``async``, an ``AsyncSaveResponse`` for ``async_with_pinned_mem``.

        ``to_hf`` (``last_save_in_hf``) exports Hugging Face safetensors, a file format, to
        torchtitan's ``<dump_folder>/<folder>/step-N`` with torchtitan's own writer.
        """
        if to_hf:
            path = filesystem.join(self.folder, checkpoint_id)
            return super().dcp_save(
                state_dict, path, async_mode, enable_garbage_collection, to_hf=True
            )
        writer = self._writer()
        ret: Future | AsyncSaveResponse | None = None
        if async_mode == AsyncMode.ASYNC:
            # The writer stages (a blocking copy) and the upload runs on a thread.
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
            )
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # The copy runs in the background (staging_completion) and the upload on a thread
            # of this process: the writer's store connections and retention stay here.
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
                async_stager=self.stager,
            )
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """Load ``checkpoint_id`` into ``state_dict``: a checkpoint id in the store, a
        ``<store URL>[#<id>]``, or a DCP directory. Hugging Face safetensors and fsspec
        directories (``gs://...``) load with torchtitan's own readers."""
        if from_hf or (not is_store_url(checkpoint_id) and "://" in checkpoint_id):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader: KVStorageReader | DirectoryReader
        if is_store_url(checkpoint_id):
            url, cid = split_store_path(checkpoint_id)
            if cid is None:
                # every rank loads the same; a store that is not there is an error here (a
                # path mistyped), where latest_checkpoint would answer None
                cid = _on_rank_0(lambda: _latest_stored(url))
                if cid is None:
                    raise CheckpointNotFoundError(
                        f"checkpoint.initial_load_path {mask_url(url)!r} holds no complete "
                        "checkpoint; name one with '<URL>#<checkpoint id>'"
                    )
            reader = self._reader(url, cid)
        elif checkpoint_id.startswith("/"):
            if not filesystem.isdir(checkpoint_id):
                raise ValueError(
                    f"checkpoint.initial_load_path {checkpoint_id!r} is not a DCP checkpoint "
                    "directory"
                )
            reader = DirectoryReader(checkpoint_id, weights_only=self.weights_only)
        else:
            reader = self._reader(self.store_url, checkpoint_id)
        dcp.load(state_dict, storage_reader=reader)
        # As torchtitan does: the model's states are flattened into the state dict, so the
        # model itself gets them after DCP loaded the tensors in place.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """torchtitan's ``_load`` over the store: resume from ``step`` (the highest complete
        step when -1) if the store has it, else the initial load (``initial_load_path``, a
        Hugging Face model), else a fresh start (False)."""
        from_hf = from_quantized = False
        steps = self.stored_steps()
        if step == -1:
            load_step = max(steps, default=-1)
        else:
            if step not in steps:
                shown = ", ".join(str(s) for s in list(steps)[-20:]) or "none"
                stores = " or ".join(mask_url(u) for u in [self.store_url, *self.replica_urls])
                raise CheckpointNotFoundError(
                    f"--checkpoint.load_step={step}: checkpoint "
                    f"{checkpoint_id_for_step(step)!r} is not a complete checkpoint in "
                    f"{stores} (complete steps there: {shown})"
                )
            load_step = step

        if load_step == -1:
            model_only = self.initial_load_model_only
            from_hf = self.initial_load_in_hf
            from_quantized = self.initial_load_in_hf_quantized
            if from_hf and not model_only:
                raise ValueError("Only the model loads from a Hugging Face checkpoint.")
            if from_quantized and not from_hf:
                raise ValueError("A quantized checkpoint loads only in Hugging Face format.")
            if self.initial_load_path:
                checkpoint_id = self.initial_load_path
                if not is_store_url(checkpoint_id) and not _is_directory(checkpoint_id):
                    shown = mask_url(checkpoint_id) if "://" in checkpoint_id else checkpoint_id
                    raise ValueError(
                        f"checkpoint.initial_load_path {shown!r} is neither a kvckpt store URL "
                        f"(schemes: {', '.join(BUILTIN_SCHEMES)}; add #<checkpoint id> for one "
                        "checkpoint) nor a DCP checkpoint directory"
                    )
            elif from_hf:
                if not (self.sd_adapter and self.sd_adapter.hf_assets_path):
                    raise ValueError("from_hf=True requires sd_adapter and hf_assets_path.")
                checkpoint_id = self.sd_adapter.hf_assets_path
                if not filesystem.isdir(checkpoint_id):
                    raise ValueError(
                        "model.hf_assets_path is being used to load HF weights but the path "
                        f"{checkpoint_id!r} is not a directory"
                    )
            else:
                logger.info(
                    "No checkpoint in %s and no initial_load_path: a fresh start.",
                    mask_url(self.store_url),
                )
                return False
            where = describe(checkpoint_id)
        else:
            # The fault-tolerance branch: the store has this run's checkpoints, so the initial_*
            # options are ignored by design (torchtitan's rule); step 0 is a model-only seed.
            model_only = load_step == 0
            url = steps[load_step]
            where = f"{self._create_checkpoint_id(load_step)} in {mask_url(url)}"
            checkpoint_id = f"{url}#{self._create_checkpoint_id(load_step)}"

        logger.info("Loading the checkpoint %s.", where)
        states = self._states_to_load(model_only)
        self.dcp_load(
            states, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized
        )
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info("Finished loading the checkpoint %s.", where)
        return True
