"""Restore from the nearest place: ``TieredStorageReader``.

A checkpoint saved through node-local stores lies spread over the nodes: each node's store
holds what its own ranks wrote, and a shared tier (Redis) holds everything once the background
copies are done. A restart should read each byte from the nearest place that holds it, once:

1. what a rank's own node holds, from local memory;
2. what another node's surviving store holds, from that node: one of its ranks reads it
   locally and sends it over the restore's process group;
3. only what no surviving node holds, from the shared tiers, in order: one rank reads each
   such item and sends it to the other ranks that need it.

How it plugs into ``dcp.load`` (``torch/distributed/checkpoint/state_dict_loader.py``): each
rank reports, in its local plan, its node id and which of the checkpoint's items its node's
store holds whole. The coordinator sees every rank's read requests and every node's holdings
at once (``prepare_global_plan``) and gives each rank its route (``kvckpt.routes``): the items
it reads locally or from the shared tiers, and the items it sends, receives and passes on, in
steps that keep the bytes each rank holds for the exchange within ``budget_bytes``.

A damaged or missing local copy (a checksum mismatch, a missing key, a store wiped meanwhile)
sends the items it holds to the next tier, logged; the route itself does not change, so the
exchange needs no second round of planning. Every rank learns whether any rank failed its
reads before the exchange starts and before each of its steps (one all-reduce each), so a
failure never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import events
from .adapter import KVStorageBase, byte_tensor, byte_view, new_save_id, valid_checkpoint_id
from .catalog import read_lease
from .engines.base import Engine
from .errors import (
    CheckpointNotFoundError,
    DamagedCopyError,
    DataError,
    KVCheckpointError,
    NotHeldError,
    ShapeMismatchError,
    StoreNotFoundError,
    UnsafeObjectError,
)
from .format import CheckpointRecord, decode_metadata, gc_paused
from .holdings import held_items, item_order
from .node import node_id
from .peer_copy import DEFAULT_BUDGET
from .reader import KVStorageReader, _ItemRead, fetch_parts
from .routes import Holdings, Route, StepPairs, Steps, plan_routes
from .stores import open_store

logger = logging.getLogger(__name__)

#: Where a rank's bytes came from, as ``TieredStorageReader.stats`` counts them.
LOCAL, PEERS, SENT = "local", "peers", "sent"


#: Errors that say nothing about the store read: raised at once, never sent to the next tier.
_NOT_THE_STORES = (UnsafeObjectError, ShapeMismatchError)


@dataclass
class RestoreStats:
    """Where one rank's restore got its bytes (``TieredStorageReader.stats``).

    Attributes:
        local: bytes read from this node's own store.
        shared: bytes read from each shared tier, by URL (password masked).
        peers: bytes received from other ranks (read by them from their nodes' stores or a
            shared tier, or passed on by a rank of this node).
        from_other_nodes: the part of ``peers`` that came from ranks of other nodes: each item
            a node lacks crosses into it once, to one of its ranks, which passes it on to the
            others there.
        sent: bytes this rank sent to other ranks.
        fallbacks: items that a tier could not serve whole and the next tier did.
        peak_buffered: the most bytes this rank held at once for the exchange (what it read to
            send, and what it received into buffers of its own): within the reader's
            ``budget_bytes``, or one item where an item is larger.
        seconds: the time ``read_data`` took on this rank.
    """

    local: int = 0
    shared: dict[str, int] = field(default_factory=dict)
    peers: int = 0
    from_other_nodes: int = 0
    sent: int = 0
    fallbacks: int = 0
    seconds: float = 0.0
    peak_buffered: int = 0


class TieredStorageReader(KVStorageBase, StorageReader):
    """DCP ``StorageReader`` that restores each byte from the nearest place that holds it.

    Args:
        stores: store URLs or engines, fastest first, as ``kvckpt.Tiers`` takes them: a
            node-local store (LMDB) first, then shared ones (Redis). A node-local store that
            does not exist on this node (a replaced node) holds nothing; it is not created.
        checkpoint_id: the checkpoint to load when ``dcp.load`` gets no ``checkpoint_id``.
        created_at: load only the save committed at this time (``kvckpt.Restore.created_at``):
            a tier holding an older save under the same id does not count.
        process_group: the group the ranks exchange items over: a gloo group of the ranks
            ``dcp.load`` runs over (pass the same subgroup to both). Default: the default group
            when its backend is gloo, else a gloo group over the same ranks (the items travel
            in host memory).
        verify: check each value against the checksum recorded at save, on every tier
            (default: wherever the save recorded them). A mismatch sends the item to the next
            tier.
        weights_only: as ``KVStorageReader``'s, for every tier.
        lease: as ``KVStorageReader``'s, for every tier.
        metadata: the save's encoded metadata, for a save that no tier lists but the nodes'
            stores hold between them (``Tiers(peers=K)``: ``Tiers.latest()`` finds it and
            passes it on). Used only where no tier holds the metadata itself.
        budget_bytes: the bytes a rank holds at once for the exchange (what it read to send,
            what it receives into buffers of its own); the exchange takes as many steps as
            that needs (``kvckpt.routes``). ``Tiers`` passes its ``peer_budget_bytes``.

    After a load, ``stats`` says where this rank's bytes came from (``RestoreStats``).
    """

    def __init__(
        self,
        stores: Sequence[str | Engine],
        *,
        checkpoint_id: str | os.PathLike | None = None,
        created_at: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        weights_only: bool = True,
        verify: bool | None = None,
        lease: float | bool = 60.0,
        metadata: bytes | None = None,
        budget_bytes: int = DEFAULT_BUDGET,
    ) -> None:
        super().__init__()
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be at least 1, not {budget_bytes}")
        if not stores:
            raise ValueError("TieredStorageReader needs at least one store")
        self.engines: list[Engine | None] = []
        for store in stores:
            try:
                self.engines.append(open_store(store, create=False))
            except StoreNotFoundError:
                self.engines.append(None)  # a node-local store this node does not have
        self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
        self.created_at = created_at
        self.process_group = process_group
        # A fast tier is checked before it is trusted: every value saved with a checksum.
        self.options: dict[str, Any] = dict(
            weights_only=weights_only, verify=True if verify is None else verify
        )
        self.lease: float = 60.0 if lease is True else float(lease)
        self.metadata = metadata
        self.budget_bytes = budget_bytes
        self.load_id = new_save_id()
        self.stats = RestoreStats()
        self._record: CheckpointRecord | None = None
        self._readers: dict[int, KVStorageReader] = {}
        self._leases = contextlib.ExitStack()
        self._renewals: list[Callable[[], None]] = []
        self._group: dist.ProcessGroup | None = None
        self._own_group: dist.ProcessGroup | None = None  # a gloo group over an NCCL job's ranks
        self._indexes: list[MetadataIndex] | None = None
        self._positions: dict[MetadataIndex, int] = {}  # each item's place in ``_items()``
        #: items this node's store failed to serve in this load (damaged, missing)
        self._damaged: set[int] = set()
        #: (save id, node) -> items that node's store failed to serve in an earlier load of
        #: the save: they do not count as held there (the next load reads them elsewhere)
        self._distrusted: dict[tuple[str, str], set[int]] = {}

    @property
    def distrusted(self) -> bool:
        """Whether a load found damaged copies in the nodes' stores (``DamagedCopyError``)."""
        return any(self._distrusted.values())

    @property
    def engine(self) -> Engine:  # type: ignore[override]  # KVStorageBase's, for messages
        return next(e for e in self.engines if e is not None)

    def _local(self) -> int | None:
        """The position of this node's own store, if it has one (the first, not shared)."""
        first = self.engines[0]
        return 0 if first is not None and not first.shared else None

    def _shared(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e is not None and e.shared]

    def _reader(self, tier: int) -> KVStorageReader:
        """The plain reader of one tier, set up with the chosen record."""
        if tier not in self._readers:
            engine = self.engines[tier]
            assert engine is not None
            reader = KVStorageReader(engine, checkpoint_id=self.checkpoint_id, **self.options)
            reader._record = self._record
            reader._renew_lease = self._renew_leases  # between its batches
            self._readers[tier] = reader
        return self._readers[tier]

    # -- DCP StorageReader --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = valid_checkpoint_id(checkpoint_id)
        self.load_id = new_save_id()
        self.stats = RestoreStats()
        self._record = None
        self._indexes = None
        self._readers = {}
        self._release_leases()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise KVCheckpointError(
                "TieredStorageReader restores checkpoints saved by every rank together, not "
                "rank-local ones (use_collectives=False); load those with KVStorageReader"
            )
        checkpoint_id = self._require_id()
        self._release_leases()
        self.stats = RestoreStats()  # a load again (after DamagedCopyError) counts afresh
        found: list[str] = []
        chosen = None
        for tier, engine in enumerate(self.engines):
            if engine is None:
                continue
            lease = contextlib.ExitStack()
            try:
                # The lease comes first (KVStorageReader.read_metadata says why).
                renew = lease.enter_context(read_lease(engine, checkpoint_id, self.lease))
                record = KVStorageReader(engine, checkpoint_id=checkpoint_id).read_record()
            except CheckpointNotFoundError:
                lease.close()
                found.append(f"{engine.url}: no checkpoint {checkpoint_id!r}")
                continue
            except KVCheckpointError as e:
                lease.close()
                logger.warning("kvckpt restore skips %s: %s", engine.url, e)
                found.append(f"{engine.url}: {e}")
                continue
            if self.created_at is not None and record.created_at != self.created_at:
                lease.close()
                found.append(f"{engine.url}: another save of {checkpoint_id!r}")
                continue
            self._leases.enter_context(lease)
            self._renewals.append(renew)
            self._record, self._indexes, self._readers = record, None, {}
            chosen = tier
            break
        if self._record is None and self.metadata is not None:
            chosen = self._from_given_metadata(checkpoint_id)
        if self._record is None:
            self._release_leases()
            raise CheckpointNotFoundError(
                f"no store holds checkpoint {checkpoint_id!r}"
                + ("" if self.created_at is None else f" saved at {self.created_at}")
                + ": "
                + "; ".join(found)
            )
        # The other shared tiers keep the data their metadata names while this load runs, too.
        for tier in self._shared():
            engine = self.engines[tier]
            assert engine is not None
            if tier != chosen:
                with contextlib.suppress(KVCheckpointError):
                    self._renewals.append(
                        self._leases.enter_context(read_lease(engine, checkpoint_id, self.lease))
                    )
        metadata = self._record.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _from_given_metadata(self, checkpoint_id: str) -> int | None:
        """Take the metadata ``Tiers.latest()`` handed over, with a read lease on this node's
        store, which holds (a share of) the save's data."""
        assert self.metadata is not None
        record = decode_metadata(self.metadata, where=f"the metadata of {checkpoint_id!r}")
        if record.checkpoint_id != checkpoint_id or (
            self.created_at is not None and record.created_at != self.created_at
        ):
            return None
        tier = self._local()
        if tier is not None:
            engine = self.engines[tier]
            assert engine is not None
            self._renewals.append(
                self._leases.enter_context(read_lease(engine, checkpoint_id, self.lease))
            )
        self._record, self._indexes, self._readers = record, None, {}
        return tier

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._record is None or self._record.metadata is not metadata:
            raise KVCheckpointError("set_up_storage_reader got metadata this reader did not read")
        self._group = self._exchange_group()

    def _exchange_group(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        if self.process_group is not None:
            return self.process_group
        if dist.get_backend() == "gloo":
            return dist.group.WORLD
        if self._own_group is None:  # once per reader: a load again reuses it
            self._own_group = dist.new_group(backend="gloo")
        return self._own_group

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        record = self._record
        assert record is not None
        held = self._held(record)
        return dataclasses.replace(
            plan, storage_data=Holdings(node_id(), record.save_id, np.packbits(held).tobytes())
        )

    def _items(self) -> list[MetadataIndex]:
        """The checkpoint's items in one order every rank agrees on, whichever tier its
        metadata came from: the positions routes speak of."""
        record = self._record
        assert record is not None
        if self._indexes is None:
            self._indexes = item_order(record)
            self._positions = {index: i for i, index in enumerate(self._indexes)}
        return self._indexes

    def _held(self, record: CheckpointRecord) -> np.ndarray:
        """Which items this node's store holds whole (every part, of the right size), less
        those it failed to serve in an earlier load of the same save."""
        tier = self._local()
        held = held_items(None if tier is None else self.engines[tier], record, self._items())
        held[sorted(self._distrusted.get((record.save_id, node_id()), ()))] = False
        return held

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        record = self._record
        assert record is not None
        if self._group is not None and len(plans) != dist.get_world_size(self._group):
            raise KVCheckpointError(
                f"restoring {record.checkpoint_id!r}: TieredStorageReader exchanges items over "
                f"a group of {dist.get_world_size(self._group)} ranks, but dcp.load runs over "
                f"{len(plans)}: pass the group dcp.load runs over to "
                "TieredStorageReader(process_group=...) too"
            )
        reports: list[Holdings] = [p.storage_data for p in plans]
        saves = sorted({r.save_id for r in reports})
        if len(saves) > 1:
            raise KVCheckpointError(
                f"checkpoint {record.checkpoint_id!r}: the ranks found different saves "
                f"({', '.join(saves)}), a re-save committed while this load started. Nothing "
                "was loaded; load again."
            )
        indexes = self._items()
        count = len(indexes)
        positions = self._positions
        held: dict[str, np.ndarray] = {}
        for report in reports:
            bits = np.unpackbits(np.frombuffer(report.held, dtype=np.uint8), count=count)
            held[report.node] = held.get(report.node, np.zeros(count, dtype=bool)) | bits.astype(
                bool
            )
        requests = [{positions[req.storage_index] for req in p.items} for p in plans]
        sizes = [record.locations[index].nbytes for index in indexes]
        routes = plan_routes([r.node for r in reports], held, requests, sizes, self.budget_bytes)
        return [
            dataclasses.replace(plan, storage_data=route)
            for plan, route in zip(plans, routes, strict=True)
        ]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        record = self._record
        if record is None:
            raise KVCheckpointError("read_data called before read_metadata")
        started = time.perf_counter()
        self._damaged = set()
        try:
            with gc_paused():
                self._read_all(record, plan, planner)
        finally:
            self._release_leases()
            self.stats.seconds = time.perf_counter() - started
        stats = self.stats
        events.emit(
            "restore",
            "read",
            record.checkpoint_id,
            next((e.url for e in self.engines if e is not None), ""),  # the nearest it has
            stats.seconds,
            nbytes=stats.local + sum(stats.shared.values()) + stats.peers,
        )
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _renew_leases(self) -> None:
        """Renew this load's read leases (each when a third of its time has passed)."""
        for renew in self._renewals:
            renew()

    def _release_leases(self) -> None:
        self._renewals = []
        leases, self._leases = self._leases, contextlib.ExitStack()
        leases.close()

    # -- the restore itself -------------------------------------------------------------------

    def _read_all(self, record: CheckpointRecord, plan: LoadPlan, planner: LoadPlanner) -> None:
        route: Route = plan.storage_data
        wanted: dict[int, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            wanted[self._positions[req.storage_index]].append(req)
        sending = {item for item, _ in route.send}
        local_tiers = [] if self._local() is None else [0]
        tiers_of: dict[int, list[int]] = {}
        steps = Steps(route)
        # One buffer for every step's items, each step's in turn: the most a step holds. New
        # buffers per step would leave the allocator's freed ones resident besides.
        need: dict[int, int] = defaultdict(int)
        for item, step in route.step_of:
            if item in sending or item in steps.landing:
                need[step] += record.locations[self._items()[item]].nbytes
        arena = torch.empty(0, dtype=torch.uint8)
        error: BaseException | None = None
        try:
            for items, tiers in ((route.local, local_tiers), (route.shared, [])):
                tiers = [*tiers, *self._shared()]
                own = [i for i in items if i not in sending]
                self._read_into_targets(record, own, wanted, planner, tiers)
                tiers_of.update((i, tiers) for i in items if i in sending)
            arena = torch.empty(max(need.values(), default=0), dtype=torch.uint8)
            self._renew_leases()
        except BaseException as e:  # every rank must hear of it before the exchange
            error = e
        self._all_ok(error)
        self.stats.from_other_nodes += route.from_other_nodes
        # An error after a step's check waits for the next check, the next step's or the last
        # one: every rank takes every step, so none is left waiting on another.
        carried: BaseException | None = None
        for step in range(route.steps):
            carried = self._exchange(
                record, steps.of(step), carried, wanted, tiers_of, planner, arena
            )
        if route.steps:
            self._all_ok(carried)

    def _item_read(
        self,
        record: CheckpointRecord,
        index: MetadataIndex,
        reqs: list[ReadItem],
        planner: LoadPlanner,
    ) -> _ItemRead:
        reader = self._reader(self._first_tier())
        return _ItemRead(reader, record, index, record.locations[index], reqs, planner)

    def _first_tier(self) -> int:
        return next(i for i, e in enumerate(self.engines) if e is not None)

    def _read_into_targets(
        self,
        record: CheckpointRecord,
        items: list[int],
        wanted: dict[int, list[ReadItem]],
        planner: LoadPlanner,
        tiers: list[int],
    ) -> None:
        """Read ``items`` into the planner's targets from the first of ``tiers`` that holds
        each whole; an item a tier cannot serve (missing, damaged, corrupted) goes to the
        next, logged."""
        indexes = self._items()
        todo = items
        damaged_here: set[int] = set()  # items this node's store holds but cannot serve
        for n, tier in enumerate(tiers):
            if not todo:
                return
            reader = self._reader(tier)
            try:
                self._read_items(reader, record, [indexes[i] for i in todo], wanted, planner)
                self._count(tier, record, todo)
                return
            except _NOT_THE_STORES:
                raise
            except KVCheckpointError as e:
                failed, damaged = self._failing(reader, record, todo, wanted, planner, indexes)
                if tier == self._local():
                    damaged_here = damaged
                self._count(tier, record, [i for i in todo if i not in failed])
                if n == len(tiers) - 1:
                    if failed != damaged:
                        raise
                    self._not_held(record, failed, damaged_here, e)
                self._fell_back(tier, tiers[n + 1], len(failed), e)
                todo = sorted(failed)
        if todo:
            self._not_held(record, set(todo), damaged_here, None)

    def _read_items(
        self,
        reader: KVStorageReader,
        record: CheckpointRecord,
        indexes: list[MetadataIndex],
        wanted: dict[int, list[ReadItem]],
        planner: LoadPlanner,
    ) -> None:
        reqs = [req for index in indexes for req in wanted[self._positions[index]]]
        reader._read_all(record, LoadPlan(reqs), planner)

    def _failing(
        self,
        reader: KVStorageReader,
        record: CheckpointRecord,
        items: list[int],
        wanted: dict[int, list[ReadItem]],
        planner: LoadPlanner,
        indexes: list[MetadataIndex],
    ) -> tuple[set[int], set[int]]:
        """After a batch failed on a tier: read its items one by one there, and return the
        ones that tier cannot serve, and of those the ones whose values it holds damaged or
        not at all (``DataError``)."""
        failed, damaged = set(), set()
        for i in items:
            try:
                self._read_items(reader, record, [indexes[i]], wanted, planner)
            except _NOT_THE_STORES:
                raise
            except KVCheckpointError as e:
                failed.add(i)
                if isinstance(e, DataError):
                    damaged.add(i)
        return failed, damaged

    def _not_held(
        self,
        record: CheckpointRecord,
        items: set[int],
        damaged_here: set[int],
        cause: BaseException | None,
    ) -> NoReturn:
        """No tier could serve ``items``; those this node's store was counted on for and held
        damaged are reported to every rank (``_distrust``)."""
        self._damaged |= damaged_here & items
        names = sorted({self._items()[i].fqn for i in items})
        raise NotHeldError(
            f"checkpoint {record.checkpoint_id!r}: no store could serve {len(items)} item(s) "
            f"whole ({', '.join(repr(n) for n in names[:3])}"
            + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            + ")"
            + ("" if cause is None else f"; the last said: {cause}")
        ) from cause

    def _read_bytes(
        self, record: CheckpointRecord, item: int, tiers: list[int], out: torch.Tensor
    ) -> torch.Tensor:
        """One item's whole value into ``out``, from the first of ``tiers`` that holds it
        whole."""
        index = self._items()[item]
        loc = record.locations[index]
        damaged_here: set[int] = set()
        for n, tier in enumerate(tiers):
            reader = self._reader(tier)

            def part(_: int, start: int, view: memoryview) -> None:
                if view.nbytes:
                    out[start : start + view.nbytes].copy_(byte_tensor(view))

            try:
                fetch_parts(reader.engine, record, [(index, loc)], part, verify=reader.verify)
            except _NOT_THE_STORES:
                raise
            except KVCheckpointError as e:
                if tier == self._local() and isinstance(e, DataError):
                    damaged_here = {item}
                if n == len(tiers) - 1:
                    if not isinstance(e, DataError):
                        raise
                    self._not_held(record, {item}, damaged_here, e)
                self._fell_back(tier, tiers[n + 1], 1, e)
                continue
            self._count(tier, record, [item])
            return out
        self._not_held(record, {item}, damaged_here, None)

    def _fell_back(self, tier: int, to: int, items: int, error: BaseException) -> None:
        source, target = self.engines[tier], self.engines[to]
        assert source is not None and target is not None
        self.stats.fallbacks += items
        logger.warning(
            "kvckpt restore: %d item(s) of %r read from %s instead of %s: %s",
            items,
            self.checkpoint_id,
            target.url,
            source.url,
            error,
        )

    def _count(self, tier: int, record: CheckpointRecord, items: list[int]) -> None:
        indexes = self._items()
        nbytes = sum(record.locations[indexes[i]].nbytes for i in items)
        engine = self.engines[tier]
        assert engine is not None
        if engine.shared:
            self.stats.shared[engine.url] = self.stats.shared.get(engine.url, 0) + nbytes
        else:
            self.stats.local += nbytes

    def _all_ok(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed its reads; all fail together, the failed
        one with its own error. Where a node's store failed to serve items it was counted on
        for (a damaged copy), every rank raises ``DamagedCopyError`` instead, having learnt
        which: the next load of the same save reads them from their next holder."""
        # 0: fine; 1: items no store could serve whole; 2: any other error
        code = 0 if error is None else 1 if isinstance(error, NotHeldError) else 2
        if self._group is not None:
            flag = torch.tensor([code], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            worst = int(flag.item())
        else:
            worst = code
        if worst:
            self._distrust()
        if error is not None:
            raise error
        if worst == 1:
            raise NotHeldError(
                f"restoring {self.checkpoint_id!r}: other ranks found items that no store "
                "could serve whole (their logs say which)"
            )
        if worst:
            raise KVCheckpointError(
                f"restoring {self.checkpoint_id!r}: other ranks could not read their share "
                "(their logs say why)"
            )

    def _distrust(self) -> None:
        """After a failed step (every rank, together): gather the items each node's store
        failed to serve; any not yet distrusted are, from now on, and every rank raises."""
        record = self._record
        assert record is not None
        mine = (node_id(), sorted(self._damaged))
        reports: list[Any] = [mine]
        if self._group is not None:
            reports = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(reports, mine, group=self._group)
        new: dict[str, int] = {}
        for node, items in reports:
            known = self._distrusted.setdefault((record.save_id, node), set())
            fresh = set(items) - known
            if fresh:
                new[node] = new.get(node, 0) + len(fresh)
            known.update(items)
        if new:
            nodes = sorted(new)
            raise DamagedCopyError(
                f"checkpoint {record.checkpoint_id!r}: the stores of node(s) "
                f"{', '.join(nodes)} could not serve {sum(new.values())} item(s) they hold "
                "(damaged or "
                "gone; their logs say which). Load again: the next load reads them from "
                "another holder (Tiers.restore does so itself)."
            )

    def _exchange(
        self,
        record: CheckpointRecord,
        pairs: StepPairs,
        carried: BaseException | None,
        wanted: dict[int, list[ReadItem]],
        tiers_of: dict[int, list[int]],
        planner: LoadPlanner,
        arena: torch.Tensor,
    ) -> BaseException | None:
        """One step of the exchange (``kvckpt.routes``): read the step's items this rank sends,
        learn whether any rank failed so far (``carried``: an error of the step before), then
        send and receive them; each received item goes straight into its target tensor where
        it can (a whole stored chunk into a contiguous CPU tensor). Returns the first error
        after the check, for the next one: the step's transfers go ahead regardless, so that
        no rank waits on one that left."""
        indexes = self._items()
        taken = 0

        def take(nbytes: int) -> torch.Tensor:
            nonlocal taken
            taken += nbytes
            return arena[taken - nbytes : taken]

        outgoing: dict[int, torch.Tensor] = {}
        error = carried
        try:
            for item in sorted({item for item, _ in pairs.send}) if error is None else ():
                nbytes = record.locations[indexes[item]].nbytes
                outgoing[item] = self._read_bytes(record, item, tiers_of[item], take(nbytes))
                if item in wanted:
                    self._item_read(record, indexes[item], wanted[item], planner).apply(
                        byte_view(outgoing[item])
                    )
        except BaseException as e:
            error = e
        self._all_ok(error)
        error = None
        landing: dict[int, tuple[_ItemRead | None, torch.Tensor | None, torch.Tensor | None]] = {}

        def receiving(from_: list[tuple[int, int]]) -> list[Any]:
            nonlocal error
            ops = []
            for item, peer in from_:
                nbytes = record.locations[indexes[item]].nbytes
                read = None
                try:
                    read = self._item_read(record, indexes[item], wanted[item], planner)
                except BaseException as e:  # received all the same: the sender goes on
                    error = error or e
                buffer = None
                if read is not None and read.dest is not None:
                    into = byte_tensor(read.dest) if nbytes else None
                else:
                    into = buffer = take(nbytes)
                if into is not None and nbytes:
                    ops.append(
                        dist.P2POp(dist.irecv, into, group=self._group, tag=item, group_peer=peer)
                    )
                landing[item] = (read, buffer, into)
                self.stats.peers += nbytes
            return ops

        def sending(to: list[tuple[int, int]], source: dict[int, Any]) -> list[Any]:
            ops = []
            for item, peer in to:
                tensor = source[item]
                if tensor is not None and tensor.numel():
                    ops.append(
                        dist.P2POp(dist.isend, tensor, group=self._group, tag=item, group_peer=peer)
                    )
                    self.stats.sent += tensor.numel()
            return ops

        # Round 1: from each item's source; round 2: within a node, from the rank it landed on.
        self._run(sending(pairs.send, outgoing) + receiving(pairs.receive))
        second = sending(pairs.relay, {i: into for i, (_, _, into) in landing.items()})
        second += receiving(pairs.relayed)
        self.stats.peak_buffered = max(self.stats.peak_buffered, taken)
        self._run(second)
        for read, buffer, _ in landing.values():
            try:
                if read is None:
                    continue
                if buffer is None and read.dest is not None:
                    read.commit()
                else:
                    read.apply(byte_view(buffer) if buffer is not None else memoryview(b""))
            except BaseException as e:
                error = error or e
        try:
            self._renew_leases()
        except BaseException as e:
            error = error or e
        return error

    @staticmethod
    def _run(ops: list[Any]) -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
