"""Tiers: save to the fastest store, copy to slower ones in the background, restore from the
fastest store that holds the newest checkpoint.

The usual shape is node-local LMDB on ``/dev/shm`` first (a save returns once it commits
there), a shared Redis second (survives the loss of a node), and optionally a durable DCP
directory that every k-th checkpoint is exported to (survives the loss of Redis)::

    tiers = kvckpt.Tiers(["lmdb:///dev/shm/ckpt", "redis://ckpt-redis:6379"],
                         durable="/mnt/ckpt", durable_every=10, keep_last=2)
    tiers.prefetch()                            # at the top of the script: see prefetch()
    ...                                         # process group, model, optimizer
    restored = tiers.restore(state_dict)        # a Restore, or None on a fresh start
    step = 0 if restored is None else int(restored.checkpoint_id.removeprefix("step-")) + 1
    ...
    dcp.async_save(state_dict, storage_writer=tiers.writer(), checkpoint_id=f"step-{step}")
    ...
    tiers.wait()                                # before the job exits

How a copy stays correct across nodes: every tier stores byte-identical keys (one part size,
the smallest any tier allows, and one save id), so one metadata value describes the checkpoint
in every tier. During a save, the coordinator registers the save as pending in each replica tier
before any rank writes (DCP's global plan step); each rank then copies *its own* keys from its
local tier in a background thread; the coordinator's background thread waits until every key
is in the replica and only then commits the same metadata there. A replica therefore never
shows a checkpoint that is not whole, and a rank never needs another node's local store.

A restart reverses the copy: ``prefetch()`` brings the newest checkpoint from a shared tier into
the node-local one (the same keys, save id and commit time) while the job starts up, so the
restore reads local memory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import StorageReader

from . import events
from .catalog import (
    LeaseRenewal,
    mark_pending,
    publish,
    release_read_lease,
    take_read_lease,
)
from .choice import DURABLE_INFO, Restore, choose_newest
from .copying import copy_values
from .dcp_files import DirectoryReader, export_checkpoint
from .engines.base import Engine
from .errors import (
    DamagedCopyError,
    KVCheckpointError,
    NotHeldError,
    ReplicationError,
    UnsafeStoreError,
)
from .holdings import HeldSave, newest_held_whole
from .keys import ItemLocation, part_ranges
from .manage import NEVER, discard_save
from .manage import gc as collect_garbage  # not the standard library's gc
from .node import node_id, run_in_background, spare_cores
from .peer_copy import DEFAULT_BUDGET, PeerCopier
from .prefetch import bring_share
from .restore import RestoreStats, TieredStorageReader
from .stores import open_store
from .tiered_writer import TieredStorageWriter

logger = logging.getLogger(__name__)


class Tiers:
    """An ordered list of checkpoint stores, fastest first, plus an optional durable directory.

    Args:
        stores: store URLs or engines, fastest first. The first takes every save
            synchronously; each further one gets a background copy of every checkpoint
            (``copy="newest"``: of the newest only, see below).
        durable: a directory; every ``durable_every``-th checkpoint is exported there as a
            standard DCP checkpoint (``<durable>/<checkpoint id>/``), from the slowest store.
        keep_last: retention applied to every store (not to ``durable``).
        replicate_timeout: seconds the coordinator waits for every rank's keys to reach a
            replica before giving up on that copy (a rank that died mid-copy).
        copy: ``"every"`` checkpoint is copied to the further stores, in order; with
            ``"newest"``, a save made while the copy of an earlier one is still running stays
            in the first store only, so copies never queue up behind a training loop that saves
            faster than they go (the further stores then hold the newest save whose copy could
            start, at most one copy's time behind the first). The coordinator decides for every
            rank, at the save's global plan. Save a job's last checkpoint with
            ``tiers.writer(copy="every")`` so that it reaches every store.
        peers: K: after each save commits in the node-local stores, each node's share (what
            its ranks wrote) is copied, in the background, into the node-local stores of the K
            nodes after it on a ring (``kvckpt.placement``), so that a restart that lost any K
            nodes restores the newest checkpoint without the shared tier
            (``kvckpt.peer_copy`` says how a copy stays whole). Needs a node-local first store
            and a job of more than one node (``kvckpt.node``); 0, the default, copies nothing.
        shared_every: N: the further stores get every N-th checkpoint (the 1st, the N+1-th,
            ...), and any one saved with ``tiers.writer(shared=True)`` (a job's last);
            ``durable`` gets every ``durable_every``-th of those. With ``peers``, a save every
            step and ``shared_every=50`` keeps a node loss at one step and the shared tier's
            traffic at 1/50.
        peer_budget_bytes: the bytes a rank holds in flight at once while copying to and from
            its peers, and while exchanging items in a restore (``TieredStorageReader``).
        writer_options: passed to each ``KVStorageWriter`` (``checksums``, ``lease``, ...).
            Checksums default to on if any store records them by default.
    """

    def __init__(
        self,
        stores: Sequence[str | Engine],
        *,
        durable: str | os.PathLike | None = None,
        durable_every: int = 1,
        keep_last: int | None = None,
        replicate_timeout: float = 600.0,
        copy: str = "every",
        peers: int = 0,
        shared_every: int = 1,
        peer_budget_bytes: int = DEFAULT_BUDGET,
        **writer_options: Any,
    ) -> None:
        if not stores:
            raise ValueError("Tiers needs at least one store")
        if durable_every < 1:
            raise ValueError(f"durable_every must be >= 1, not {durable_every}")
        if copy not in ("every", "newest"):
            raise ValueError(f'copy must be "every" or "newest", not {copy!r}')
        if shared_every < 1:
            raise ValueError(f"shared_every must be >= 1, not {shared_every}")
        self.copy = copy
        self.engines = [open_store(s) for s in stores]
        if peers and self.engines[0].shared:
            raise ValueError(
                f"peers={peers} copies each node's share into other nodes' node-local stores, "
                f"but the first store, {self.engines[0].url}, is shared: put a node-local one "
                "first (lmdb:///dev/shm/NAME)"
            )
        self.shared_every = shared_every
        self._planned = 0  # saves planned on this rank (the coordinator's count decides)
        #: the copies into other nodes' stores (``peers``)
        self.peer_copies = PeerCopier(
            self.engines[0], peers, budget_bytes=peer_budget_bytes, timeout=replicate_timeout
        )
        #: the metadata of a save that ``latest()`` found held whole by the nodes' stores
        #: alone, for its ``reader()``
        self._held: HeldSave | None = None
        self.durable = None if durable is None else Path(durable).absolute()
        self.durable_every = durable_every
        self.keep_last = keep_last
        self.replicate_timeout = replicate_timeout
        if writer_options.get("checksums") is None:
            writer_options["checksums"] = any(e.checksums_by_default for e in self.engines)
        self.writer_options = writer_options
        self.part_bytes = min(int(e.max_value_bytes) for e in self.engines)
        # One thread, so each rank's copies run in save order and a commit job queued after
        # this rank's copy job of the same save runs after it.
        # Below training's priority: where the cores are busy training, the copies wait for
        # the steps instead of slowing them (``run_in_background``).
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="kvckpt-tiers", initializer=run_in_background
        )
        self._lock = threading.Lock()
        self._jobs: list[Future[None]] = []
        #: the first error of each save whose copy failed: one failed copy counts once, however
        #: many of its jobs (its copy, then its commit) fail because of it
        self._errors: dict[str, BaseException] = {}
        self._commits = 0
        self._failed: set[str] = set()  # saves whose copy failed in this process
        self._busy: Counter[str] = Counter()  # checkpoint id -> background jobs on it
        self._renew_lease: Callable[..., None] = _no_renewal  # the running job's lease
        self._prefetch: Future[Restore | None] | None = None
        #: where this rank's bytes came from in the last ``restore()``
        self.last_restore_stats: RestoreStats | None = None

    @property
    def stores(self) -> list[str]:
        return [e.url for e in self.engines]

    def __repr__(self) -> str:
        return f"Tiers({self.stores}, durable={self.durable})"

    # -- saving -------------------------------------------------------------------------------

    def writer(
        self, *, copy: str | None = None, shared: bool = False, **options: Any
    ) -> TieredStorageWriter:
        """A DCP ``StorageWriter`` for one save (``dcp.save`` / ``dcp.async_save``).

        ``copy`` overrides the ``Tiers``' own for this save: a loop that copies
        ``"newest"`` saves its last checkpoint with ``copy="every"``, so that it reaches every
        store even while an earlier copy is still running. ``shared=True`` sends this save to
        the further stores whatever ``shared_every`` says (a job's last checkpoint).

        Every rank calls it before each save. With ``peers``, the first call on a job of
        several processes learns the job's nodes and opens the copies' own process group:
        a collective of the default group."""
        if copy not in (None, "every", "newest"):
            raise ValueError(f'copy must be "every" or "newest", not {copy!r}')
        self.peer_copies.set_up()
        return TieredStorageWriter(
            self, copy=copy, shared=shared, **{**self.writer_options, **options}
        )

    def due_for_shared(self, asked: bool) -> bool:
        """On the coordinator, at a save's global plan: whether this save goes to the further
        stores and ``durable`` (every ``shared_every``-th, or ``asked``)."""
        self._planned += 1
        return asked or (self._planned - 1) % self.shared_every == 0

    def get_ready(self, state_dict: dict[str, Any]) -> None:
        """Get the node-local tier ready for this job's saves of ``state_dict`` while the
        first training steps run, so that the first save is as fast as the later ones
        (``KVStorageWriter.get_ready``). Returns at once."""
        self.writer().get_ready(state_dict)

    def _submit(self, job: Any, *args: Any, checkpoint_id: str, save_id: str) -> None:
        """Queue a background job on a save. While it is queued or running, the writers'
        ``keep_last`` leaves its checkpoint in the first tier (``busy_ids``), and a read lease
        there, taken now, renewed while the job runs and released when it ends, keeps the data
        of the save from any other retention (``gc``, a re-save of the id) meanwhile."""
        token = os.urandom(8).hex()
        engine = self.engines[0]
        take_read_lease(engine, checkpoint_id, token, self.replicate_timeout)
        with self._lock:
            self._busy[checkpoint_id] += 1

        def run() -> None:
            renew = LeaseRenewal(
                self.replicate_timeout,
                lambda: take_read_lease(engine, checkpoint_id, token, self.replicate_timeout),
            )
            self._renew_lease = renew
            try:
                renew(force=True)  # the job may have waited in the queue
                job(checkpoint_id, save_id, *args)
            except BaseException as e:
                logger.error("kvckpt tiers: %s", e)
                with self._lock:
                    self._errors.setdefault(save_id, e)
                    self._failed.add(save_id)  # a later job on this save need not wait for it
            finally:
                self._renew_lease = _no_renewal
                with self._lock:
                    self._busy[checkpoint_id] -= 1
                    if not self._busy[checkpoint_id]:
                        del self._busy[checkpoint_id]
                try:
                    release_read_lease(engine, checkpoint_id, token)
                except KVCheckpointError as e:  # it lapses by itself
                    logger.warning("could not release a read lease in %s: %s", engine.url, e)

        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(self._pool.submit(run))

    def busy_ids(self) -> set[str]:
        """Checkpoint ids whose background copies or exports are queued or running here."""
        with self._lock:
            return set(self._busy)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every background copy queued so far is done; raise the first error
        any of them met (``ReplicationError``), once."""
        with self._lock:
            jobs = list(self._jobs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            job.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        peer_errors = self.peer_copies.wait(
            None if deadline is None else max(0.0, deadline - time.monotonic())
        )
        with self._lock:
            errors, self._errors = [*self._errors.values(), *peer_errors], {}
        if errors:
            if isinstance(errors[0], UnsafeStoreError):
                raise errors[0]  # a store configured to lose data: what to fix, as it is
            raise ReplicationError(
                f"{len(errors)} background cop{'y' if len(errors) == 1 else 'ies'} failed; "
                f"the first: {errors[0]}"
            ) from errors[0]

    def close(self) -> None:
        """Wait for the background copies, then stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.peer_copies.close()

    # -- replication: what a TieredStorageWriter asks of its Tiers -----------------------------

    def plan_copies(
        self, checkpoint_id: str, save_id: str, lease: float, copy: str | None = None
    ) -> tuple[int, ...]:
        """On the coordinator, at a save's global plan (before any rank writes): the tiers the
        save will be copied to, each with the save registered as pending there; none with
        ``copy="newest"`` (this save's ``copy``, else the ``Tiers``') while the copy of an
        earlier save still runs: the save stays in the first tier."""
        if (copy or self.copy) == "newest" and self.busy_ids():
            logger.info(
                "kvckpt tiers: %r stays in %s only: the copy of an earlier save is running",
                checkpoint_id,
                self.engines[0].url,
            )
            return ()
        return self._register(checkpoint_id, save_id, lease)

    def copy_in_background(
        self,
        checkpoint_id: str,
        save_id: str,
        replicas: tuple[int, ...],
        locations: list[ItemLocation],
    ) -> None:
        """On each rank, once its values are in the first tier: queue their copy to the tiers
        ``replicas`` (``plan_copies``)."""
        self._submit(
            self._copy_keys, replicas, locations, checkpoint_id=checkpoint_id, save_id=save_id
        )

    def commit_in_background(
        self,
        checkpoint_id: str,
        save_id: str,
        replicas: tuple[int, ...],
        metadata: Metadata,
        locations: dict[MetadataIndex, ItemLocation],
        world_size: int,
        created_at: float,
    ) -> None:
        """On the coordinator, once the save is committed in the first tier: queue its commit
        in each of ``replicas`` (after every rank's values are there) and its export to the
        durable directory where one is due."""
        self._submit(
            self._commit_copies,
            replicas,
            metadata,
            locations,
            world_size,
            created_at,
            checkpoint_id=checkpoint_id,
            save_id=save_id,
        )

    def _register(self, checkpoint_id: str, save_id: str, lease: float) -> tuple[int, ...]:
        """Register a save as pending in every replica (before any rank writes); the tiers that
        could not take it (unreachable, locked) are left out of this save's copy."""
        ok = []
        for i, engine in enumerate(self.engines[1:], 1):
            try:
                engine.refuse_unsafe()  # a Redis that may evict: nothing is written there
                mark_pending(engine, checkpoint_id, save_id, None, lease)
                ok.append(i)
            except KVCheckpointError as e:
                # The save goes on in the fast tier; ``wait()`` reports the missing copy.
                logger.warning(
                    "checkpoint %r will not be copied to %s: %s", checkpoint_id, engine.url, e
                )
                refused = (
                    e
                    if isinstance(e, UnsafeStoreError)
                    else ReplicationError(f"checkpoint {checkpoint_id!r} not copied: {e}")
                )
                with self._lock:
                    self._errors.setdefault(save_id, refused)
        return tuple(ok)

    def _copy_keys(
        self,
        checkpoint_id: str,
        save_id: str,
        tiers: tuple[int, ...],
        locations: list[ItemLocation],
    ) -> None:
        """Copy one rank's values of a save from the first tier to ``tiers``."""
        started = time.perf_counter()
        copy_values(
            self.engines[0],
            [self.engines[i] for i in tiers],
            checkpoint_id,
            save_id,
            locations,
            self._renew_lease,
        )
        seconds, nbytes = time.perf_counter() - started, sum(loc.nbytes for loc in locations)
        rank = locations[0].rank if locations else None
        for i in tiers:
            events.emit(
                "copy", "write", checkpoint_id, self.engines[i].url, seconds,
                nbytes=nbytes, tier=i, rank=rank,
            )  # fmt: skip

    def _commit_copies(
        self,
        checkpoint_id: str,
        save_id: str,
        tiers: tuple[int, ...],
        metadata: Metadata,
        locations: dict[MetadataIndex, ItemLocation],
        world_size: int,
        created_at: float,
    ) -> None:
        """On the coordinator: commit the save in each replica once every rank's keys are
        there; then export it to the durable directory if this one is due."""
        self._commits += 1
        source = self.engines[0]
        failures: list[str] = []
        for i in tiers:
            dst = self.engines[i]
            committed = False
            try:
                if save_id in self._failed:
                    raise ReplicationError("this process's copy of its own keys failed (see above)")
                self._await_keys(dst, checkpoint_id, save_id, locations)
                phase = events.Phase("copy", "commit", checkpoint_id, dst.url, tier=i)
                publish(
                    dst,
                    metadata,
                    locations,
                    checkpoint_id=checkpoint_id,
                    save_id=save_id,
                    world_size=world_size,
                    created_at=created_at,
                )
                committed = True
                dst.sync_replicas()
                phase.end(sum(loc.nbytes for loc in locations.values()))
                if self.keep_last is not None:
                    collect_garbage(
                        dst,
                        keep_last=self.keep_last,
                        protect=[checkpoint_id],
                        incomplete_older_than=NEVER,
                        scan_orphans=False,
                        reuse=True,
                    )
                source = dst
            except KVCheckpointError as e:
                failures.append(f"{dst.url}: {e}")
                if not committed:
                    self._discard_copy(dst, checkpoint_id, save_id)
        if self.durable is not None and self._commits % self.durable_every == 0:
            try:
                self._export(source, checkpoint_id, created_at)
            except (KVCheckpointError, OSError) as e:
                failures.append(f"durable directory {self.durable}: {e}")
        if failures:
            raise ReplicationError(
                f"checkpoint {checkpoint_id!r} is committed in {self.engines[0].url} but not "
                f"in {'; '.join(failures)}"
            )

    def _await_keys(
        self,
        dst: Engine,
        checkpoint_id: str,
        save_id: str,
        locations: dict[MetadataIndex, ItemLocation],
    ) -> None:
        want = [
            (key, b - a)
            for loc in locations.values()
            for key, (a, b) in zip(
                loc.keys(dst.prefix, checkpoint_id, save_id),
                part_ranges(loc.nbytes, loc.part_bytes),
                strict=True,
            )
        ]
        deadline = time.monotonic() + self.replicate_timeout
        pause = 0.02
        while True:
            sizes = dst.value_sizes([k for k, _ in want])
            want = [(k, n) for (k, n), got in zip(want, sizes, strict=True) if got != n]
            if not want:
                return
            if time.monotonic() > deadline:
                raise ReplicationError(
                    f"{len(want)} values of checkpoint {checkpoint_id!r} never reached "
                    f"{dst.url} within {self.replicate_timeout:g} s (e.g. {want[0][0]!r}); did "
                    "a rank die before its copy finished?"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
            self._renew_lease()

    @staticmethod
    def _discard_copy(dst: Engine, checkpoint_id: str, save_id: str) -> None:
        """Best effort: a copy that will not commit leaves no data, pending entry or lease in
        the replica (values a slower rank still sends afterwards are orphans for gc)."""
        try:
            discard_save(dst, checkpoint_id, save_id)
        except KVCheckpointError as e:
            logger.warning(
                "could not remove the failed copy of %r from %s: %s (run gc)",
                checkpoint_id,
                dst.url,
                e,
            )

    def _export(self, source: Engine, checkpoint_id: str, created_at: float) -> None:
        """Export to ``<durable>/<id>``: written under a hidden name, then renamed, so the
        directory appears whole or not at all; a replaced one is renamed away before it is
        deleted, so a crash never leaves a half-deleted checkpoint under the real name."""
        assert self.durable is not None
        self.durable.mkdir(parents=True, exist_ok=True)
        final = self.durable / checkpoint_id
        tmp = self.durable / f".{checkpoint_id}.{os.getpid()}.tmp"
        old = self.durable / f".{checkpoint_id}.{os.getpid()}.old"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            export_checkpoint(source, checkpoint_id, tmp)
            (tmp / DURABLE_INFO).write_text(
                json.dumps({"checkpoint_id": checkpoint_id, "created_at": created_at})
            )
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)

    # -- restoring ----------------------------------------------------------------------------

    def prefetch(
        self,
        *,
        local_rank: int | None = None,
        node_rank: int | None = None,
        ranks_per_node: int | None = None,
        force: bool = False,
    ) -> Future[Restore | None] | None:
        """Start bringing this node's share of the newest checkpoint from a shared tier into
        the first (node-local) tier, in the background; ``latest()`` and ``restore()`` wait for
        it, then read local memory.

        Call it at the top of the training script, right after constructing ``Tiers``: the copy
        then runs while the rest of the start-up does (process group, model, optimizer). It
        needs no process group. One process per node copies, local rank 0 (``local_rank``, by
        default torchrun's ``LOCAL_RANK``); the others return None at once, as does a
        ``Tiers`` of one store or whose first store is shared.

        This node's share is what the ranks of this node wrote when the checkpoint was saved,
        ranks ``node_rank * ranks_per_node`` to ``(node_rank + 1) * ranks_per_node - 1``: what
        its store held before the node was replaced, and what a restore with the same world
        size reads there. The rest lies in the other nodes' stores, which ``restore()`` reads
        through them. ``node_rank`` defaults to torchrun's ``GROUP_RANK`` (else 0) and
        ``ranks_per_node`` to its ``LOCAL_WORLD_SIZE``; where neither is known, the share is the
        whole checkpoint. Values the store already holds whole are not fetched again, so on a
        plain restart (the store survived) a prefetch reads no data.

        A prefetch never slows a restart down. It runs only where the node has a core its ranks
        leave free (``kvckpt.node.spare_cores``: a GPU node), on one thread below training's
        priority. Where every core is busy starting the job up, a copy into local memory could
        only compete with the start-up, and the restore reads the shared tier directly, which
        moves each byte once instead of twice; ``prefetch()`` then returns None (``force=True``
        copies all the same).

        The future's result is the checkpoint it brought values of, read from the first tier
        (None when there was nothing to bring: no checkpoint in a shared tier, only one in the
        durable directory, or every value of the share already local). When the copy fails,
        ``result()`` raises the copy's error; the copy leaves nothing behind, and ``restore()``
        logs the error and reads those values from the shared tier.
        """
        if local_rank is None:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank != 0 or self.engines[0].shared or len(self.engines) == 1:
            return None
        if self.peer_copies.peers:
            # The restore reads a replaced node's share from the stores of the nodes that
            # keep copies of it, each byte once, over the restore's own exchange; a prefetch
            # from the shared tier would bring an older checkpoint, or move the bytes twice.
            logger.info(
                "kvckpt tiers: no prefetch with peers=%d: the restore reads this node's share "
                "from its peers' stores",
                self.peer_copies.peers,
            )
            return None
        if node_rank is None:
            node_rank = int(os.environ.get("GROUP_RANK", "0"))
        if ranks_per_node is None and "LOCAL_WORLD_SIZE" in os.environ:
            ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        share = (
            None
            if ranks_per_node is None
            else range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node)
        )
        if not force and spare_cores(ranks_per_node) < 1:
            logger.info(
                "kvckpt tiers: no prefetch: every core of this node has a rank to start; the "
                "restore reads the shared tier directly"
            )
            return None
        with self._lock:
            if self._prefetch is None:
                self._prefetch = self._pool.submit(self._bring_share, share)
            return self._prefetch

    def _bring_share(self, share: range | None) -> Restore | None:
        return bring_share(self.engines, self.durable, share, self.replicate_timeout)

    def _await_prefetch(self) -> None:
        if self._prefetch is None:
            return
        try:
            self._prefetch.result()
        except Exception as e:
            logger.warning("kvckpt tiers: prefetch failed, restoring from the shared tier: %s", e)

    def latest(self, *, before: float | None = None) -> Restore | None:
        """The newest complete checkpoint in any tier, and the fastest tier holding its metadata
        (of those saved before ``before``, a ``created_at``, where given).

        Collective when ``torch.distributed`` is initialised: rank 0 chooses and every rank
        gets the same answer. In a job of several nodes (``kvckpt.node``), a node-local store
        is not searched for a newer checkpoint than the shared tiers hold, since it holds only
        its own node's part; ``restore()`` still reads every item it holds. Waits for this
        process's ``prefetch()``.
        """
        self._await_prefetch()
        self._held = None
        if not (dist.is_available() and dist.is_initialized()):
            return choose_newest(self.engines, self.durable, True, before)
        nodes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node_id())
        single_host = len(set(nodes)) == 1
        choice = [
            choose_newest(self.engines, self.durable, single_host, before)
            if dist.get_rank() == 0
            else None
        ]
        dist.broadcast_object_list(choice, src=0)
        newest: Restore | None = choice[0]
        node_local = not self.engines[0].shared
        if node_local and (self.peer_copies.peers or self.shared_every > 1) and not single_host:
            # the nodes' stores between them may hold a newer save than any shared tier
            held = newest_held_whole(
                self.engines[0], None if newest is None else newest.created_at, before
            )
            if held is not None:
                self._held = held
                newest = Restore(held.checkpoint_id, 0, self.engines[0].url, held.created_at)
        return newest

    def reader(self, choice: Restore, **options: Any) -> StorageReader:
        """The DCP ``StorageReader`` for a choice of ``latest()``: one that reads each item
        from the nearest tier holding it (``TieredStorageReader``), or the durable directory's."""
        if choice.tier < len(self.engines):
            held = self._held
            chosen = (choice.checkpoint_id, choice.created_at)
            options.setdefault("budget_bytes", self.peer_copies.budget_bytes)
            return TieredStorageReader(
                self.engines,
                checkpoint_id=choice.checkpoint_id,
                created_at=choice.created_at,
                metadata=None
                if held is None or (held.checkpoint_id, held.created_at) != chosen
                else held.metadata,
                **options,
            )
        return DirectoryReader(choice.source, **options)

    def restore(self, state_dict: dict[str, Any], **load_options: Any) -> Restore | None:
        """Load the newest checkpoint into ``state_dict`` in place (``dcp.load``); returns what
        was loaded, or None when no tier holds a checkpoint (a fresh start).

        Each byte comes from the nearest place that holds it (``TieredStorageReader``): this
        node's store, another node's (sent over the process group), then the shared tiers.
        ``last_restore_stats`` then says where this rank's bytes came from."""
        phase = events.Phase("restore", "choose", "", "")
        choice = self.latest()
        while choice is not None:
            phase.checkpoint_id, phase.store, phase.tier = (
                choice.checkpoint_id,
                choice.source,
                choice.tier,
            )
            phase.end()
            reader = self.reader(choice)
            try:
                self._load(state_dict, reader, load_options)
            except CheckpointException as e:
                # Damaged copies left items of this save with no holder: every rank raised
                # NotHeldError (the reader told them all), so every rank goes back to an
                # older save, if there is one.
                not_held = all(isinstance(f, NotHeldError) for f, _ in e.failures.values())
                if not (not_held and isinstance(reader, TieredStorageReader) and reader.distrusted):
                    raise
                older = self.latest(before=choice.created_at)
                if older is None:
                    raise
                logger.warning(
                    "kvckpt restore: no store holds %r whole once its damaged copies are set "
                    "aside; restoring %r instead",
                    choice.checkpoint_id,
                    older.checkpoint_id,
                )
                choice, phase = older, events.Phase("restore", "choose", "", "")
                continue
            if isinstance(reader, TieredStorageReader):
                self.last_restore_stats = reader.stats
            return choice
        return None

    def _load(
        self, state_dict: dict[str, Any], reader: StorageReader, load_options: dict[str, Any]
    ) -> None:
        """``dcp.load``, again where a damaged copy failed it (every rank raised it, so every
        rank loads again): the next load reads what the copy could not serve elsewhere. Each
        load sets aside at least one more copy: K + 1 holders of an item take K + 1 loads."""
        loads = self.peer_copies.peers + 2
        for attempt in range(1, loads + 1):
            try:
                dcp.load(state_dict, storage_reader=reader, **load_options)
                return
            except CheckpointException as e:
                damaged = [f for f, _ in e.failures.values() if isinstance(f, DamagedCopyError)]
                if attempt == loads or len(damaged) != len(e.failures):
                    raise
                if not dist.is_initialized() or dist.get_rank() == 0:
                    logger.warning("kvckpt restore: %s", damaged[0])


def _no_renewal(force: bool = False) -> None:
    """No background job is running: nothing to renew."""
