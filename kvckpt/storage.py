"""The DCP adapter: ``KVStorageWriter`` and ``KVStorageReader``.

This is the only module that knows DCP's storage API. It turns each write item into the key
schema of docs/FORMAT.md, hands tensor bytes to the engine without copying them, and on load
copies each stored value straight from the engine's buffer into the planner's destination
tensor (narrowing it when the load reshards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import io
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future as Future_
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from .catalog import (
    mark_pending,
    publish,
    read_index,
    read_lease,
    renew_lease,
    tidy_remote_store,
)
from .engines.base import Engine, byte_tensor
from .errors import (
    CheckpointNotFoundError,
    DataError,
    IntegrityError,
    InvalidCheckpointIdError,
    KVCheckpointError,
    MetadataError,
    StoreFullError,
    StoreUnavailableError,
    UnsafeObjectError,
)
from .format import (
    CheckpointRecord,
    ItemLocation,
    checksum,
    decode_metadata,
    gc_paused,
    index_name,
    meta_key,
    meta_prefix,
    new_checksum,
    parse_meta_key,
    part_ranges,
    spare_key,
)
from .manage import NEVER, discard_save, gc, spare_bytes
from .staging import accelerator_available, advise_huge_pages
from .stores import open_store
from .urls import validate_name

logger = logging.getLogger(__name__)

_DEFAULT_BATCH_BYTES = 256 << 20
_HOST_ALIGN = 64
#: Saves to an engine that does not hash as it sends (``hashes_while_writing``: Redis does)
#: hash values at least this large on a worker thread while the engine writes, smaller ones
#: inline. (Direct loads hash inside the engine's read, ``Engine.get_into``; staged ones,
#: ``fetch_parts``, after each value arrives.)
_ASYNC_HASH_BYTES = 1 << 20


def _with_checksums(result: WriteResult, checksums: tuple[int, ...]) -> WriteResult:
    """``result`` with its parts' checksums (built directly: ``dataclasses.replace`` costs ten
    times as much, and a save has 10,000s of items)."""
    loc = result.storage_data
    return WriteResult(
        index=result.index,
        size_in_bytes=result.size_in_bytes,
        storage_data=ItemLocation(
            rank=loc.rank,
            n=loc.n,
            nbytes=loc.nbytes,
            part_bytes=loc.part_bytes,
            checksums=checksums,
            name=loc.name,
        ),
    )


def _new_save_id() -> str:
    return uuid.uuid4().hex


def _checkpoint_id(value: str | os.PathLike | None) -> str | None:
    if value is None:
        return None
    return validate_name(os.fspath(value))


@dataclass(frozen=True)
class _PlanData:
    """``SavePlan.storage_data``: which save and rank a plan's keys belong to."""

    save_id: str
    rank: int
    session: str | None = None  # the store's session id when the save started
    replicas: tuple[int, ...] = ()  # tiers (``kvckpt.Tiers``) this save is copied to
    #: a node-local engine: the coordinator's store (``_store_identity``) and the saves it
    #: keeps, so that ranks writing to another node's store can trim it (``tidy_remote_store``)
    origin: str | None = None
    live: tuple[tuple[str, str], ...] = ()


def _store_identity(engine: Engine) -> str | None:
    """Which physical store a node-local engine is (None for a shared one): two ranks whose
    identities differ write to different stores."""
    if engine.shared:
        return None
    return f"{socket.gethostname()}|{engine.url}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a tensor's contiguous projection, without a copy when it is contiguous.

    A view is taken as the elements it shows (never its whole backing storage); a tensor on
    another device is copied to the CPU, as DCP's own writers do.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # numpy keeps the tensor alive for as long as the memoryview exists.
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _planned_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0
    return item.tensor_storage_size() or 0


