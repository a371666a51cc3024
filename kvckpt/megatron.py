"""Megatron-Core ``dist_checkpointing`` strategies that keep a whole Megatron checkpoint in a
kvckpt store (``pip install 'kvckpt[megatron]'``: megatron-core 0.16.x).

Megatron saves a checkpoint in three parts: sharded tensors, sharded objects (per-rank state
such as RNG states) and the *common* state that every rank holds alike (iteration, args, ...).
``KVSaveShardedStrategy`` writes the first two as one kvckpt checkpoint through
``KVStorageWriter``, translated by Megatron's own helpers and ``MCoreSavePlanner``.
``KVSaveCommonStrategy`` hands rank 0's common state to that same save, where it becomes one more
object item, committed in the same transaction as the tensors: a reader sees all of a Megatron
checkpoint or none of it. Megatron's ``checkpoint_dir`` then holds only Megatron's
``metadata.json``; its base name is the kvckpt checkpoint id (docs/MEGATRON.md).

Nothing read from the store is unpickled without restriction: sharded objects load through
``KVStorageReader`` (``weights_only`` rules) and the common state with
``torch.load(weights_only=True)``, unless the caller opts out for a store it trusts.

Imported explicitly (``import kvckpt.megatron``): ``import kvckpt`` never imports Megatron.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

try:
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        CheckpointingException,
        ShardedObject,
        ShardedStateDict,
        ShardedTensor,
        StateDict,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        LoadCommonStrategy,
        LoadShardedStrategy,
        SaveCommonStrategy,
    )
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_plan,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        mcore_to_pyt_state_dict,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvckpt.megatron needs megatron-core 0.16.x: pip install 'kvckpt[megatron]' ({e})"
    ) from e

try:  # the strategy registry: deprecated in megatron-core 0.17, removed in 0.19
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
        register_default_strategy,
    )
except ImportError:  # pragma: no cover - megatron-core >= 0.19
    StrategyAction = None

from .catalog import read_lease
from .engines.base import Engine
from .errors import InvalidCheckpointIdError, KVCheckpointError, MetadataError
from .manage import remove_items
from .megatron_write import PlannedWriter, WriteJob, stage
from .reader import KVStorageReader, fetch_parts
from .safe_load import load_object
from .stores import open_store
from .urls import validate_name
from .writer import KVStorageWriter

__all__ = [
    "BACKEND",
    "COMMON_FQN",
    "VERSION",
    "BackgroundSave",
    "KVLoadCommonStrategy",
    "KVLoadShardedStrategy",
    "KVSaveCommonStrategy",
    "KVSaveShardedStrategy",
    "checkpoint_id_for",
    "register",
    "save",
]

#: The backend name Megatron records in ``metadata.json`` (and its strategy registry key).
BACKEND = "kvckpt"
VERSION = 1
#: The DCP key of the common state inside a kvckpt checkpoint. Megatron's sharded keys are
#: model parameter names and ``key/shard_...`` object keys, never this.
COMMON_FQN = "__kvckpt__/megatron/common"

#: (store URL, checkpoint id) -> the save whose common state this process loaded last; the
#: sharded load that Megatron runs next pins its reader to that save (``save_id=``), so a
#: re-save of the id between the two reads fails the load instead of mixing two saves.
_common_loaded: dict[tuple[str, str], str] = {}

#: How a strategy names the checkpoint of a ``checkpoint_dir``: None for the directory's base
#: name, a fixed id, or a function of the directory.
CheckpointIdSpec = str | Callable[[Path], str] | None


def checkpoint_id_for(
    checkpoint_dir: str | os.PathLike, checkpoint_id: CheckpointIdSpec = None
) -> str:
    """The kvckpt checkpoint id that holds the Megatron checkpoint of ``checkpoint_dir``.

    By default the directory's base name: Megatron-LM names checkpoints ``<save>/iter_0000100``,
    so each iteration gets its own id. Runs that share a store and reuse iteration names keep
    apart with a URL ``?prefix=`` of their own.
    """
    path = Path(os.path.abspath(os.fspath(checkpoint_dir)))
    if checkpoint_id is None:
        name = path.name
    elif callable(checkpoint_id):
        name = checkpoint_id(path)
    else:
        name = checkpoint_id
    try:
        return validate_name(name)
    except InvalidCheckpointIdError as e:
        raise InvalidCheckpointIdError(
            f"{e}. It names the Megatron checkpoint_dir {str(path)!r}: rename the directory, or "
            "give the kvckpt strategy checkpoint_id=... (an id, or a function of the directory)"
        ) from None


# -- save ----------------------------------------------------------------------------------


class KVSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Megatron's sharded save strategy for a kvckpt store: sharded tensors and sharded objects
    (and, with ``KVSaveCommonStrategy``, the common state) become one kvckpt checkpoint.

    It is ``TorchDistSaveShardedStrategy`` (the same translation of Megatron ``ShardedTensor``s
    to DCP, the same ``MCoreSavePlanner``) with ``KVStorageWriter`` as storage, and without
    CUDA: planning and the commit run over any process group, gloo included.

    Args:
        store: a store URL (``lmdb:///dev/shm/ckpt``, ``redis://host:6379/0?prefix=run7``) or
            an engine.
        checkpoint_id: how a ``checkpoint_dir`` names its checkpoint: None (default) for the
            directory's base name, a fixed id, or a function of the directory's ``Path``.
        keep_only_main_replica: save each replicated shard once (its main replica), as
            Megatron's own strategy does by default.
        writer_options: ``KVStorageWriter`` options (``keep_last``, ``ttl``, ``checksums``,
            ``overwrite``, ``lease``).
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: CheckpointIdSpec = None,
        keep_only_main_replica: bool = True,
        **writer_options: Any,
    ) -> None:
        super().__init__(BACKEND, VERSION, keep_only_main_replica=keep_only_main_replica)
        self.engine = open_store(store)
        self.checkpoint_id = checkpoint_id
        self.writer_options = writer_options
        KVStorageWriter(self.engine, **writer_options)  # a bad option fails here, not mid-save
        #: rank 0's serialized common state, per checkpoint id, until the sharded save takes it
        self._common: dict[str, bytes] = {}

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def stage_common(self, checkpoint_dir: str | os.PathLike, data: bytes) -> None:
        """Include ``data`` (a ``torch.save`` of the common state) in the next save of
        ``checkpoint_dir`` from this rank."""
        self._common[checkpoint_id_for(checkpoint_dir, self.checkpoint_id)] = data

    def forget_common(self, checkpoint_dir: str | os.PathLike) -> None:
        """Drop common state staged for ``checkpoint_dir`` and not saved (its save failed)."""
        self._common.pop(checkpoint_id_for(checkpoint_dir, self.checkpoint_id), None)

    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike
    ) -> AsyncRequest:
        """Plan the save (collective) and return the request that writes it and commits it.

        ``async_fn`` writes this rank's data and needs no process group, so it may run on a
        thread, in a forked process or in a persistent worker; ``preload_fn`` stages a copy of
        the data first. The finalize function (collective, on every rank) gathers every rank's
        results and commits the checkpoint: until then it does not exist for readers.
        """
        checkpoint_id = checkpoint_id_for(checkpoint_dir, self.checkpoint_id)
        state_dict = self._to_dcp(sharded_state_dict)
        common = self._common.pop(checkpoint_id, None)
        if common is not None:
            state_dict[COMMON_FQN] = io.BytesIO(common)
        writer = PlannedWriter(self.engine, checkpoint_id=checkpoint_id, **self.writer_options)
        (_, metadata, dist_wrapper), *_ = save_state_dict_async_plan(
            state_dict,
            writer,
            None,
            0,
            planner=MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
            ),
        )
        items, writer.resolved = writer.resolved, []
        job = WriteJob(writer)

        def commit(all_results: list[list[WriteResult]]) -> None:
            writer.finish(metadata, all_results)

        def finalize() -> None:
            # DCP's commit protocol: every rank's results (or error) to the coordinator, which
            # commits; the outcome, or every rank's error, is raised on all ranks.
            dist_wrapper.all_reduce("write", job.results, commit)

        return AsyncRequest(
            job,
            (dist.get_rank(), items, job.results_path),
            [finalize],
            preload_fn=partial(stage, items),
        )

    def get_ready(self, sharded_state_dict: ShardedStateDict) -> None:
        """Get the store ready for this job's saves of ``sharded_state_dict``, so that the first
        save is as fast as the later ones (``KVStorageWriter.get_ready``: LMDB's pages mapped
        in, Redis's spares made, on a background thread). Returns at once; no collectives.

        Call it on every rank once the state exists, after the first training step (the
        optimizer's state exists only then), with the sharded state dict a save would get
        (``model.sharded_state_dict()``, plus the optimizer's). The size is this rank's part
        of a save: its shards of the main replica, as ``async_save`` plans them."""
        state = self._to_dcp(sharded_state_dict)
        KVStorageWriter(self.engine, **self.writer_options).get_ready(state)

    def _to_dcp(self, sharded_state_dict: ShardedStateDict) -> dict[str, Any]:
        """The DCP state dict a save of ``sharded_state_dict`` plans: Megatron's translation,
        with only the main replicas where ``keep_only_main_replica``."""
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, self.keep_only_main_replica
        )
        state_dict: dict[str, Any] = mcore_to_pyt_state_dict(sharded, False)
        return state_dict

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> None:
        """A synchronous save writes the live tensors: no staged copy (``execute_sync``, what
        Megatron's base class would use, stages one first)."""
        request = self.async_save(sharded_state_dict, checkpoint_dir)
        request.async_fn(*request.async_fn_args)
        for finalize in request.finalize_fns:
            finalize()


class KVSaveCommonStrategy(SaveCommonStrategy):
    """Megatron's common-state save strategy for a kvckpt store: rank 0's common state (a
    ``torch.save`` of it) becomes an object item of the checkpoint that ``sharded`` saves next,
    committed with it. Megatron 0.16's ``save`` only takes it through :func:`save`."""

    def __init__(self, sharded: KVSaveShardedStrategy) -> None:
        super().__init__(BACKEND, VERSION)
        self.sharded = sharded

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str | os.PathLike) -> None:
        # Rank 0's copy, as Megatron's own strategy: save() checked it is the same everywhere.
        if dist.get_rank() == 0:
            buffer = io.BytesIO()
            torch.save(common_state_dict, buffer)
            self.sharded.stage_common(checkpoint_dir, buffer.getvalue())

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike
    ) -> None:
        raise CheckpointingException(
            "KVSaveShardedStrategy saves sharded objects itself, with the tensors: Megatron "
            "calls this only for a sharded strategy that cannot"
        )


_registry_lock = threading.Lock()


@contextlib.contextmanager
def _default_common_save_strategy(strategy: SaveCommonStrategy) -> Iterator[None]:
    """Megatron 0.16's ``save`` takes no ``common_strategy`` but the registry's default for
    ('torch', 1); this makes ``strategy`` that default for the duration of one save."""
    with _registry_lock:
        previous = get_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1)
        register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, strategy)
        try:
            yield
        finally:
            register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, previous)


