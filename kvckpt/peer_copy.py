"""Peer copies: each node's share of a checkpoint, in the node-local stores of K other nodes.

``Tiers(peers=K)`` keeps every checkpoint where a replaced node can get it back without the
shared tier: once a save has committed in the node-local stores, each rank sends what it wrote
to one rank of each of its node's K targets (``kvckpt.placement``), which writes it into its
own node's store under the same keys. The restore then counts those stores as holders, like
the node's own.

How a copy stays correct and out of training's way:

- **Its own process group.** The copies travel over a gloo group of their own, on a thread of
  their own, so a copy never blocks a training step or one of training's collectives.
- **One copy per save, or none, in step on every rank.** The coordinator decides at the
  save's plan that a save is copied (one of every rank of the job); every rank then queues
  the copy as its write starts, and the copies run in save order. Each begins with an
  all-gather of what every rank wrote (and which save it is copying: ranks out of step stop
  the copies for the job rather than mix two saves); a rank whose write failed means no
  commit, and every rank skips together. Only then does the coordinator say whether the save
  committed (it waits for its commit) and every rank go on or skip together.
- **Bytes moved once, within a budget.** A sender hands the store's own memory to the group
  (LMDB lends its map), a receiver lands each chunk in a buffer it reuses for every chunk of
  the copy and writes it into its store;
  a rank holds at most ``budget_bytes`` of chunks in flight at once (or one part, where a part
  is larger than its share of the budget).
- **Checked on arrival, committed last.** Each part is checked against the checksum its save
  recorded before it is written, and a chunk that does not match is not stored. The copy is
  recorded as held (an index entry of the share's ranks, origin ``peer``) once every rank's
  part of it arrived whole, and the coordinator's metadata follows (``peer_meta_key``); a copy
  that failed anywhere is deleted everywhere. (A restore counts a store's items by their keys,
  each whole value of the save's own, checked again as it is read.)
- **A failed copy never fails the save.** It is logged, emitted as a ``peer``/``failed``
  event, and reported by ``Tiers.wait()``; the next save copies afresh. Only the group itself
  failing (a peer gone) stops the copies for the rest of the job. Retention reaches the copies
  at the next copy: it drops the peer shares of saves the coordinator no longer keeps.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from . import events
from .adapter import byte_tensor, byte_view
from .catalog import (
    PEER,
    Index,
    LeaseRenewal,
    _new_token,
    peer_meta_key,
    pending_name,
    read_index,
    release_read_lease,
    remote_entry,
    take_read_lease,
    update_index,
)
from .engines.base import Engine
from .errors import IntegrityError, ReplicationError
from .format import checksum
from .keys import ItemLocation, data_prefix
from .node import node_id, run_in_background
from .placement import Topology

logger = logging.getLogger(__name__)

#: Bytes of chunks a rank holds in flight at once, by default (``Tiers(peer_budget_bytes=)``).
DEFAULT_BUDGET = 256 << 20
#: How long a copy waits for the coordinator's commit, or for a peer, before giving up.
DEFAULT_TIMEOUT = 600.0


@dataclass
class _Outcome:
    """What the coordinator tells every rank about a save, once every rank wrote its part."""

    committed: bool
    metadata: bytes | None = None  # the encoded metadata (the coordinator's meta value)
    live: frozenset[tuple[str, str]] = frozenset()  # the saves the coordinator keeps


@dataclass
class _Report:
    """One rank's contribution to a copy's first all-gather: a few bytes, whatever the job's
    size (what each rank wrote goes only to the ranks that copy it, ``_swap_locations``)."""

    checkpoint_id: str
    save_id: str
    ok: bool


@dataclass(frozen=True)
class _Part:
    key: str
    nbytes: int
    checksum: int | None


class PeerCopier:
    """The peer copies of one ``Tiers`` on one rank: their group, their thread, their queue."""

    def __init__(
        self,
        engine: Engine,
        peers: int,
        *,
        budget_bytes: int = DEFAULT_BUDGET,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if peers < 0:
            raise ValueError(f"peers must be >= 0, not {peers}")
        if budget_bytes < 1:
            raise ValueError(f"peer_budget_bytes must be at least 1, not {budget_bytes}")
        self.engine = engine
        self.peers = peers
        self.budget_bytes = budget_bytes
        #: the most bytes of chunks this rank held in flight at once, over every copy: within
        #: ``budget_bytes``, or one part per stream where a part is larger than its share
        self.peak_buffered = 0
        self.timeout = timeout
        self.topology: Topology | None = None
        self._group: Any = None
        self._chunk = budget_bytes
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="kvckpt-peers", initializer=run_in_background
        )
        self._lock = threading.Lock()
        self._jobs: list[Future[None]] = []
        self._errors: list[BaseException] = []
        self._outcomes: dict[str, tuple[threading.Event, list[_Outcome]]] = {}
        self._set_up = False
        #: Why the copies stopped for the rest of the job (their group failed, or the ranks
        #: fell out of step), or None.
        self._broken: str | None = None

    # -- set-up (collective, training's thread) ---------------------------------------------

    @property
    def active(self) -> bool:
        """Whether this job copies to peers: ``peers`` asked for, another node there, and the
        copies' group working."""
        return self.peers > 0 and self._group is not None and self._broken is None

    def set_up(self) -> None:
        """Learn the job's nodes and open the copies' group, once, on every rank at once
        (``Tiers.writer()``, called by every rank before each save): a collective of the
        default group, which no other thread may be using meanwhile."""
        if self.peers == 0 or self._set_up:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        self._set_up = True
        nodes: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node_id())
        topology = Topology(tuple(str(n) for n in nodes))
        if len(topology.order) < 2:
            logger.warning(
                "kvckpt tiers: peers=%d, but every rank of this job runs on node %r: there is "
                "no other node to copy to, so saves are kept as without peers",
                self.peers,
                topology.order[0],
            )
            return
        # Longer than a copy waits for the coordinator's commit: a rank never gives up on a
        # collective that the others are still about to join.
        group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=2 * self.timeout + 60)
        )
        # the budget, shared by the most streams any rank runs at once: the same on every rank
        streams = max(
            len(topology.sends(r, self.peers)) + len(topology.receives(r, self.peers))
            for r in range(len(topology.nodes))
        )
        self._chunk = max(1, self.budget_bytes // max(1, streams))
        self.topology, self._group = topology, group

    # -- the queue --------------------------------------------------------------------------

    def submit(
        self, checkpoint_id: str, save_id: str, written: Callable[[], list[ItemLocation] | None]
    ) -> None:
        """Queue this rank's part of a save's copy (every rank of a save that spans the job,
        as its write starts). ``written()`` blocks until the rank's write is done: its
        locations, or None if it failed."""
        if not self.active:
            return
        # Retention leaves the data of a save being copied in place while the copy renews
        # this lease (a lease that lapsed lets it go: the copy then fails, detected).
        token = _new_token()
        try:
            take_read_lease(self.engine, checkpoint_id, token, self.timeout)
        except Exception:
            token = ""  # a store that refuses it: the copy finds out if data goes missing
        job = self._pool.submit(self._copy, checkpoint_id, save_id, written, token)
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(job)

    def busy(self) -> bool:
        """Whether a copy is queued or running here: the coordinator copies a new save only
        when none is, as ``Tiers(copy="newest")`` does for the shared tier, so that copies
        never queue up behind a loop that saves faster than they go (each queued copy would
        also keep its save in the store, past ``keep_last``)."""
        with self._lock:
            return any(not job.done() for job in self._jobs)

    def decided(self, save_id: str, outcome: _Outcome) -> None:
        """On the coordinator: whether a save committed, which its copy waits for."""
        with self._lock:
            event, box = self._outcomes.setdefault(save_id, (threading.Event(), []))
        box.append(outcome)
        event.set()

    def committed(self, save_id: str, metadata: bytes | None, live: set[tuple[str, str]]) -> None:
        self.decided(save_id, _Outcome(True, metadata, frozenset(live)))

    def not_committed(self, save_id: str) -> None:
        self.decided(save_id, _Outcome(False))

    def wait(self, timeout: float | None = None) -> list[BaseException]:
        """Block until every copy queued so far is done; return their errors, once."""
        with self._lock:
            jobs = list(self._jobs)
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            job.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
            self._group = None

    # -- one save's copy (the copies' thread, every rank) --------------------------------------

    def _copy(
        self,
        checkpoint_id: str,
        save_id: str,
        written: Callable[[], list[ItemLocation] | None],
        lease: str,
    ) -> None:
        started = time.perf_counter()
        renew: Callable[..., None] = _no_renewal
        if lease:
            renew = LeaseRenewal(
                self.timeout,
                lambda: take_read_lease(self.engine, checkpoint_id, lease, self.timeout),
            )
        try:
            nbytes = self._exchange(checkpoint_id, save_id, written, renew)
        except BaseException as e:
            logger.error("kvckpt tiers: %s", e)
            events.emit("peer", "failed", checkpoint_id, self.engine.url, 0.0, rank=dist.get_rank())
            error = (
                e
                if isinstance(e, ReplicationError)
                else ReplicationError(f"the peer copy of checkpoint {checkpoint_id!r} failed: {e}")
            )
            with self._lock:
                self._errors.append(error)
            return
        finally:
            with self._lock:
                self._outcomes.pop(save_id, None)
            if lease:
                with contextlib.suppress(Exception):  # it lapses by itself
                    release_read_lease(self.engine, checkpoint_id, lease)
        if nbytes is not None:
            events.emit(
                "peer", "copy", checkpoint_id, self.engine.url,
                time.perf_counter() - started, nbytes=nbytes, rank=dist.get_rank(),
            )  # fmt: skip

    def _outcome(self, save_id: str) -> _Outcome:
        with self._lock:
            event, box = self._outcomes.setdefault(save_id, (threading.Event(), []))
        if not event.wait(self.timeout):
            return _Outcome(False)
        return box[0]

    def _exchange(
        self,
        checkpoint_id: str,
        save_id: str,
        written: Callable[[], list[ItemLocation] | None],
        renew: Callable[..., None],
    ) -> int | None:
        """The copy itself; returns the bytes this rank received, or None where the save
        is skipped."""
        topology, group = self.topology, self._group
        assert topology is not None
        try:
            mine = written()
        except BaseException:
            mine = None
        me = dist.get_rank()
        # 1. What every rank wrote (no waiting: a rank whose write failed means no commit).
        report = _Report(checkpoint_id, save_id, mine is not None)
        reports: list[_Report | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report, group=group)
        saves = {(r.checkpoint_id, r.save_id) for r in reports if r is not None}
        if len(saves) != 1:
            self._broken = "the ranks' copies fell out of step"
            raise ReplicationError(
                f"peer copies stop for the rest of this job: the ranks are copying different "
                f"saves ({sorted(saves)[:4]}), after an earlier copy failed on some of them"
            )
        if not all(r is not None and r.ok for r in reports):
            return None
        # 2. Whether the save committed: the coordinator knows once its commit is done.
        box: list[_Outcome | None] = [self._outcome(save_id) if me == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        outcome = box[0]
        if outcome is None or not outcome.committed:
            return None
        self._tidy(checkpoint_id, save_id, outcome)
        targets, sources = topology.sends(me, self.peers), topology.receives(me, self.peers)
        theirs = self._swap_locations(mine or [], targets, sources)
        sends = [(to, self._parts(mine or [], checkpoint_id, save_id)) for to in targets]
        receives = [(src, self._parts(theirs[src], checkpoint_id, save_id)) for src in sources]
        trouble: list[str] = []
        try:
            received = self._move(sends, receives, trouble, renew)
            # 3. A copy counts only where every rank's part of it arrived whole.
            failures: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(failures, trouble, group=group)
        except BaseException as e:  # the group failed mid-copy: what arrived is not a copy
            with contextlib.suppress(Exception):
                self.engine.delete([p.key for _, parts in receives for p in parts])
            if not isinstance(e, Exception):
                raise
            if not isinstance(e, ReplicationError):  # the copies' group itself failed
                self._broken = f"the copies' process group failed: {e}"
                e = ReplicationError(
                    f"peer copies stop for the rest of this job: {self._broken} (a peer gone?)"
                )
            raise ReplicationError(
                f"the peer copy of checkpoint {checkpoint_id!r} is kept nowhere: {e}"
            ) from e
        failed = [f"rank {r}: {why}" for r, errs in enumerate(failures) for why in errs or []]
        if failed:
            with contextlib.suppress(Exception):
                self.engine.delete([p.key for _, parts in receives for p in parts])
            raise ReplicationError(
                f"the peer copy of checkpoint {checkpoint_id!r} is not kept anywhere: "
                + "; ".join(failed[:3])
                + (f" (and {len(failed) - 3} more)" if len(failed) > 3 else "")
            )
        ranks = sorted(src for src, _ in receives)
        if ranks or self._keeps_metadata(topology, me):
            self._commit(checkpoint_id, save_id, ranks, outcome, topology, me)
        return received

    def _swap_locations(
        self, mine: list[ItemLocation], targets: list[int], sources: list[int]
    ) -> dict[int, list[ItemLocation]]:
        """Send what this rank wrote to the ranks that copy it, and learn what each of its
        sources wrote: point to point, so that each rank hears of K shares, not the job's."""
        payload = msgpack.packb([loc.to_fields() for loc in mine])
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        try:
            self._run([(dist.isend, size, to) for to in targets] +
                      [(dist.irecv, sizes[src], src) for src in sources])  # fmt: skip
            into = {src: torch.empty(int(sizes[src].item()), dtype=torch.uint8) for src in sources}
            self._run([(dist.isend, data, to) for to in targets] +
                      [(dist.irecv, into[src], src) for src in sources])  # fmt: skip
        except Exception as e:
            self._broken = f"the copies' process group failed: {e}"
            raise ReplicationError(
                f"peer copies stop for the rest of this job: {self._broken} (a peer gone?)"
            ) from e
        return {
            src: [
                ItemLocation.from_fields(fields)
                for fields in msgpack.unpackb(into[src].numpy().tobytes(), raw=False)
            ]
            for src in sources
        }

    def _run(self, ops: list[tuple[Callable[..., Any], torch.Tensor, int]]) -> None:
        works = dist.batch_isend_irecv(
            [dist.P2POp(op, t, peer, self._group) for op, t, peer in ops]
        )
        for work in works if ops else []:
            work.wait()

    def _parts(
        self, locations: Sequence[ItemLocation], checkpoint_id: str, save_id: str
    ) -> list[_Part]:
        parts = []
        for loc in locations:
            keys = loc.keys(self.engine.prefix, checkpoint_id, save_id)
            for p, key in enumerate(keys):
                size = min(loc.part_bytes, loc.nbytes - p * loc.part_bytes)
                parts.append(_Part(key, size, loc.checksums[p] if loc.checksums else None))
        return parts

    def _move(
        self,
        sends: list[tuple[int, list[_Part]]],
        receives: list[tuple[int, list[_Part]]],
        trouble: list[str],
        renew: Callable[..., None],
    ) -> int:
        """Send and receive every stream, chunk by chunk: in step s every rank posts the s-th
        chunk of each of its streams, so no rank waits on one that has not posted yet.

        A part that cannot be sent whole goes as zeros, and a chunk that arrives damaged or
        cannot be stored is not kept: either way the rank goes on to the last step, so that no
        other rank waits for it, and says why in ``trouble``; the copy is then kept nowhere.
        Only the group itself failing (a peer gone) ends the copies for the job."""
        out = [(to, _chunks(parts, self._chunk)) for to, parts in sends]
        into = [(src, _chunks(parts, self._chunk)) for src, parts in receives]
        steps = max([len(c) for _, c in out] + [len(c) for _, c in into] + [0])
        steps = self._max_steps(steps)
        received = 0
        # One landing buffer per stream, each its largest chunk, taken once for every step: a
        # new buffer per step would leave the allocator's freed ones resident besides.
        widths = [max(_nbytes(chunk) for chunk in c) if c else 0 for _, c in into]
        arena = torch.empty(sum(widths), dtype=torch.uint8)
        starts = [sum(widths[:i]) for i in range(len(widths))]
        for step in range(steps):
            try:
                renew()
            except Exception as e:  # the copy goes on to its last step, then counts for nothing
                trouble.append(f"the copy's read lease on {self.engine.url} lapsed: {e}")
            sending = [(to, c[step]) for to, c in out if step < len(c)]
            landing = [
                (src, c[step], arena[start : start + _nbytes(c[step])])
                for (src, c), start in zip(into, starts, strict=True)
                if step < len(c)
            ]
            held = sum(buffer.numel() for _, _, buffer in landing)
            self.peak_buffered = max(self.peak_buffered, held)
            with self._lent([p for _, parts in sending for p in parts], trouble) as views:
                ops: list[Any] = []
                at = 0
                for to, parts in sending:
                    for tag, part in enumerate(parts):
                        if part.nbytes:
                            tensor = byte_tensor(views[at])
                            ops.append(dist.P2POp(dist.isend, tensor, to, self._group, tag=tag))
                        at += 1
                for src, parts, buffer in landing:
                    start = 0
                    for tag, part in enumerate(parts):
                        if part.nbytes:
                            piece = buffer[start : start + part.nbytes]
                            ops.append(dist.P2POp(dist.irecv, piece, src, self._group, tag=tag))
                        start += part.nbytes
                try:
                    for work in dist.batch_isend_irecv(ops) if ops else []:
                        work.wait()
                except Exception as e:
                    self._broken = f"the copies' process group failed: {e}"
                    raise ReplicationError(
                        f"peer copies stop for the rest of this job: {self._broken} (a peer gone?)"
                    ) from e
            for _, parts, buffer in landing:
                if trouble:
                    continue  # not kept anyway
                try:
                    received += self._store(parts, buffer)
                except Exception as e:
                    trouble.append(str(e))
        return received

    @contextlib.contextmanager
    def _lent(self, parts: list[_Part], trouble: list[str]) -> Iterator[list[memoryview]]:
        """The store's own memory of each part to send, for the length of one step; zeros,
        and a word in ``trouble``, for a part it cannot lend whole."""
        lending = contextlib.ExitStack()
        views: Sequence[memoryview | None]
        try:
            views = lending.enter_context(self.engine.borrow([p.key for p in parts]))
        except Exception as e:
            trouble.append(f"cannot read {self.engine.url}: {e}")
            views = [memoryview(bytearray(p.nbytes)) for p in parts]
        with lending:
            checked: list[memoryview] = []
            for part, view in zip(parts, views, strict=True):
                if view is None or view.nbytes != part.nbytes:
                    trouble.append(f"{self.engine.url} no longer holds {part.key!r} whole")
                    view = memoryview(bytearray(part.nbytes))
                checked.append(view)
            yield checked

    def _max_steps(self, steps: int) -> int:
        """Every rank runs as many steps as the rank with the most: the same on all."""
        count = torch.tensor([steps], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._group)
        return int(count.item())

    def _store(self, parts: list[_Part], buffer: torch.Tensor) -> int:
        """Check each received part against its checksum, then write them into this node's
        store (one write per chunk)."""
        view = byte_view(buffer)
        items = []
        start = 0
        for part in parts:
            piece = view[start : start + part.nbytes]
            start += part.nbytes
            if part.checksum is not None and checksum(piece) != part.checksum:
                raise IntegrityError(
                    f"{part.key!r} arrived with a checksum that does not match the one its save "
                    "recorded"
                )
            items.append((part.key, piece))
        self.engine.put_many(items)
        return start

    def _keeps_metadata(self, topology: Topology, rank: int) -> bool:
        """Whether this rank writes the checkpoint's metadata into its node's store: the
        lowest rank of each node that keeps copies of the coordinator's node's share."""
        node = topology.nodes[rank]
        return node in topology.targets(topology.nodes[0], self.peers) and (
            topology.ranks_of(node)[0] == rank
        )

    def _tidy(self, checkpoint_id: str, save_id: str, outcome: _Outcome) -> None:
        """Before a copy adds to the store: drop the peer shares (and their metadata) of saves
        the coordinator no longer keeps, whether or not this copy then succeeds."""
        engine = self.engine
        stale = {
            name: e
            for name, e in read_index(engine).remote.items()
            if e.get("origin") == PEER
            and (e.get("checkpoint_id"), e.get("save_id")) not in outcome.live
            and (e.get("checkpoint_id"), e.get("save_id")) != (checkpoint_id, save_id)
        }
        if not stale:
            return

        def change(idx: Index) -> None:
            for name in stale:
                idx.remote.pop(name, None)

        update_index(engine, change)
        for e in stale.values():
            cid, sid, rank = e.get("checkpoint_id"), e.get("save_id"), e.get("rank")
            if isinstance(cid, str) and isinstance(sid, str) and isinstance(rank, int):
                engine.delete_prefix(f"{data_prefix(engine.prefix, cid, sid)}{rank}/")
                engine.delete([peer_meta_key(engine.prefix, cid, sid)])

    def _commit(
        self,
        checkpoint_id: str,
        save_id: str,
        ranks: list[int],
        outcome: _Outcome,
        topology: Topology,
        me: int,
    ) -> None:
        """Record the shares received as held and (the coordinator's node's targets) keep
        its metadata: the last writes of a copy."""
        engine = self.engine
        now = time.time()

        def change(idx: Index) -> None:
            for rank in ranks:
                idx.remote[pending_name(checkpoint_id, save_id, rank)] = remote_entry(
                    checkpoint_id, save_id, rank, PEER, now
                )

        if ranks:
            update_index(engine, change)
        if self._keeps_metadata(topology, me) and outcome.metadata:
            key = peer_meta_key(engine.prefix, checkpoint_id, save_id)
            metadata = outcome.metadata
            engine.transact([key], lambda _: {key: metadata})


def _nbytes(parts: list[_Part]) -> int:
    """One chunk's bytes."""
    return sum(p.nbytes for p in parts)


def _no_renewal(force: bool = False) -> None:
    """A copy that holds no lease: nothing to renew."""


def _chunks(parts: list[_Part], limit: int) -> list[list[_Part]]:
    """Consecutive parts, at most ``limit`` bytes a chunk (one part at least)."""
    out: list[list[_Part]] = []
    size = 0
    for part in parts:
        if out and size + part.nbytes <= limit:
            out[-1].append(part)
            size += part.nbytes
        else:
            out.append([part])
            size = part.nbytes
    return out
