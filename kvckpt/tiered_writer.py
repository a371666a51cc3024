"""The DCP ``StorageWriter`` of ``Tiers``: a save into the first (node-local) store that queues
the save's copies: to the further stores (every ``shared_every``-th save, or one asked for), to
the durable directory, and into K other nodes' stores (``peers``)."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from .catalog import read_index
from .engines.base import Engine
from .keys import ItemLocation, meta_key
from .peer_copy import PeerCopier
from .writer import KVStorageWriter, SavePlanData

logger = logging.getLogger(__name__)


class _Tiers(Protocol):
    """What the writer needs of its ``kvckpt.Tiers`` (which builds it: no import upward)."""

    engines: list[Engine]
    keep_last: int | None
    part_bytes: int
    durable: Path | None
    peer_copies: PeerCopier

    def busy_ids(self) -> set[str]: ...

    def due_for_shared(self, asked: bool) -> bool: ...

    def plan_copies(
        self, checkpoint_id: str, save_id: str, lease: float, copy: str | None = None
    ) -> tuple[int, ...]: ...

    def copy_in_background(
        self,
        checkpoint_id: str,
        save_id: str,
        replicas: tuple[int, ...],
        locations: list[ItemLocation],
    ) -> None: ...

    def commit_in_background(
        self,
        checkpoint_id: str,
        save_id: str,
        replicas: tuple[int, ...],
        metadata: Metadata,
        locations: dict[MetadataIndex, ItemLocation],
        world_size: int,
        created_at: float,
    ) -> None: ...


class TieredStorageWriter(KVStorageWriter):
    """A ``KVStorageWriter`` on the first tier that queues copies to the others (``Tiers``).

    ``copy`` overrides the ``Tiers``' own (``"every"`` or ``"newest"``) for this save;
    ``shared=True`` sends this save to the further stores whatever ``shared_every`` says (a
    job's last checkpoint)."""

    def __init__(
        self, tiers: _Tiers, *, copy: str | None = None, shared: bool = False, **options: Any
    ) -> None:
        super().__init__(tiers.engines[0], keep_last=tiers.keep_last, **options)
        self.tiers = tiers
        self.copy = copy
        self.shared = shared
        self.part_bytes = tiers.part_bytes
        self.tier = 0
        self._replicas: tuple[int, ...] = ()
        self._to_shared = True  # whether this save goes beyond the node-local stores
        self._peer_copy = False  # whether this save is copied to the peers

    def _saves_held(self) -> int | None:
        # and the save whose background copy is running, which keep_last leaves in place
        held = super()._saves_held()
        if held is None:
            return None
        if len(self.tiers.engines) > 1:
            held += 1
        # with peers, each save held also brings K other nodes' shares (as large as this
        # node's, where the job is balanced): the map is sized for them too
        copier = self.tiers.peer_copies
        if not copier.active or copier.topology is None:
            return held
        return held * (1 + min(copier.peers, len(copier.topology.order) - 1))

    def _protected(self, checkpoint_id: str) -> list[str]:
        # keep_last waits for the copies and exports of earlier checkpoints still in flight
        return [checkpoint_id, *sorted(self.tiers.busy_ids())]

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        if not self.use_collectives:
            return plans
        peers = self.tiers.peer_copies
        # Every rank of the job must queue the copy, or none: a save of every rank, by the
        # coordinator of the job (rank 0), not a subgroup's or one rank's (no_dist); and, like
        # copy="newest", none while the copy of an earlier save still runs (or the save
        # asked for the shared tier: the job's last one is copied everywhere).
        self._peer_copy = (
            peers.active
            and len(plans) == dist.get_world_size()
            and dist.get_rank() == 0
            and (self.shared or not peers.busy())
        )
        self._to_shared = self.tiers.due_for_shared(self.shared)
        if len(self.tiers.engines) > 1 and self._to_shared:
            # a save sent to the shared tier on purpose is copied even while others run
            copy = "every" if self.shared else self.copy
            self._replicas = self.tiers.plan_copies(
                self._require_id(), self.save_id, self.lease, copy
            )
        return [
            dataclasses.replace(
                plan,
                storage_data=dataclasses.replace(
                    plan.storage_data, replicas=self._replicas, peer_copy=self._peer_copy
                ),
            )
            for plan in plans
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        where: SavePlanData = plan.storage_data
        peers = self.tiers.peer_copies
        written: Future[list[ItemLocation] | None] = Future()
        if where.peer_copy:
            # queued before writing, on every rank, so every rank's copies run the same saves
            peers.submit(self._require_id(), where.save_id, written.result)
        try:
            fut = super().write_data(plan, planner)
            results = fut.wait()
        except BaseException:
            written.set_result(None)
            raise
        locations = [wr.storage_data for wr in results]
        written.set_result(locations)
        if where.replicas:
            self.tiers.copy_in_background(
                self._require_id(), where.save_id, where.replicas, locations
            )
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        peers = self.tiers.peer_copies
        try:
            super().finish(metadata, results)
        except BaseException:
            if self._peer_copy:
                peers.not_committed(self.save_id)
            raise
        checkpoint_id = self._require_id()
        if self._peer_copy:
            try:
                raw = self.engine.get(meta_key(self.engine.prefix, checkpoint_id))
                live = read_index(self.engine).live_saves()
            except Exception as e:  # committed all the same: only its copy is skipped
                logger.warning("kvckpt tiers: %r is not copied to peers: %s", checkpoint_id, e)
                peers.not_committed(self.save_id)
            else:
                peers.committed(self.save_id, raw, live)
        if not self.use_collectives or not self._to_shared:
            return
        if not (self._replicas or self.tiers.durable is not None):
            return
        assert self.committed_at is not None
        self.tiers.commit_in_background(
            checkpoint_id,
            self.save_id,
            self._replicas,
            metadata,
            {wr.index: wr.storage_data for rank in results for wr in rank},
            self._world_size(results),
            self.committed_at,
        )