def _record_common_backend(checkpoint_dir: str | os.PathLike) -> None:
    """Rewrite ``metadata.json`` to say the common state is kvckpt's: Megatron records its
    default (``torch``, i.e. ``common.pt``), and ``load`` picks strategies from this file."""
    if dist.get_rank() == 0:
        save_config(CheckpointingConfig(BACKEND, VERSION, BACKEND, VERSION), str(checkpoint_dir))
    dist.barrier()


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike,
    sharded_strategy: KVSaveShardedStrategy | tuple[str, int],
    common_strategy: KVSaveCommonStrategy | None = None,
    **kwargs: Any,
) -> AsyncRequest | None:
    """``megatron.core.dist_checkpointing.save`` with the common state in the store as well.

    Megatron 0.16's ``save`` refuses every ``common_strategy`` ("The only supported common
    strategy is torch") and writes the common state to ``common.pt`` in ``checkpoint_dir``. This
    runs that same ``save`` (same arguments) with ``common_strategy`` (default: one that puts the
    common state into ``sharded_strategy``'s checkpoint) as Megatron's default common strategy,
    then records the ``kvckpt`` common backend in ``metadata.json`` (async: after the commit).
    """
    if StrategyAction is None:  # pragma: no cover - megatron-core >= 0.19
        raise CheckpointingException(
            "this megatron-core has no strategy registry (removed in 0.19): its save() always "
            "writes the common state to common.pt. Call megatron.core.dist_checkpointing.save "
            "with sharded_strategy=KVSaveShardedStrategy(...) instead."
        )
    if isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if common_strategy is None:
        if not isinstance(sharded_strategy, KVSaveShardedStrategy):
            raise TypeError(
                "kvckpt.megatron.save needs a KVSaveShardedStrategy (or a KVSaveCommonStrategy "
                f"bound to one), not {type(sharded_strategy).__name__}"
            )
        common_strategy = KVSaveCommonStrategy(sharded_strategy)
    elif common_strategy.sharded is not sharded_strategy:
        # The common state would be staged on a strategy that is not saving: lost silently.
        raise TypeError(
            "kvckpt.megatron.save: common_strategy is bound to another KVSaveShardedStrategy "
            "than the sharded_strategy given; pass KVSaveCommonStrategy(sharded_strategy) or "
            "leave common_strategy out"
        )
    try:
        with _default_common_save_strategy(common_strategy):
            request = serialization.save(
                sharded_state_dict, str(checkpoint_dir), sharded_strategy, **kwargs
            )
    except BaseException:
        # A save that failed between the common and the sharded part must not leave its common
        # state for the next save of this directory to pick up.
        if isinstance(common_strategy, KVSaveCommonStrategy):
            with contextlib.suppress(KVCheckpointError):
                common_strategy.sharded.forget_common(checkpoint_dir)
        raise
    if request is None:
        _record_common_backend(checkpoint_dir)
    else:
        request.add_finalize_fn(partial(_record_common_backend, checkpoint_dir))
    return request