class _KVStorageBase:
    engine: Engine
    checkpoint_id: str | None

    def _require_id(self) -> str:
        if self.checkpoint_id is None:
            raise InvalidCheckpointIdError(
                f"no checkpoint id for {self.engine.url}: pass checkpoint_id=... to dcp.save / "
                f"dcp.load or to {type(self).__name__}(...)"
            )
        return self.checkpoint_id

    def close(self) -> None:
        """Release the store's connections (it reopens on next use)."""
        self.engine.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _checkpoint_id(checkpoint_id)
        except InvalidCheckpointIdError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.url!r}, checkpoint_id={self.checkpoint_id!r})"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class KVStorageWriter(_KVStorageBase, StorageWriter, BlockingAsyncStager):
    """DCP ``StorageWriter`` that saves into a key-value store.

    Args:
        store: a store URL (``lmdb:///dev/shm/ckpt``, ``redis://host:6379/0``, ...) or an engine.
        checkpoint_id: the checkpoint's name, used when ``dcp.save`` gets no ``checkpoint_id``.
        overwrite: if False, saving over an existing checkpoint id raises instead of replacing
            it. Replacing is atomic either way: readers see the old or the new checkpoint.
        keep_last: after each successful commit, delete complete checkpoints of the namespace
            beyond the newest ``keep_last`` (never the one just written).
        ttl: seconds (or a timedelta) after which the whole checkpoint expires by itself —
            metadata first, data a little later, so no reader sees a half-expired checkpoint.
            Redis only.
        checksums: record an xxh3 checksum of every value, which loads and ``kvckpt verify``
            check. Default: the engine's choice (on for Redis, off for LMDB, where hashing
            would cost more than half the load time; see docs/RELIABILITY.md).
        lease: seconds a save holds the checkpoint id's write lease without renewing it (it is
            renewed while data is written). A second writer of the same id fails fast while the
            lease is held; a crashed writer's lease lapses after this long.
        cache_staged_state_dict: reuse one staging copy across ``dcp.async_save`` calls (as
            DCP's ``FileSystemWriter``), kept in host memory between saves; keep the writer
            across saves (``writer.reset(new_id)`` before each). The copy is pinned where an
            accelerator is, and plain memory on a CPU-only host (where DCP's own fails).
        huge_pages: ask the kernel for transparent huge pages on ``dcp.async_save``'s staging
            copy (Linux; off by default). The median save blocks up to 2.5x less (fewer page
            faults), but saves stall now and then while the kernel compacts memory into huge
            pages (up to 2.2 s instead of 0.5 s for 1 GiB on the development VM, most with an
            LMDB store on /dev/shm), which can cost more in all than it saves.
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        overwrite: bool = True,
        keep_last: int | None = None,
        ttl: float | datetime.timedelta | None = None,
        checksums: bool | None = None,
        lease: float = 60.0,
        cache_staged_state_dict: bool = False,
        huge_pages: bool = False,
    ) -> None:
        super().__init__()
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.huge_pages = huge_pages
        self.engine = open_store(store)
        self.checkpoint_id = _checkpoint_id(checkpoint_id)
        self.overwrite = overwrite
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"keep_last must be at least 1 (it never deletes the checkpoint "
                f"just written), not {keep_last}"
            )
        self.keep_last = keep_last
        if isinstance(ttl, datetime.timedelta):
            ttl = ttl.total_seconds()
        if ttl is not None:
            if ttl <= 0:
                raise ValueError(f"ttl must be positive, not {ttl}")
            if not getattr(self.engine, "supports_ttl", False):
                raise ValueError(
                    f"ttl= needs an engine whose keys can expire (Redis); {self.engine.url} "
                    "cannot. Use keep_last= or kvckpt gc to bound what is kept instead."
                )
        self.ttl = ttl
        if lease <= 0:
            raise ValueError(f"lease must be positive seconds, not {lease}")
        self.lease = lease
        self.checksums = (
            bool(getattr(self.engine, "checksums_by_default", False))
            if checksums is None
            else checksums
        )
        self.save_id = _new_save_id()
        self.rank: int | None = None
        self.use_collectives = True
        #: largest value per key; ``Tiers`` sets the smallest of its stores' so that every
        #: tier holds byte-identical keys and one metadata value fits them all
        self.part_bytes = int(self.engine.max_value_bytes)
        self.committed_at: float | None = None

    # -- DCP StorageWriter -------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s blocking copy: DCP's own, into buffers that ask for huge pages
        (kvckpt/staging.py says why) when ``huge_pages`` is set. With
        ``cache_staged_state_dict``, into one copy kept across saves, as DCP does, except that
        the copy is pinned only where an accelerator can use pinned memory: DCP pins it
        unconditionally, which fails on a host without one."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.cache_staged_state_dict:
            if self.state_dict_cache is None:
                pin = accelerator_available()
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=pin)
                if not pin and self.huge_pages:
                    advise_huge_pages(self.state_dict_cache)
            return _copy_state_dict(state_dict, self.state_dict_cache, type_check=self.type_check)
        if not self.huge_pages:
            return BlockingAsyncStager.stage(self, state_dict)
        staged = _create_cpu_state_dict(state_dict)
        advise_huge_pages(staged)
        _copy_state_dict(state_dict, staged, type_check=self.type_check)
        return staged

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = _checkpoint_id(checkpoint_id)
        self.save_id = _new_save_id()

    def get_ready(self, state_dict: dict[str, Any]) -> None:
        """Get the store ready for this job's saves of ``state_dict`` now, at the start of the
        job, so that the first save is as fast as the later ones. Returns at once.

        Every save after the first writes into memory the store made ready while training ran
        (``Engine.get_ready``); the first save of a new store would otherwise allocate all of
        its memory on the job's path (on a VM that hands out new pages slowly, 2.5 GB/s where
        later saves run at 15). Called once the state dict exists (after building the model and
        optimizer), this does that work in the background during the steps before the first
        checkpoint: LMDB sizes its map for the ``keep_last + 1`` saves it will hold and
        allocates their pages on a background thread; other engines do nothing.

        The size is this rank's share of a save, estimated without collectives: its local
        shards of sharded tensors, and its part of the replicated tensors, which DCP spreads
        evenly over the ranks that save them (a DTensor replicated over some mesh dimensions,
        as under HSDP, counts once per replica). Pass plain state dicts: a ``Stateful`` object
        (DCP's ``AppState`` pattern) counts for nothing here; pass its ``state_dict()``.
        """
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        shards = replicated = 0
        for value in _tensors(state_dict):
            if isinstance(value, DTensor):
                # DCP keeps one copy of each chunk: replicas of a shard share its offsets.
                replicas = 1
                for dim, placement in enumerate(value.placements):
                    if not placement.is_shard():
                        replicas *= value.device_mesh.size(dim)
                shards += -(-value.to_local().nbytes // replicas)
            elif isinstance(value, ShardedTensor):
                shards += sum(s.tensor.nbytes for s in value.local_shards())
            else:
                replicated += value.nbytes
        copies = None if self.keep_last is None else self.keep_last + 1
        self.engine.get_ready(shards + -(-replicated // world), copies)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def _local_rank_key(self) -> int | None:
        return None if self.use_collectives else (self.rank or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        checkpoint_id = self._require_id()
        if not self.overwrite:
            key = meta_key(self.engine.prefix, checkpoint_id, self._local_rank_key())
            if self.engine.get(key) is not None:
                raise KVCheckpointError(
                    f"checkpoint {checkpoint_id!r} already exists in {self.engine.url} and "
                    "overwrite=False: choose a new checkpoint id, delete the old one, or pass "
                    "overwrite=True"
                )
        if not self.use_collectives:
            mark_pending(self.engine, checkpoint_id, self.save_id, self.rank or 0, self.lease)
            plan = dataclasses.replace(
                plan, storage_data=_PlanData(self.save_id, self.rank or 0, self._session_id())
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        session = None
        origin, live = None, ()
        if self.use_collectives:
            # Registered before any rank writes data, so gc never mistakes it for garbage.
            mark_pending(self.engine, self._require_id(), self.save_id, None, self.lease)
            session = self._session_id()
            origin = _store_identity(self.engine)
            if origin is not None and len(plans) > 1:
                live = tuple(sorted(read_index(self.engine).live_saves()))
        return [
            plan
            if isinstance(plan.storage_data, _PlanData)
            else dataclasses.replace(
                plan,
                storage_data=_PlanData(self.save_id, rank, session, origin=origin, live=live),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        checkpoint_id = self._require_id()
        where: _PlanData = plan.storage_data
        self.save_id = where.save_id
        if where.origin is not None and _store_identity(self.engine) != where.origin:
            # This rank's node-local store is not the coordinator's: it holds no metadata, so
            # its own bookkeeping is what lets retention reach it (and gc leave it alone).
            tidy_remote_store(
                self.engine,
                origin=where.origin,
                live=set(where.live),
                checkpoint_id=checkpoint_id,
                save_id=where.save_id,
                rank=where.rank,
            )
        part_bytes = self.part_bytes
        prefix = self.engine.prefix
        results: list[WriteResult] = []
        lease_rank = None if self.use_collectives else where.rank
        renewed = time.monotonic()

        def values() -> Iterator[tuple[str, memoryview]]:
            # Lazy: each item is resolved (and, for GPU tensors, copied to the CPU) only when
            # the engine is ready to send it, so at most one batch is held at a time.
            nonlocal renewed
            for n, item in enumerate(plan.items):
                if time.monotonic() - renewed > self.lease / 3:
                    renew_lease(self.engine, checkpoint_id, where.save_id, lease_rank, self.lease)
                    renewed = time.monotonic()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                else:
                    view = tensor_bytes(data)
                loc = ItemLocation(
                    where.rank, n, view.nbytes, part_bytes, name=index_name(item.index)
                )
                if hash_pool is not None:
                    # Large parts are hashed on another core while the engine sends (xxhash
                    # releases the GIL); small ones inline, where a hand-off costs more.
                    hashes.append(
                        [
                            hash_pool.submit(checksum, view[a:b])
                            if b - a >= _ASYNC_HASH_BYTES
                            else checksum(view[a:b])
                            for a, b in part_ranges(view.nbytes, part_bytes)
                        ]
                    )
                results.append(
                    WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=loc)
                )
                yield from loc.split(view, prefix, checkpoint_id, where.save_id)

        self._session = where.session
        preflight = getattr(self.engine, "preflight", None)
        hashes: list[list[Future_[int] | int]] = []
        # An engine that hashes each value as it sends it does so cache-hot, in one pass over
        # memory; otherwise large values are hashed on a worker thread meanwhile.
        hash_in_engine = self.checksums and getattr(self.engine, "hashes_while_writing", False)
        digests: dict[int, int | None] = {}
        hash_pool = ThreadPoolExecutor(1) if self.checksums and not hash_in_engine else None
        try:
            if preflight is not None:
                planned = sum(_planned_bytes(item) for item in plan.items)
                try:
                    preflight(planned)
                except StoreFullError:
                    if not self.engine.reuses_values:
                        raise
                    # The spares retention kept are memory this save writes over, not adds to.
                    preflight(max(0, planned - spare_bytes(self.engine)))
            # Where the engine keeps retired values as spares, each value is written over the
            # spare of the value at its place in an earlier save (same rank, item and part).
            reuse = (
                {"spare_of": functools.partial(spare_key, prefix)}
                if self.engine.reuses_values
                else {}
            )
            with gc_paused():
                if hash_in_engine:
                    self.engine.put_many(
                        values(), on_value=digests.__setitem__, hasher=new_checksum, **reuse
                    )
                else:
                    self.engine.put_many(values(), **reuse)
            self.engine.sync_replicas()
            self.engine.get_ready(
                sum(wr.size_in_bytes for wr in results),
                None if self.keep_last is None else self.keep_last + 1,
            )
            if hash_in_engine:
                results[:] = self._engine_checksums(results, digests)
            elif hash_pool is not None:
                results[:] = [
                    _with_checksums(wr, tuple(f if isinstance(f, int) else f.result() for f in fs))
                    for wr, fs in zip(results, hashes, strict=True)
                ]
        except BaseException:
            self._discard_failed(checkpoint_id, where, lease_rank)
            raise
        finally:
            if hash_pool is not None:
                hash_pool.shutdown(wait=True)
        self._check_session(checkpoint_id)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _engine_checksums(
        self, results: list[WriteResult], digests: dict[int, int | None]
    ) -> list[WriteResult]:
        """``results`` with the checksums the engine reported for their parts, numbered in the
        order they were handed to it."""
        out, i = [], 0
        for wr in results:
            loc: ItemLocation = wr.storage_data
            count = len(part_ranges(loc.nbytes, loc.part_bytes))
            sums = tuple(digests.get(j) for j in range(i, i + count))
            if None in sums:
                raise RuntimeError(
                    f"{self.engine.url}: the engine says it hashes values while writing "
                    f"(hashes_while_writing) but reported no checksum for a part of "
                    f"{wr.index.fqn!r}; fix the engine or save with checksums=False"
                )
            out.append(_with_checksums(wr, sums))  # type: ignore[arg-type]
            i += count
        return out

    def _session_id(self) -> str | None:
        get = getattr(self.engine, "session_id", None)
        return None if get is None else get()

    def _check_session(self, checkpoint_id: str) -> None:
        """Fail the save if the store lost its memory (restarted) since the save began: data
        written before the restart is gone and must never be committed."""
        if getattr(self, "_session", None) is not None and self._session_id() != self._session:
            raise StoreUnavailableError(
                f"{self.engine.url} restarted or failed over while checkpoint "
                f"{checkpoint_id!r} was being saved: what was written before may be gone, so "
                "the checkpoint was not committed. Save it again."
            )

    def _discard_failed(self, checkpoint_id: str, where: _PlanData, rank: int | None) -> None:
        """Best effort: a save whose write failed will never commit (DCP fails the whole save
        when any rank's write fails), so it leaves nothing behind. In the store that registered
        it (the coordinator's; this rank's own for a rank-local save) the save is discarded as
        a whole, pending entry and write lease included, so it is not listed as incomplete
        until the next ``gc``; in another node's store, this rank's data goes. Data other ranks
        still write afterwards is an orphan that ``gc`` removes."""
        from .format import data_prefix

        registered = where.origin is None or where.origin == _store_identity(self.engine)
        try:
            if registered:
                discard_save(self.engine, checkpoint_id, where.save_id, rank)
            else:
                self.engine.delete_prefix(
                    f"{data_prefix(self.engine.prefix, checkpoint_id, where.save_id)}{where.rank}/"
                )
        except Exception:  # the store may be what failed
            logger.warning(
                "could not clean up the failed save of %r in %s (`kvckpt gc` will)",
                checkpoint_id,
                self.engine.url,
            )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        checkpoint_id = self._require_id()
        locations: dict[MetadataIndex, ItemLocation] = {
            wr.index: wr.storage_data for rank_results in results for wr in rank_results
        }
        rank = self._local_rank_key()
        world_size = self._world_size(results)
        metadata.storage_meta = self.storage_meta()
        self._check_session(checkpoint_id)
        self.committed_at = publish(
            self.engine,
            metadata,
            locations,
            checkpoint_id=checkpoint_id,
            save_id=self.save_id,
            world_size=world_size,
            rank=rank,
            ttl=self.ttl,
        )
        try:
            self.engine.sync_replicas()
        except StoreUnavailableError as e:
            raise StoreUnavailableError(
                f"checkpoint {checkpoint_id!r} is committed on {self.engine.url} but not yet "
                f"on its replicas: {e}"
            ) from None
        if self.keep_last is not None:
            gc(
                self.engine,
                keep_last=self.keep_last,
                protect=self._protected(checkpoint_id),
                incomplete_older_than=NEVER,
                scan_orphans=False,
                reuse=True,
            )

    def _world_size(self, results: list[list[WriteResult]]) -> int:
        """The world size of this save: the ranks whose results DCP gathered, not the process
        group's size (``dcp.save(..., no_dist=True)`` in a group saves from one rank alone).
        A rank-local save gets only its own results; it records the job's world size, which
        tells when every rank has committed."""
        if not self.use_collectives and dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return max(len(results), 1)

    def _protected(self, checkpoint_id: str) -> list[str]:
        """The checkpoint ids ``keep_last`` must not delete after this save's commit."""
        return [checkpoint_id]


class KVStorageReader(_KVStorageBase, StorageReader):
    """DCP ``StorageReader`` that loads from a key-value store.

    Args:
        store: a store URL or an engine. A reader never creates a store: an LMDB path with no
            store there is a ``StoreNotFoundError``.
        checkpoint_id: the checkpoint to load when ``dcp.load`` gets no ``checkpoint_id``.
        weights_only: load non-tensor objects under ``torch.load(weights_only=True)`` rules
            (the default), so a store that others can write to cannot run code in this
            process. Pass False only for a store you trust with objects that need it.
        verify: check each value against the checksum recorded at save (when the save recorded
            them). Default: the engine's choice (on for Redis, off for LMDB).
        batch_bytes: how many bytes to request from the engine per batch (bounds memory).
        save_id: load only this save of the checkpoint id (``read_record().save_id``) and fail
            clearly if the id was re-saved since: for loads made of several reads that must
            all see one save.
        lease: seconds a load holds its read lease on the checkpoint id without renewing it
            (it renews between batches). While one is held, retention (``keep_last``, ``gc``,
            ``delete_checkpoint``) and re-saves of the id remove the metadata at once but leave
            the data in place until the load is done; a reader that crashed holds it no longer
            than this.
    """

    def __init__(
        self,
        store: str | Engine,
        *,
        checkpoint_id: str | os.PathLike | None = None,
        weights_only: bool = True,
        verify: bool | None = None,
        batch_bytes: int = _DEFAULT_BATCH_BYTES,
        lease: float = 60.0,
        save_id: str | None = None,
    ) -> None:
        super().__init__()
        self.engine = open_store(store, create=False)
        self.checkpoint_id = _checkpoint_id(checkpoint_id)
        self.save_id = save_id
        self.weights_only = weights_only
        self.verify = (
            bool(getattr(self.engine, "checksums_by_default", False)) if verify is None else verify
        )
        self.batch_bytes = batch_bytes
        self._host: torch.Tensor | None = None  # host staging for GPU-bound reads
        self.lease = lease
        self.load_id = _new_save_id()
        self._record: CheckpointRecord | None = None
        self._lease: contextlib.AbstractContextManager[Callable[[], None]] | None = None
        self._renew_lease: Callable[[], None] | None = None
        self._global_error: Exception | None = None  # see _report_unreadable
        #: how a refused object's error tells the user to opt out: an API built on this reader
        #: (``KVLoadShardedStrategy``) names its own parameter
        self.weights_only_opt_out = "KVStorageReader(..., weights_only=False)"

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = _checkpoint_id(checkpoint_id)
        self.load_id = _new_save_id()
        self._record = None
        self._global_error = None
        self._release_lease()

    def read_record(self, rank: int | None = None) -> CheckpointRecord:
        """The checkpoint's decoded metadata (kvckpt's fields and DCP's ``Metadata``)."""
        checkpoint_id = self._require_id()
        raw = self.engine.get(meta_key(self.engine.prefix, checkpoint_id, rank))
        if raw is None:
            raise CheckpointNotFoundError(self._not_found(checkpoint_id, rank))
        where = f"checkpoint {checkpoint_id!r} in {self.engine.url}"
        record = decode_metadata(raw, where=where)
        if record.checkpoint_id != checkpoint_id:
            raise MetadataError(
                f"metadata stored for {where} names checkpoint {record.checkpoint_id!r}: the "
                "value was copied or overwritten under the wrong key"
            )
        if self.save_id is not None and record.save_id != self.save_id:
            raise KVCheckpointError(
                f"{where} was re-saved: it now holds save {record.save_id}, not save "
                f"{self.save_id} that this load was pinned to (save_id=). Nothing was loaded; "
                "load again."
            )
        return record

    def _not_found(self, checkpoint_id: str, rank: int | None) -> str:
        found: set[str] = set()
        for key in self.engine.scan(meta_prefix(self.engine.prefix)):
            parsed = parse_meta_key(self.engine.prefix, key)
            if parsed is not None:
                found.add(parsed[0])
        what = f"checkpoint {checkpoint_id!r}" + ("" if rank is None else f" (rank {rank})")
        if not found:
            return f"{what} not found in {self.engine.url}: the store has no checkpoints"
        names = sorted(found)
        shown = ", ".join(repr(n) for n in names[:50])
        more = f" and {len(names) - 50} more" if len(names) > 50 else ""
        return f"{what} not found in {self.engine.url}; checkpoints there: {shown}{more}"

    # -- DCP StorageReader --------------------------------------------------------------------

    def _take_lease(self) -> None:
        self._release_lease()
        lease = read_lease(self.engine, self._require_id(), self.lease)
        self._renew_lease = lease.__enter__()
        self._lease = lease

    def _release_lease(self) -> None:
        lease, self._lease, self._renew_lease = self._lease, None, None
        if lease is not None:
            lease.__exit__(None, None, None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # The lease comes first: whatever save the metadata then names keeps its data until
        # this load is done, even if retention or a re-save retires it meanwhile.
        self._take_lease()
        rank = kwargs.get("rank")
        try:
            self._record = self.read_record(rank)
        except Exception as e:
            self._release_lease()
            self._report_unreadable(e, rank)
            raise
        except BaseException:
            self._release_lease()
            raise
        metadata = self._record.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _report_unreadable(self, error: Exception, rank: int | None) -> None:
        """Log why a checkpoint cannot be loaded, once DCP has tried both of its ways.

        DCP calls ``read_metadata()`` and, when that fails, ``read_metadata(rank=r)`` for a
        rank-local checkpoint. torch before 2.13 swallows both errors and raises a bare
        "metadata is None", so this log line is then the only place the user learns why. The
        global read's error is the one that explains a missing or unreadable checkpoint; a
        failure of the global read alone is not logged, since a rank-local checkpoint then loads.
        """
        if rank is None:
            self._global_error = error
            return
        cause = self._global_error or error
        logger.warning("kvckpt cannot load from %s: %s", self.engine.url, cause)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._record is None or self._record.metadata is not metadata:
            raise KVCheckpointError("set_up_storage_reader got metadata this reader did not read")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Each rank reads the metadata itself; a re-save of the id committed between two
        # ranks' reads would have them load different saves. The coordinator compares.
        # (Rank-local checkpoints hold one save per rank by design.)
        if self._record is None or self._record.rank is not None:
            return plan
        return dataclasses.replace(plan, storage_data=self._record.save_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        found = sorted({p.storage_data for p in plans if isinstance(p.storage_data, str)})
        if len(found) > 1:
            raise KVCheckpointError(
                f"checkpoint {self.checkpoint_id!r} in {self.engine.url} was re-saved while "
                f"this load started: the ranks found different saves ({', '.join(found)}), "
                "and loading them would mix two checkpoints. Nothing was loaded; load again."
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        record = self._record
        if record is None:
            raise KVCheckpointError("read_data called before read_metadata")
        try:
            with gc_paused():
                self._read_all(record, plan, planner)
        finally:
            self._host = None
            self._release_lease()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_all(self, record: CheckpointRecord, plan: LoadPlan, planner: LoadPlanner) -> None:
        groups: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            groups.setdefault(req.storage_index, []).append(req)
        batch: list[_ItemRead] = []
        size = 0
        for index, reqs in groups.items():
            loc = record.locations.get(index)
            if loc is None:
                raise DataError(
                    f"checkpoint {record.checkpoint_id!r} in {self.engine.url} has no item "
                    f"{index.fqn!r} at offset {list(index.offset or [])}"
                )
            batch.append(_ItemRead(self, record, index, loc, reqs, planner))
            size += loc.nbytes
            if size >= self.batch_bytes:
                self._read_batch(batch)
                batch, size = [], 0
                if self._renew_lease is not None:
                    self._renew_lease()
        if batch:
            self._read_batch(batch)

    def _host_buffer(self, items: list[_ItemRead]) -> None:
        """Give each GPU-bound direct read a slice of one host buffer, reused across batches
        (pinned where the GPU is CUDA, so the copy to the device runs at full speed)."""
        offsets, size = [], 0
        for item in items:
            offsets.append(size)
            size += -(-item.loc.nbytes // _HOST_ALIGN) * _HOST_ALIGN  # aligned for any dtype
        host = self._host
        if host is None or host.numel() < size:
            self._host = host = None  # free the old one first
            pin = torch.cuda.is_available() and any(item.target.is_cuda for item in items)
            try:
                host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:  # pinned memory is limited; pageable memory still works
                host = torch.empty(size, dtype=torch.uint8)
            self._host = host
        for item, start in zip(items, offsets, strict=True):
            item.host = host[start : start + item.loc.nbytes]
            item.dest = (
                memoryview(item.host.numpy()) if item.loc.nbytes else memoryview(bytearray())
            )

    def _read_batch(self, batch: list[_ItemRead]) -> None:
        record = self._record
        assert record is not None
        via_host = [item for item in batch if item.via_host]
        if via_host:
            self._host_buffer(via_host)
        direct = [item for item in batch if item.dest is not None]
        staged = [item for item in batch if item.dest is None]
        if direct:
            # Values go from the engine straight into the destination tensors' memory.
            keys: list[str] = []
            buffers: list[memoryview] = []
            sums: list[int | None] = []
            for item in direct:
                assert item.dest is not None
                item_keys = item.loc.keys(self.engine.prefix, record.checkpoint_id, record.save_id)
                for p, (key, (start, stop)) in enumerate(zip(item_keys, item.ranges, strict=True)):
                    keys.append(key)
                    buffers.append(item.dest[start:stop])
                    sums.append(item.loc.checksums[p] if item.loc.checksums else None)
            verifying = self.verify and any(x is not None for x in sums)
            digests: dict[int, int | None] = {}
            if verifying:
                # The engine hashes each value as it lands (Engine.get_into says why).
                sizes = self.engine.get_into(
                    keys, buffers, on_value=digests.__setitem__, hasher=new_checksum
                )
            else:
                sizes = self.engine.get_into(keys, buffers)
            for i, (key, buffer, size) in enumerate(zip(keys, buffers, sizes, strict=True)):
                if size != buffer.nbytes:
                    raise damaged(
                        self.engine, record, key, key_fqn(direct, key), size, buffer.nbytes
                    )
                if verifying and sums[i] is not None:
                    digest = digests.get(i)
                    if digest is None:  # an engine that does not hash while reading
                        digest = checksum(buffer)
                    if digest != sums[i]:
                        raise corrupted(self.engine, record, key, key_fqn(direct, key))
            for item in direct:
                item.commit()
        if staged:
            fetch_parts(
                self.engine,
                record,
                [(item.index, item.loc) for item in staged],
                lambda i, start, view: staged[i].add_part(start, view),
                verify=self.verify,
            )


#: Plain types that torch's ``weights_only`` rules refuse although rebuilding one runs no code
#: (each is made from bytes, numbers or other already-checked values), and that DCP users keep
#: in state dicts: ``io.BytesIO`` holds opaque blobs in PyTorch's own DCP tests and torchtitan's
#: older ``TrainState``; ``frozenset`` and ``datetime`` values turn up in training state. Not
#: ``collections.deque`` (the restricted unpickler cannot rebuild it) nor ``defaultdict`` (it
#: keeps a callable that later runs on a missing key).
SAFE_OBJECT_TYPES: tuple[type, ...] = (
    io.BytesIO,
    frozenset,
    datetime.date,
    datetime.datetime,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
)
_safe_types_lock = threading.Lock()


@contextlib.contextmanager
def plain_types_allowed() -> Iterator[None]:
    """torch's ``weights_only`` allowlist plus ``SAFE_OBJECT_TYPES`` while the block runs.

    torch's allowlist is process-wide, so the block holds a lock, and adds (and afterwards
    removes) only the types the user has not registered with ``add_safe_globals`` already."""
    with _safe_types_lock:
        present = set(torch.serialization.get_safe_globals())
        with torch.serialization.safe_globals([t for t in SAFE_OBJECT_TYPES if t not in present]):
            yield


def refusal(e: Exception) -> str:
    """The sentence of torch's long ``weights_only`` error that names what was refused (the
    type or function), in full; any other error's whole message, on one line."""
    text = str(e)
    found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|$)", text, re.M) or re.search(
        r"^\s*(Trying to load unsupported .*?)\.?\s*$", text, re.M
    )
    return found.group(1).strip() if found else f"{type(e).__name__}: {' '.join(text.split())}"


def check_weights_only(data: bytes, what: str, opt_out: str) -> None:
    """Refuse an object value that ``torch.load(weights_only=True)`` would not load (with
    ``SAFE_OBJECT_TYPES`` allowed): DCP's planners unpickle object items without restriction,
    so this check comes first. The error names ``what`` was refused, the refused type, and
    ``opt_out``, the way out that fits the API in use."""
    try:
        with plain_types_allowed():
            torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise UnsafeObjectError(
            f"{what} cannot be loaded under torch.load(weights_only=True) rules: {refusal(e)}. "
            "Allow the types you expect with torch.serialization.add_safe_globals([...]), or, "
            f"if you trust everyone who can write there, pass {opt_out}."
        ) from None


def key_fqn(items: list[_ItemRead], key: str) -> str:
    """The fqn a data key belongs to (for error messages only)."""
    rank, name = key.split("/")[-3:-1]
    for item in items:
        loc = item.loc
        if (str(loc.rank), str(loc.n) if loc.name is None else loc.name) == (rank, name):
            return item.index.fqn
    return "?"


def damaged(
    engine: Engine, record: CheckpointRecord, key: str, fqn: str, got: int | None, want: int
) -> DataError:
    problem = (
        "is missing (deleted, evicted or expired)"
        if got is None
        else f"holds {got} bytes, expected {want}"
    )
    return DataError(
        f"checkpoint {record.checkpoint_id!r} in {engine.url} is damaged: key "
        f"{key!r} of {fqn!r} {problem}"
    )


def corrupted(engine: Engine, record: CheckpointRecord, key: str, fqn: str) -> IntegrityError:
    return IntegrityError(
        f"checkpoint {record.checkpoint_id!r} in {engine.url} is corrupted: key {key!r} of "
        f"{fqn!r} does not match the checksum recorded when it was saved"
    )


def fetch_parts(
    engine: Engine,
    record: CheckpointRecord,
    items: Sequence[tuple[MetadataIndex, ItemLocation]],
    on_part: Callable[[int, int, memoryview], None],
    *,
    verify: bool = False,
) -> None:
    """Fetch every part of ``items`` in one engine batch, checking each exists with the size
    the metadata promises; ``on_part(item position, byte offset, view)`` gets each part (the
    view is valid only during the call)."""
    keys: list[str] = []
    slots: list[tuple[int, int, int, int | None]] = []
    for i, (_, loc) in enumerate(items):
        item_keys = loc.keys(engine.prefix, record.checkpoint_id, record.save_id)
        ranges = part_ranges(loc.nbytes, loc.part_bytes)
        for p, (key, (start, stop)) in enumerate(zip(item_keys, ranges, strict=True)):
            keys.append(key)
            slots.append((i, start, stop, loc.checksums[p] if loc.checksums else None))

    def consume(k: int, view: memoryview | None) -> None:
        i, start, stop, expected = slots[k]
        if view is None or view.nbytes != stop - start:
            raise damaged(
                engine,
                record,
                keys[k],
                items[i][0].fqn,
                None if view is None else view.nbytes,
                stop - start,
            )
        if verify and expected is not None and checksum(view) != expected:
            raise corrupted(engine, record, keys[k], items[i][0].fqn)
        on_part(i, start, view)

    engine.get_many(keys, consume)


class _ItemRead:
    """One stored item and the read requests it serves.

    When one request wants the whole stored chunk and its destination is a contiguous CPU
    tensor of the same dtype (a load without resharding), ``dest`` is that tensor's memory and
    the engine reads the value straight into it. Otherwise the value is staged (zero-copy from
    LMDB's map where possible) and narrowed into each destination.
    """

    def __init__(
        self,
        reader: KVStorageReader,
        record: CheckpointRecord,
        index: MetadataIndex,
        loc: ItemLocation,
        reqs: list[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        self.reader, self.record, self.index, self.loc = reader, record, index, loc
        self.reqs, self.planner = reqs, planner
        self.ranges = part_ranges(loc.nbytes, loc.part_bytes)
        self.remaining = len(self.ranges)
        self.buffer: torch.Tensor | None = None  # assembly of a multi-part staged item
        self.dest: memoryview | None = None
        #: a direct read bound for another device (a GPU) lands here first (``_read_batch``)
        self.via_host = False
        self.host: torch.Tensor | None = None
        if index.offset is not None and len(reqs) == 1:
            self._try_direct()

    def _try_direct(self) -> None:
        req = self.reqs[0]
        dtype, sizes = self.record.chunk(self.index)
        if any(req.storage_offsets) or list(req.lengths) != sizes:
            return
        target = self.planner.resolve_tensor(req).detach()
        if not (
            target.dtype == dtype
            and target.is_contiguous()
            and not target.is_conj()
            and not target.is_neg()
            and list(target.shape) == sizes
        ):
            return
        if target.device.type == "cpu":
            self.target = target
            self.dest = (
                memoryview(target.reshape(-1).view(torch.uint8).numpy())
                if target.numel()
                else memoryview(bytearray())
            )
        elif target.device.type != "meta" and not self.reader.engine.zero_copy_reads:
            # A GPU tensor: the value is read through the engine's fast path into host memory
            # and copied to the device once. (A zero-copy engine's staged path already copies
            # straight from the store's memory to the device.)
            self.target = target
            self.via_host = True

    def commit(self) -> None:
        if self.host is not None:
            self.target.copy_(self.host.view(self.target.dtype).reshape(self.target.shape))
            self.host = None
        self.planner.commit_tensor(self.reqs[0], self.target)

    def add_part(self, start: int, view: memoryview) -> None:
        self.remaining -= 1
        if len(self.ranges) == 1:
            self._apply(view)
            return
        if view.nbytes:
            if self.buffer is None:
                self.buffer = torch.empty(self.loc.nbytes, dtype=torch.uint8)
            self.buffer[start : start + view.nbytes].copy_(byte_tensor(view))
        if self.remaining == 0:
            assert self.buffer is not None
            self._apply(memoryview(self.buffer.numpy()))

    def _apply(self, view: memoryview) -> None:
        if self.index.offset is None:
            self._load_object(view)
            return
        dtype, sizes = self.record.chunk(self.index)
        if view.nbytes:
            src = byte_tensor(view).view(dtype).reshape(sizes)
        else:
            src = torch.empty(sizes, dtype=dtype)
        for req in self.reqs:
            part = narrow_tensor_by_index(src, req.storage_offsets, req.lengths)
            target = self.planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise DataError(
                    f"{req.storage_index.fqn!r}: the load plan wants shape {list(target.size())} "
                    f"but the checkpoint holds {list(part.size())}"
                )
            target.copy_(part)
            self.planner.commit_tensor(req, target)

    def _load_object(self, view: memoryview) -> None:
        data = bytes(view)
        if self.reader.weights_only:
            check_weights_only(
                data,
                f"object {self.index.fqn!r} in checkpoint {self.record.checkpoint_id!r} "
                f"({self.reader.engine.url})",
                self.reader.weights_only_opt_out,
            )
        for req in self.reqs:
            if req.type != LoadItemType.BYTE_IO:
                raise DataError(f"{self.index.fqn!r} is stored as an object, not a tensor")
            self.planner.load_bytes(req, io.BytesIO(data))
