"""The DCP adapter's writer: ``KVStorageWriter``.

It turns each write item of a rank's save plan into the data keys of docs/FORMAT.md, hands
tensor bytes to the engine without copying them, and commits the checkpoint's metadata last, in
one transaction, once every rank's data is stored (``kvckpt.catalog.publish``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future as Future_
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import events
from .adapter import KVStorageBase, byte_view, new_save_id, valid_checkpoint_id
from .catalog import (
    LeaseRenewal,
    mark_pending,
    publish,
    read_index,
    renew_lease,
    tidy_remote_store,
)
from .engines.base import Engine, Hasher
from .errors import (
    KVCheckpointError,
    SaveAbandonedError,
    StoreFullError,
    StoreUnavailableError,
)
from .format import checksum, gc_paused, new_checksum
from .keys import ItemLocation, index_name, meta_key, part_ranges, spare_key
from .manage import NEVER, discard_save, list_checkpoints, preflight
from .manage import gc as collect_garbage  # not the standard library's gc
from .node import node_id, spare_cores
from .ready import first_save_values, share_bytes
from .staging import accelerator_available, advise_huge_pages
from .stores import open_store

logger = logging.getLogger(__name__)

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
            plan_position=loc.plan_position,
            nbytes=loc.nbytes,
            part_bytes=loc.part_bytes,
            checksums=checksums,
            name=loc.name,
        ),
    )


@dataclass(frozen=True)
class SavePlanData:
    """``SavePlan.storage_data``: which save and rank a plan's keys belong to."""

    save_id: str
    rank: int
    session: str | None = None  # the store's session id when the save started
    replicas: tuple[int, ...] = ()  # tiers (``kvckpt.Tiers``) this save is copied to
    #: with a node-local engine: the coordinator's store (``_store_identity``) and the saves
    #: it keeps, so that ranks writing to another node's store can trim it (``tidy_remote_store``)
    coordinator_store: str | None = None
    coordinator_saves: tuple[tuple[str, str], ...] = ()
    #: every rank queues a copy of its writes to its peers (``Tiers(peers=K)``): the
    #: coordinator decides, for a save that spans the whole job
    peer_copy: bool = False


def _store_identity(engine: Engine) -> str | None:
    """Which physical store a node-local engine is (None for a shared one): two ranks whose
    identities differ write to different stores."""
    if engine.shared:
        return None
    return f"{node_id()}|{engine.url}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a tensor's contiguous projection, without a copy when it is contiguous.

    A view is taken as the elements it shows (never its whole backing storage); a tensor on
    another device is copied to the CPU, as DCP's own writers do. Every step is skipped when
    it has nothing to do: this runs once per tensor, 10,000s of times per save.
    """
    t = tensor.detach() if tensor.requires_grad else tensor
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t)


def _planned_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0
    return item.tensor_storage_size() or 0


def _make_spares(engine: Engine, values: list[tuple[str, int]], after: str | None = None) -> None:
    """``Engine.make_spares``, a head start for the next save: never a reason to fail this one."""
    try:
        engine.make_spares(values, after=after)
    except Exception as e:
        logger.info("no spares made ahead of the next save to %s: %s", engine.url, e)


#: The stores (by URL) whose saves in this process hash on a worker thread, though their
#: engine can hash as it sends: a save measured its inline hashing above ``_HASH_ASIDE_ABOVE``
#: of its write time, with a core to spare (``_Checksums.learn``).
_HASH_ASIDE: set[str] = set()
_HASH_ASIDE_ABOVE = 0.10


class _TimedHashes:
    """A factory of streaming hashes, as ``new_checksum``, that adds up the time they hash."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> _TimedHash:
        return _TimedHash(self)


class _TimedHash:
    def __init__(self, owner: _TimedHashes) -> None:
        self._owner = owner
        self._hash = new_checksum()

    def update(self, data: memoryview | bytes) -> None:
        started = time.perf_counter()
        self._hash.update(data)
        self._owner.seconds += time.perf_counter() - started

    def intdigest(self) -> int:
        return self._hash.intdigest()