class BackgroundSave:
    """Runs a Megatron ``AsyncRequest`` on a thread of this process: the CPU equivalent of
    Megatron's ``AsyncCallsQueue`` (Megatron-LM's ``--async-save``), which calls
    ``torch.cuda.synchronize``. The data is staged (``preload_fn``) before this returns, so
    training may change the parameters at once."""

    def __init__(self, request: AsyncRequest) -> None:
        self.request = request
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(args,), name="kvckpt-megatron-save", daemon=True
        )
        self._thread.start()

    def _run(self, args: list[Any]) -> None:
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*args, **self.request.async_fn_kwargs)
        except BaseException as e:
            self._error = e

    def done(self) -> bool:
        """Whether this rank's write has finished (the checkpoint is committed by finalize)."""
        return not self._thread.is_alive()

    def finalize(self) -> None:
        """Wait for this rank's write, then commit. Every rank calls it: the commit (and
        Megatron's ``metadata.json``) is collective."""
        self._thread.join()
        for fn in self.request.finalize_fns:
            fn()
        if self._error is not None:
            raise self._error


# -- load ----------------------------------------------------------------------------------


class KVLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron's sharded load strategy for a kvckpt store: ``TorchDistLoadShardedStrategy``
    (Megatron's translation, ``MCoreLoadPlanner`` and its shape checks) with ``KVStorageReader``
    as storage. Loads reshard like any DCP load: any world size, any sharding.

    Args:
        store: a store URL or an engine.
        checkpoint_id: as for :class:`KVSaveShardedStrategy`.
        weights_only: load sharded objects under ``torch.load(weights_only=True)`` rules (the
            default). False only for a store whose every writer you trust.
        reader_options: ``KVStorageReader`` options (``verify``, ``batch_bytes``, ``lease``).
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: CheckpointIdSpec = None,
        weights_only: bool = True,
        **reader_options: Any,
    ) -> None:
        super().__init__()
        self.engine = open_store(store, create=False)
        self.checkpoint_id = checkpoint_id
        self.weights_only = weights_only
        self.reader_options = reader_options
        KVStorageReader(self.engine, **reader_options)  # a bad option fails here

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def reader(self, checkpoint_dir: str | os.PathLike) -> KVStorageReader:
        """The ``KVStorageReader`` of ``checkpoint_dir``'s checkpoint. A sharded object it
        refuses is reported with this strategy's opt-out, the one a Megatron user can pass."""
        reader = KVStorageReader(
            self.engine,
            checkpoint_id=checkpoint_id_for(checkpoint_dir, self.checkpoint_id),
            weights_only=self.weights_only,
            **self.reader_options,
        )
        reader.weights_only_opt_out = "KVLoadShardedStrategy(..., weights_only=False)"
        return reader

    def load(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike
    ) -> StateDict:
        # TorchDistLoadShardedStrategy.load with the reader swapped: its reader is hard-wired.
        reader = self.reader(checkpoint_dir)
        # Megatron loads the common state first: the tensors must come from that same save.
        reader.save_id = _common_loaded.pop((self.engine.url, reader._require_id()), None)
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        original = sharded_state_dict
        sharded, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        state_dict = mcore_to_pyt_state_dict(sharded, True)
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=[
                    t for t in tensors if not t.allow_shape_mismatch
                ],
                allow_shape_mismatch_sharded_tensors={
                    t.key: t for t in tensors if t.allow_shape_mismatch
                },
            ),
        )
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded

    def _metadata(self, checkpoint_dir: str | os.PathLike) -> Metadata:
        # One metadata value from the store; no data is read.
        return self.reader(checkpoint_dir).read_record().metadata

    def load_tensors_metadata(
        self, checkpoint_dir: str | os.PathLike, metadata: Metadata | None = None
    ) -> ShardedStateDict:
        """Global shape and dtype of every tensor, from the checkpoint's metadata alone."""
        if metadata is None:
            metadata = self._metadata(checkpoint_dir)
        return super().load_tensors_metadata(Path(checkpoint_dir), metadata)

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """Tensors and sharded objects of the checkpoint, from its metadata alone."""
        metadata = self._metadata(checkpoint_dir)
        found: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and key != COMMON_FQN:
                obj = ShardedObject.empty_from_unique_key(key)
                found[obj.unique_key] = obj
        found.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return found

    def remove_sharded_tensors(self, checkpoint_dir: str | os.PathLike, key_prefix: str) -> None:
        """Remove every tensor and sharded object whose key starts with ``key_prefix``
        (``kvckpt.remove_items``: the smaller metadata is committed before the removed items'
        data is deleted). Run it while nothing saves or loads this checkpoint."""
        checkpoint_id = checkpoint_id_for(checkpoint_dir, self.checkpoint_id)
        record = self.reader(checkpoint_dir).read_record()
        md = record.metadata
        removed = {
            k for k in md.state_dict_metadata if k.startswith(key_prefix) and k != COMMON_FQN
        }
        if not removed:
            warnings.warn(
                f"checkpoint {checkpoint_id!r} in {self.engine.url} has no keys starting with "
                f"{key_prefix!r}: nothing removed",
                stacklevel=2,
            )
            return
        remove_items(self.engine, checkpoint_id, removed)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"this checkpoint's tensors were saved with Megatron backend {loaded_backend!r}, "
                f"not {BACKEND!r}: they are not in {self.engine.url}. Load it with "
                "sharded_strategy=None (Megatron picks the strategy of its backend)."
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > VERSION:
            raise CheckpointingException(
                f"this checkpoint was saved by a newer kvckpt (Megatron backend {BACKEND!r} "
                f"version {loaded_version}; this kvckpt reads up to {VERSION}): upgrade kvckpt"
            )


class KVLoadCommonStrategy(LoadCommonStrategy):
    """Megatron's common-state load strategy for a kvckpt store: reads the common state that
    ``KVSaveCommonStrategy`` stored, under ``torch.load(weights_only=True)`` rules.

    Args:
        store: a store URL or an engine.
        checkpoint_id: as for :class:`KVSaveShardedStrategy`.
        weights_only: False lets the common state load objects that need arbitrary unpickling
            — only for a store whose every writer you trust. To allow a few known types
            instead, register them with ``torch.serialization.add_safe_globals`` (importing
            ``megatron.core`` already allows Megatron's own, ``argparse.Namespace`` included).
        lease: seconds of the read lease held while reading (see ``KVStorageReader``).
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: CheckpointIdSpec = None,
        weights_only: bool = True,
        lease: float = 60.0,
    ) -> None:
        self.engine = open_store(store, create=False)
        self.checkpoint_id = checkpoint_id
        self.weights_only = weights_only
        self.lease = lease

    def load_common(self, checkpoint_dir: str | os.PathLike) -> StateDict:
        checkpoint_id = checkpoint_id_for(checkpoint_dir, self.checkpoint_id)
        where = f"checkpoint {checkpoint_id!r} in {self.engine.url}"
        reader = KVStorageReader(self.engine, checkpoint_id=checkpoint_id)
        index = MetadataIndex(COMMON_FQN)
        with read_lease(self.engine, checkpoint_id, self.lease):
            record = reader.read_record()
            loc = record.locations.get(index)
            if loc is None:
                raise MetadataError(
                    f"{where} holds no Megatron common state: it was not saved with "
                    "kvckpt.megatron.save, so its common state is in common.pt in the checkpoint "
                    "directory. Load it with common_strategy=None."
                )
            data = bytearray(loc.nbytes)

            def copy(_: int, start: int, view: memoryview) -> None:
                data[start : start + view.nbytes] = view

            fetch_parts(self.engine, record, [(index, loc)], copy, verify=reader.verify)
        _common_loaded[(self.engine.url, checkpoint_id)] = record.save_id
        return load_object(
            data,
            weights_only=self.weights_only,
            what=f"the Megatron common state of {where}",
            opt_out="KVLoadCommonStrategy(..., weights_only=False)",
            map_location="cpu",
        )

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike
    ) -> StateDict:
        # Megatron calls this only with a sharded strategy that cannot load sharded objects;
        # they are in the same checkpoint as the tensors, and load the same way.
        return KVLoadShardedStrategy(
            self.engine, checkpoint_id=self.checkpoint_id, weights_only=self.weights_only
        ).load(sharded_objects_state_dict, checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"this checkpoint's common state was saved with Megatron backend "
                f"{loaded_backend!r} (common.pt in the checkpoint directory), not in "
                f"{self.engine.url}: load it with common_strategy=None"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > VERSION:
            raise CheckpointingException(
                f"this checkpoint's common state was saved by a newer kvckpt (version "
                f"{loaded_version}; this kvckpt reads up to {VERSION}): upgrade kvckpt"
            )


class _Unbound(LoadShardedStrategy, LoadCommonStrategy):
    """What Megatron finds for backend ``kvckpt`` before :func:`register` binds it to a store.

    Megatron resolves *both* load strategies from ``metadata.json`` even when the caller
    passes one (``load_tensors_metadata(dir, KVLoadShardedStrategy(url))`` resolves the common
    one too); with this registered that works, and a load that does need the missing strategy
    says how to provide it instead of "Cannot find a default strategy".
    """

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise CheckpointingException(
            "Megatron picked kvckpt's default strategy (backend 'kvckpt' in metadata.json), "
            "which is not bound to a store: call kvckpt.megatron.register(store_url) first, or "
            "pass sharded_strategy=KVLoadShardedStrategy(store_url) and "
            "common_strategy=KVLoadCommonStrategy(store_url)"
        )

    load = load_tensors_metadata = load_sharded_metadata = _fail
    load_common = load_sharded_objects = remove_sharded_tensors = _fail

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass


def register(store: str | Engine, *, weights_only: bool = True, **writer_options: Any) -> None:
    """Make kvckpt Megatron's default strategies for backend ``kvckpt``, version 1, all bound
    to ``store``.

    Then ``load(sharded_state_dict, checkpoint_dir)`` and ``load_tensors_metadata``,
    ``load_common_state_dict``, ``remove_sharded_tensors`` find the kvckpt strategies from the
    checkpoint's ``metadata.json`` alone, and ``save`` accepts ``sharded_strategy=("kvckpt", 1)``.
    """
    if StrategyAction is None:  # pragma: no cover - megatron-core >= 0.19
        raise CheckpointingException(
            "this megatron-core has no strategy registry (removed in 0.19): pass the kvckpt "
            "strategies to save and load explicitly"
        )
    sharded = KVSaveShardedStrategy(store, **writer_options)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, sharded)
    register_default_strategy(
        StrategyAction.SAVE_COMMON, BACKEND, VERSION, KVSaveCommonStrategy(sharded)
    )
    register_default_strategy(
        StrategyAction.LOAD_SHARDED,
        BACKEND,
        VERSION,
        KVLoadShardedStrategy(store, weights_only=weights_only),
    )
    register_default_strategy(
        StrategyAction.LOAD_COMMON,
        BACKEND,
        VERSION,
        KVLoadCommonStrategy(store, weights_only=weights_only),
    )


if StrategyAction is not None:
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, _Unbound())
    register_default_strategy(StrategyAction.LOAD_COMMON, BACKEND, VERSION, _Unbound())