class _Checksums:
    """How a save records a checksum per value: not at all; by the engine, as it sends each
    value (``hashes_while_writing``: cache-hot, one pass over memory); or on a worker thread
    while the engine sends, for large parts (xxhash releases the GIL), inline for small ones,
    where a hand-off costs more.

    Which of the last two costs a save less depends on the CPU (how fast it hashes against how
    fast the engine sends) and on whether a core is free, so it is measured, not assumed: an
    engine that hashes inline on its sending thread (``Engine.hashes_inline``) times its
    hashing, and where that took more than a tenth of the save's write and this node has a core
    to spare, the later saves to that store in this process hash on a worker thread. A core is
    spare when neither a training rank (``spare_cores``) nor the store's own server
    (``Engine.server_on_node``: a Redis on this node) needs it."""

    def __init__(self, engine: Engine, enabled: bool) -> None:
        in_engine = enabled and engine.hashes_while_writing and engine.url not in _HASH_ASIDE
        self._digests: dict[int, int | None] = {}
        #: what ``put_many`` gets: where the engine hashes, where to report its digests
        self.on_value = self._digests.__setitem__ if in_engine else None
        self._timed = _TimedHashes() if in_engine and engine.hashes_inline else None
        self.hasher: Callable[[], Hasher] | None = (
            (self._timed or new_checksum) if in_engine else None
        )
        self._pool = ThreadPoolExecutor(1) if enabled and not in_engine else None
        self._hashes: list[list[Future_[int] | int]] = []

    def add(self, view: memoryview, part_bytes: int) -> None:
        """A value about to be handed to the engine, in its parts."""
        if self._pool is not None:
            self._hashes.append(
                [
                    self._pool.submit(checksum, view[a:b])
                    if b - a >= _ASYNC_HASH_BYTES
                    else checksum(view[a:b])
                    for a, b in part_ranges(view.nbytes, part_bytes)
                ]
            )

    def recorded(self, results: list[WriteResult], url: str) -> list[WriteResult]:
        """``results`` with their parts' checksums (as they were, without checksums)."""
        if self.on_value is not None:
            return self._from_engine(results, url)
        if self._pool is not None:
            return [
                _with_checksums(wr, tuple(f if isinstance(f, int) else f.result() for f in fs))
                for wr, fs in zip(results, self._hashes, strict=True)
            ]
        return results

    def _from_engine(self, results: list[WriteResult], url: str) -> list[WriteResult]:
        """The checksums the engine reported, numbered in the order parts were handed to it."""
        out, i = [], 0
        for wr in results:
            loc: ItemLocation = wr.storage_data
            count = len(part_ranges(loc.nbytes, loc.part_bytes))
            sums = tuple(self._digests.get(j) for j in range(i, i + count))
            if None in sums:
                raise RuntimeError(
                    f"{url}: the engine says it hashes values while writing "
                    f"(hashes_while_writing) but reported no checksum for a part of "
                    f"{wr.index.fqn!r}; fix the engine or save with checksums=False"
                )
            out.append(_with_checksums(wr, sums))  # type: ignore[arg-type]
            i += count
        return out

    def learn(self, engine: Engine, write_seconds: float) -> None:
        """After a save's write: where hashing inline took more than its share of the write
        and a core is free, later saves to this store hash on a worker thread instead."""
        if self._timed is None or write_seconds <= 0:
            return
        share = self._timed.seconds / write_seconds
        # a server on this node takes a core of its own while the save sends
        spare = spare_cores() - (1 if engine.server_on_node else 0)
        if share > _HASH_ASIDE_ABOVE and spare >= 1:
            _HASH_ASIDE.add(engine.url)
            logger.info(
                "kvckpt: hashing as it sent took %.0f%% of a save's write to %s; later saves "
                "there hash on a worker thread",
                100 * share,
                engine.url,
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class KVStorageWriter(KVStorageBase, StorageWriter, BlockingAsyncStager):
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
            check. Default: the engine's choice (on for every built-in engine, where hashing
            costs under a tenth of a save and a load; see docs/RELIABILITY.md).
        lease: seconds a save holds the checkpoint id's write lease without renewing it (it is
            renewed while data is written). A second writer of the same id fails fast while the
            lease is held; a crashed writer's lease lapses after this long.
        cache_staged_state_dict: reuse one staging copy across ``dcp.async_save`` calls (as
            DCP's ``FileSystemWriter``), kept in host memory between saves; keep the writer
            across saves (``writer.reset(new_id)`` before each). The copy is pinned where an
            accelerator is, and plain memory on a CPU-only host (where DCP's own fails).
        huge_pages: ask the kernel for transparent huge pages on ``dcp.async_save``'s staging
            copy (Linux; off by default). The median save blocks less (fewer page faults), but
            saves stall now and then while the kernel compacts memory into huge pages (most
            with an LMDB store on /dev/shm), which can cost more in all than it saves.
        sole_saver: this process saves the whole state dict, and is the only process of its
            node that saves into the store (``dcp.save(..., no_dist=True)`` from one rank, as
            ``kvckpt.lightning.KVCheckpoint`` does). The room ``get_ready`` and each save make
            for the saves to come is then this process's alone; by default it is this rank's
            share of a save by every rank of the job, times the ranks of the node (torchrun's
            ``LOCAL_WORLD_SIZE``), all of which write into a node-local store.
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
        sole_saver: bool = False,
    ) -> None:
        super().__init__()
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.huge_pages = huge_pages
        self.sole_saver = sole_saver
        self.engine = open_store(store)
        self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
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
            if not self.engine.supports_ttl:
                raise ValueError(
                    f"ttl= needs an engine whose keys can expire (Redis); {self.engine.url} "
                    "cannot. Use keep_last= or kvckpt gc to bound what is kept instead."
                )
        self.ttl = ttl
        if lease <= 0:
            raise ValueError(f"lease must be positive seconds, not {lease}")
        self.lease = lease
        self.checksums = self.engine.checksums_by_default if checksums is None else checksums
        self.save_id = new_save_id()
        self.rank: int | None = None
        self.use_collectives = True
        #: largest value per key; ``Tiers`` sets the smallest of its stores' so that every
        #: tier holds byte-identical keys and one metadata value fits them all
        self.part_bytes = int(self.engine.max_value_bytes)
        #: This store's place in a ``Tiers`` (0: the first), for events; None outside one
        self.tier: int | None = None
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
            self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
        self.save_id = new_save_id()

    def get_ready(self, state_dict: dict[str, Any]) -> None:
        """Get the store ready for this job's saves of ``state_dict`` now, at the start of the
        job, so that the first save is as fast as the later ones. Returns at once.

        Every save after the first writes into memory the store made ready while training ran
        (``Engine.get_ready``); the first save of a new store would otherwise allocate all of
        its memory on the job's path (slow where the machine hands out new pages slowly).
        Called once the state dict exists (after building the model and
        optimizer), this does that work in the background during the steps before the first
        checkpoint: LMDB sizes its map for the ``keep_last + 1`` saves it will hold and
        allocates their pages on a background thread; Redis makes spares of the first save's
        values for it to write over (those known without collectives: every value in a job of
        one rank, the chunks of unreplicated sharded tensors in a larger one); other engines
        do nothing.

        The size is this rank's share of a save, estimated without collectives
        (``ready.share_bytes``); with ``sole_saver``, the whole state dict. Pass plain state
        dicts: a ``Stateful`` object (DCP's ``AppState`` pattern) counts for nothing here; pass
        its ``state_dict()``.
        """
        distributed = dist.is_available() and dist.is_initialized() and not self.sole_saver
        world = dist.get_world_size() if distributed else 1
        self.engine.get_ready(
            share_bytes(state_dict, world), self._saves_held(), self._node_ranks()
        )
        if self.engine.reuses_values:
            rank = dist.get_rank() if world > 1 else 0
            prefix, part_bytes = self.engine.prefix, self.part_bytes
            _make_spares(
                self.engine, first_save_values(state_dict, rank, world, prefix, part_bytes)
            )

    def _node_ranks(self) -> int | None:
        """How many processes of this node save into the store (None: every rank of it)."""
        return 1 if self.sole_saver else None

    def _saves_held(self) -> int | None:
        """How many saves the store holds at once at most: the ``keep_last`` kept and the one
        being written (None: no retention, no bound)."""
        return None if self.keep_last is None else self.keep_last + 1

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
            self.engine.refuse_unsafe()  # before the save's first write, its registration
            mark_pending(self.engine, checkpoint_id, self.save_id, self.rank or 0, self.lease)
            plan = dataclasses.replace(
                plan, storage_data=SavePlanData(self.save_id, self.rank or 0, self._session_id())
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with events.Phase("save", "plan", self._require_id(), self.engine.url, tier=self.tier):
            return self._global_plan(plans)

    def _global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        session = None
        coordinator_store: str | None = None
        coordinator_saves: tuple[tuple[str, str], ...] = ()
        if self.use_collectives:
            # Registered before any rank writes data, so gc never mistakes it for garbage;
            # a store that may lose data is refused before this first write.
            self.engine.refuse_unsafe()
            mark_pending(self.engine, self._require_id(), self.save_id, None, self.lease)
            session = self._session_id()
            coordinator_store = _store_identity(self.engine)
            if coordinator_store is not None and len(plans) > 1:
                coordinator_saves = tuple(sorted(read_index(self.engine).live_saves()))
        return [
            plan
            if isinstance(plan.storage_data, SavePlanData)
            else dataclasses.replace(
                plan,
                storage_data=SavePlanData(
                    self.save_id,
                    rank,
                    session,
                    coordinator_store=coordinator_store,
                    coordinator_saves=coordinator_saves,
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        checkpoint_id = self._require_id()
        where: SavePlanData = plan.storage_data
        self.save_id = where.save_id
        self._session = where.session
        self._tidy_if_remote(checkpoint_id, where)
        lease_rank = None if self.use_collectives else where.rank
        renew = LeaseRenewal(
            self.lease,
            lambda: renew_lease(self.engine, checkpoint_id, where.save_id, lease_rank, self.lease),
        )
        sums = _Checksums(self.engine, self.checksums)
        results: list[WriteResult] = []
        phase = events.Phase(
            "save", "write", checkpoint_id, self.engine.url, tier=self.tier, rank=where.rank
        )
        try:
            planned = self._preflight(plan)
            # Sized for every save the store will hold before this one writes: growing the
            # map after it would drop the pages it just mapped (LMDB).
            self.engine.get_ready(planned, self._saves_held(), self._node_ranks())
            started = time.perf_counter()
            written = self._write(checkpoint_id, plan, planner, where, renew, sums, results)
            sums.learn(self.engine, time.perf_counter() - started)
            self._make_spares_ahead(written, where)
            self.engine.sync_replicas()
            written_bytes = sum(wr.size_in_bytes for wr in results)
            self.engine.get_ready(written_bytes, self._saves_held(), self._node_ranks())
            results[:] = sums.recorded(results, self.engine.url)
        except BaseException:
            self._discard_failed(checkpoint_id, where, lease_rank)
            raise
        finally:
            sums.close()
        self._check_session(checkpoint_id)
        phase.end(sum(wr.size_in_bytes for wr in results))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _tidy_if_remote(self, checkpoint_id: str, where: SavePlanData) -> None:
        """Where this rank's node-local store is not the coordinator's, it holds no metadata, so
        its own bookkeeping is what lets retention reach it (and gc leave it alone)."""
        if (
            where.coordinator_store is not None
            and _store_identity(self.engine) != where.coordinator_store
        ):
            tidy_remote_store(
                self.engine,
                origin=where.coordinator_store,
                live=set(where.coordinator_saves),
                checkpoint_id=checkpoint_id,
                save_id=where.save_id,
                rank=where.rank,
            )

    def _preflight(self, plan: SavePlan) -> int:
        """Fail before writing where the store cannot take this rank's share of the save;
        returns that share's bytes."""
        planned = sum(_planned_bytes(item) for item in plan.items)
        try:
            preflight(self.engine, planned)
        except StoreFullError as e:
            raise self._with_retention_hint(e, planned) from None
        return planned

    def _with_retention_hint(self, error: StoreFullError, planned: int) -> StoreFullError:
        """Where the checkpoints that ``keep_last`` deletes once this save commits would make
        room for it, say so: retention runs after a commit (the newest checkpoint is never
        deleted before the next one exists), so a store sized for exactly ``keep_last``
        checkpoints has no room for the one being written."""
        if self.keep_last is None:
            return error
        try:
            usage = self.engine.usage()
            others = [
                c
                for c in list_checkpoints(self.engine)
                if c.checkpoint_id != self.checkpoint_id and not c.rank_local
            ]
        except KVCheckpointError:
            return error
        if usage.limit_bytes is None or usage.used_bytes is None:
            return error
        retired = others[self.keep_last - 1 :]  # newest first: the newest keep_last - 1 stay
        freed = sum(c.total_bytes for c in retired)
        if not retired or usage.limit_bytes - usage.used_bytes + freed < planned:
            return error
        names = ", ".join(repr(c.checkpoint_id) for c in retired[:5])
        names += f" and {len(retired) - 5} more" if len(retired) > 5 else ""
        return StoreFullError(
            f"{error} Retention would make room: keep_last={self.keep_last} deletes {names} "
            f"({freed} bytes) once this save commits, but the save needs the room before. "
            f"Delete them now (kvckpt rm {self.engine.url} ID), leaving fewer checkpoints "
            "while this one is written, or give the store room for keep_last + 1 checkpoints."
        )

    def _write(
        self,
        checkpoint_id: str,
        plan: SavePlan,
        planner: SavePlanner,
        where: SavePlanData,
        renew: LeaseRenewal,
        sums: _Checksums,
        results: list[WriteResult],
    ) -> list[tuple[str, int]]:
        """Send every item of the plan to the engine, filling ``results`` as items go. Returns
        the spare name and size of each value written, where spares may be made ahead
        (``_make_spares_ahead``)."""
        part_bytes = self.part_bytes
        prefix = self.engine.prefix
        written: list[tuple[str, int]] = []
        record = self.keep_last is not None and self.engine.reuses_values

        def values() -> Iterator[tuple[str, memoryview]]:
            # Lazy: each item is resolved (and, for GPU tensors, copied to the CPU) only when
            # the engine is ready to send it, so at most one batch is held at a time.
            for n, item in enumerate(plan.items):
                renew()
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    view = data.getbuffer()
                elif item.type == WriteItemType.BYTE_IO:  # bytes a planner resolved
                    view = memoryview(data)  # type: ignore[arg-type]
                else:
                    view = tensor_bytes(data)
                loc = ItemLocation(
                    where.rank, n, view.nbytes, part_bytes, name=index_name(item.index)
                )
                sums.add(view, part_bytes)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=loc)
                )
                for key, part in loc.split(view, prefix, checkpoint_id, where.save_id):
                    if record:
                        written.append((spare_key(prefix, key), part.nbytes))
                    yield key, part

        with gc_paused():
            self.engine.put_many(
                values(),
                on_value=sums.on_value,
                hasher=sums.hasher,
                # where the engine keeps retired values as spares, each value is written over
                # the spare of the value at its place in an earlier save (same rank, item and
                # part)
                spare_of=functools.partial(spare_key, prefix),
            )
        return written

    def _make_spares_ahead(self, written: list[tuple[str, int]], where: SavePlanData) -> None:
        """After a save that retention will not follow with spares (it deletes no checkpoint
        until ``keep_last`` are committed), have the engine make spares of the values just
        written, for the next save to write over (Redis: the server allocates them while
        training runs, not during that save: they are made once its commit record exists).
        Reads the catalog index, one key. Not in a node-local store that holds no metadata
        (its retention is ``tidy_remote_store``), nor for a checkpoint id saved again (its
        commit record exists already)."""
        remote = where.coordinator_store not in (None, _store_identity(self.engine))
        if not written or self.keep_last is None or remote:
            return
        checkpoint_id = self._require_id()
        try:
            infos = list_checkpoints(self.engine)
        except (KVCheckpointError, OSError):
            return  # an index that cannot be read: gc's to mend, and no reason to fail a save
        complete = sum(1 for info in infos if info.complete)
        # with fewer than keep_last committed, this save's commit makes retention delete none
        if complete < self.keep_last and all(i.checkpoint_id != checkpoint_id for i in infos):
            commit = meta_key(self.engine.prefix, checkpoint_id, self._local_rank_key())
            _make_spares(self.engine, written, after=commit)

    def _session_id(self) -> str | None:
        return self.engine.session_id()

    def _check_session(self, checkpoint_id: str) -> None:
        """Fail the save if the store lost its memory (restarted) since the save began: data
        written before the restart is gone and must never be committed."""
        if getattr(self, "_session", None) is not None and self._session_id() != self._session:
            raise StoreUnavailableError(
                f"{self.engine.url} restarted or failed over while checkpoint "
                f"{checkpoint_id!r} was being saved: what was written before may be gone, so "
                "the checkpoint was not committed. Save it again."
            )

    def _discard_failed(self, checkpoint_id: str, where: SavePlanData, rank: int | None) -> None:
        """Best effort: a save whose write failed will never commit (DCP fails the whole save
        when any rank's write fails), so it leaves nothing behind. In the store that registered
        it (the coordinator's; this rank's own for a rank-local save) the save is discarded as
        a whole, pending entry and write lease included, so it is not listed as incomplete
        until the next ``gc``; in another node's store, this rank's data goes. Data other ranks
        still write afterwards is an orphan that ``gc`` removes."""
        from .keys import data_prefix

        registered = where.coordinator_store in (None, _store_identity(self.engine))
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
        phase = events.Phase("save", "commit", checkpoint_id, self.engine.url, tier=self.tier)
        try:
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
        except SaveAbandonedError:
            # gc dropped the save while it wrote: what was written after that goes too.
            discard_save(self.engine, checkpoint_id, self.save_id, rank)
            raise
        try:
            self.engine.sync_replicas()
        except StoreUnavailableError as e:
            raise StoreUnavailableError(
                f"checkpoint {checkpoint_id!r} is committed on {self.engine.url} but not yet "
                f"on its replicas: {e}"
            ) from None
        phase.end(sum(loc.nbytes for loc in locations.values()))
        if self.keep_last is not None:
            try:
                collect_garbage(
                    self.engine,
                    keep_last=self.keep_last,
                    protect=self._protected(checkpoint_id),
                    incomplete_older_than=NEVER,
                    scan_orphans=False,
                    reuse=True,
                )
            except (KVCheckpointError, OSError) as e:
                # The checkpoint is committed: retention catches up at the next save.
                logger.warning(
                    "checkpoint %r is committed in %s, but keep_last=%d could not delete older "
                    "ones: %s (the next save or `kvckpt gc URL --keep-last %d` will)",
                    checkpoint_id,
                    self.engine.url,
                    self.keep_last,
                    e,
                    self.keep_last,
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
