"""The catalog of a namespace: which checkpoints are committed, which saves are in flight.

One small key, ``{P}/index``, holds a msgpack summary of every committed checkpoint and every
save that has started but not committed. The commit updates it in the same atomic transaction
as the metadata key, so listing 1,000 checkpoints reads one value and never scans data keys, and
a save that crashed before its commit is still known (as *pending*) to ``gc``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from .engines.base import Engine
from .errors import (
    CheckpointLockedError,
    MetadataError,
    ReadOnlyStoreError,
    SaveAbandonedError,
    StoreFullError,
)
from .format import CheckpointRecord, decode_data_keys, decode_metadata, encode_metadata
from .keys import ItemLocation, data_prefix, meta_key, meta_prefix, parse_meta_key

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

logger = logging.getLogger(__name__)

INDEX_MAGIC = "kvckpt-index"
INDEX_VERSION = 1


def index_key(prefix: str) -> str:
    return f"{{{prefix}}}/index"


def entry_name(checkpoint_id: str, rank: int | None) -> str:
    """An index entry's name: the metadata key without the ``{P}/meta/`` head."""
    return checkpoint_id if rank is None else f"{checkpoint_id}/rank/{rank}"


def pending_name(checkpoint_id: str, save_id: str, rank: int | None) -> str:
    return f"{checkpoint_id}/{save_id}/{'all' if rank is None else rank}"


@dataclass
class Index:
    """The decoded ``{P}/index`` value."""

    checkpoints: dict[str, dict[str, Any]]
    pending: dict[str, dict[str, Any]]
    #: saves whose metadata is gone but whose data a reader may still be loading
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: a node-local store that is not the coordinator's: the saves whose data ranks on this
    #: node wrote (their metadata is in the coordinator's store)
    remote: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def decode(cls, raw: bytes | None, *, where: str) -> Index:
        if raw is None:
            return cls({}, {})
        try:
            doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as e:
            raise MetadataError(
                f"the checkpoint index of {where} is corrupt ({type(e).__name__}); rebuild it "
                "with `kvckpt gc URL` (checkpoints themselves are unaffected)"
            ) from None
        if (
            not isinstance(doc, dict)
            or doc.get("magic") != INDEX_MAGIC
            or not isinstance(doc.get("checkpoints"), dict)
            or not isinstance(doc.get("pending"), dict)
            or not all(isinstance(v, dict) for v in doc["checkpoints"].values())
            or not all(isinstance(v, dict) for v in doc["pending"].values())
        ):
            raise MetadataError(
                f"the checkpoint index of {where} is malformed; rebuild it with `kvckpt gc URL`"
            )
        if not isinstance(doc.get("version"), int) or doc["version"] > INDEX_VERSION:
            raise MetadataError(
                f"the checkpoint index of {where} has version {doc.get('version')!r}, newer "
                f"than this kvckpt reads ({INDEX_VERSION}): upgrade kvckpt"
            )
        optional = []
        for name in ("retired", "remote"):
            value = doc.get(name, {})
            if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                value = {}  # optional fields: data they named is found by gc's orphan scan
            optional.append(value)
        return cls(doc["checkpoints"], doc["pending"], *optional)

    def live_saves(self, *, remote: bool = False) -> set[tuple[str, str]]:
        """(checkpoint id, save id) of every save whose data must stay: committed, pending and
        retired ones, and with ``remote`` those other nodes' ranks recorded here."""
        parts = [self.checkpoints, self.pending, self.retired]
        if remote:
            parts.append(self.remote)
        return {
            (e["checkpoint_id"], e["save_id"])
            for part in parts
            for e in part.values()
            if isinstance(e.get("checkpoint_id"), str) and isinstance(e.get("save_id"), str)
        }

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "magic": INDEX_MAGIC,
                "version": INDEX_VERSION,
                "checkpoints": self.checkpoints,
                "pending": self.pending,
                "retired": self.retired,
                "remote": self.remote,
            },
            use_bin_type=True,
        )


def summary(record: CheckpointRecord, expires_at: float | None = None) -> dict[str, Any]:
    """A checkpoint's index entry."""
    return {
        "checkpoint_id": record.checkpoint_id,
        "rank": record.rank,
        "save_id": record.save_id,
        "created_at": record.created_at,
        "total_bytes": record.total_bytes,
        "items": len(record.locations),
        "world_size": record.world_size,
        "expires_at": expires_at,
    }


def read_index(engine: Engine) -> Index:
    return Index.decode(engine.get(index_key(engine.prefix)), where=engine.url)


def update_index(
    engine: Engine,
    change: Callable[[Index], bool | None],
    *,
    watch: tuple[str, ...] = (),
    extra: Callable[[list[bytes | None]], dict[str, bytes | None]] | None = None,
) -> None:
    """Atomically apply ``change`` to the index, together with ``extra`` writes to ``watch``
    (``extra`` runs first and gets the watched keys' current values). A ``change`` that returns
    False writes nothing at all: the work was already done.

    Both may run more than once, and the last run counts: the engine runs them again when a
    watched key changed meanwhile, and a Redis client also when the connection dropped after
    the server applied an earlier run but before its reply arrived. So each must be idempotent:
    a run that finds its own work already applied must recognise it (``commit`` does).
    """
    key = index_key(engine.prefix)

    def update(current: list[bytes | None]) -> dict[str, bytes | None]:
        index = Index.decode(current[0], where=engine.url)
        # ``extra`` sees the watched values first, so ``change`` can act on what it found.
        writes = {} if extra is None else extra(current[1:])
        if change(index) is False:
            return {}
        writes[key] = index.encode()
        return writes

    engine.transact([key, *watch], update)


def lease_key(prefix: str, checkpoint_id: str, rank: int | None = None) -> str:
    key = f"{{{prefix}}}/lease/{checkpoint_id}"
    return key if rank is None else f"{key}/rank/{rank}"


def _decode_lease(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        lease = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None  # an unreadable lease protects nothing
    return lease if isinstance(lease, dict) else None


def mark_pending(
    engine: Engine,
    checkpoint_id: str,
    save_id: str,
    rank: int | None,
    lease_seconds: float | None = None,
) -> None:
    """Record that a save has started, before any of its data is written, and take the
    checkpoint id's write lease: a second writer of the same id fails fast instead of
    interleaving its data. The lease expires, so a writer that crashed blocks nobody for long.
    """
    now = time.time()
    key = lease_key(engine.prefix, checkpoint_id, rank)

    def change(index: Index) -> None:
        index.pending[pending_name(checkpoint_id, save_id, rank)] = {
            "checkpoint_id": checkpoint_id,
            "save_id": save_id,
            "rank": rank,
            "started_at": now,
        }

    def extra(current: list[bytes | None]) -> dict[str, bytes | None]:
        held = _decode_lease(current[0])
        if (
            held is not None
            and held.get("save_id") != save_id
            and isinstance(held.get("expires_at"), int | float)
            and held["expires_at"] > now
        ):
            raise CheckpointLockedError(
                f"checkpoint {checkpoint_id!r} in {engine.url} is being saved by another "
                f"writer (save {held.get('save_id')} on {held.get('host')}, pid "
                f"{held.get('pid')}); its lease expires in {held['expires_at'] - now:.0f} s. "
                "Use another checkpoint id, or wait for that save to finish."
            )
        if lease_seconds is None:
            return {}
        return {key: _lease_value(save_id, now + lease_seconds)}

    update_index(engine, change, watch=(key,), extra=extra)


def _lease_value(save_id: str, expires_at: float) -> bytes:
    return msgpack.packb(
        {
            "save_id": save_id,
            "expires_at": expires_at,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
    )


def renew_lease(
    engine: Engine, checkpoint_id: str, save_id: str, rank: int | None, lease_seconds: float
) -> None:
    """Extend a lease this save holds (a long save keeps it alive while writing)."""
    key = lease_key(engine.prefix, checkpoint_id, rank)

    def update(current: list[bytes | None]) -> dict[str, bytes | None]:
        held = _decode_lease(current[0])
        if held is not None and held.get("save_id") == save_id:
            return {key: _lease_value(save_id, time.time() + lease_seconds)}
        return {}

    engine.transact([key], update)


def release_lease(engine: Engine, checkpoint_id: str, save_id: str, rank: int | None) -> None:
    key = lease_key(engine.prefix, checkpoint_id, rank)

    def update(current: list[bytes | None]) -> dict[str, bytes | None]:
        held = _decode_lease(current[0])
        return {key: None} if held is not None and held.get("save_id") == save_id else {}

    engine.transact([key], update)


def readers_key(prefix: str, checkpoint_id: str) -> str:
    return f"{{{prefix}}}/readers/{checkpoint_id}"


def live_readers(raw: bytes | None, now: float | None = None) -> dict[str, dict[str, Any]]:
    """The unexpired read leases in a readers value (token -> lease)."""
    lease = _decode_lease(raw)
    if not lease:
        return {}
    now = time.time() if now is None else now
    return {
        token: held
        for token, held in lease.items()
        if isinstance(token, str)
        and isinstance(held, dict)
        and isinstance(held.get("expires_at"), int | float)
        and held["expires_at"] > now
    }


class LeaseRenewal:
    """Renews a lease once a third of its term has passed since it was taken or last renewed.

    One rule for every lease kvckpt holds (a save's write lease, a reader's, a background
    copy's): the holder calls it as often as its work allows (after each value or batch), and
    only the calls that fall due reach the store."""

    def __init__(self, seconds: float, renew: Callable[[], None]) -> None:
        self.seconds = seconds
        self._renew = renew
        self._at = time.monotonic()

    def __call__(self, force: bool = False) -> None:
        if force or time.monotonic() - self._at > self.seconds / 3:
            self._renew()
            self._at = time.monotonic()


def take_read_lease(engine: Engine, checkpoint_id: str, token: str, lease_seconds: float) -> None:
    """Take, or renew, a reader's lease on a checkpoint id for ``lease_seconds``.

    A reader takes it *before* it reads the metadata, so whatever save it then finds keeps its
    data until the lease is released (``release_read_lease``) or lapses: retention retires that
    save (its metadata goes at once) and deletes the data later. One small key per checkpoint
    id holds every reader's lease; expired ones are dropped on each update, so a reader that
    crashed blocks nothing for longer than its lease.
    """
    _update_readers(engine, checkpoint_id, token, lease_seconds)


def release_read_lease(engine: Engine, checkpoint_id: str, token: str) -> None:
    """Give up a reader's lease taken with ``take_read_lease`` (nothing if it lapsed)."""
    _update_readers(engine, checkpoint_id, token, None)


def _update_readers(
    engine: Engine, checkpoint_id: str, token: str, lease_seconds: float | None
) -> None:
    key = readers_key(engine.prefix, checkpoint_id)

    def update(current: list[bytes | None]) -> dict[str, bytes | None]:
        now = time.time()
        held = live_readers(current[0], now)
        if lease_seconds is None:
            if token not in held:
                return {}
            del held[token]
        else:
            held[token] = {
                "expires_at": now + lease_seconds,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
        return {key: msgpack.packb(held) if held else None}

    engine.transact([key], update)


@contextmanager
def read_lease(
    engine: Engine, checkpoint_id: str, lease_seconds: float | None
) -> Iterator[LeaseRenewal | Callable[[], None]]:
    """Hold a read lease for the duration of a block; yields its ``LeaseRenewal``.

    Reading never depends on writing. Without a lease (``lease_seconds`` None or 0, an engine
    opened with ``read_lease=0``, or a store that refuses the lease's small write: a Redis
    replica or one at ``maxmemory``, a user limited to reads, a read-only LMDB directory) the
    block runs all the same: retention and re-saves of the id are then not held off, and a
    value they delete or replace mid-read fails the read's size or checksum check with an
    error naming the checkpoint, never as wrong data."""
    if not lease_seconds or not engine.read_leases:
        yield _no_renewal
        return
    token = _new_token()
    try:
        take_read_lease(engine, checkpoint_id, token, lease_seconds)
    except (ReadOnlyStoreError, StoreFullError) as e:
        _warn_unleased(engine, e)
        yield _no_renewal
        return
    try:
        yield LeaseRenewal(
            lease_seconds, lambda: _renew_if_possible(engine, checkpoint_id, token, lease_seconds)
        )
    finally:
        try:
            release_read_lease(engine, checkpoint_id, token)
        except Exception:  # the lease lapses on its own; never mask the load's own outcome
            logger.warning("could not release a read lease on %r in %s", checkpoint_id, engine.url)


def _no_renewal(force: bool = False) -> None:
    """The renewal of a read that holds no lease."""


def _renew_if_possible(engine: Engine, checkpoint_id: str, token: str, seconds: float) -> None:
    """Renew a read lease; a store that filled up since it was taken lets it lapse instead of
    failing the read."""
    try:
        take_read_lease(engine, checkpoint_id, token, seconds)
    except StoreFullError as e:
        _warn_unleased(engine, e)


#: (store, kind of refusal) already logged by ``_warn_unleased`` in this process
_WARNED_UNLEASED: set[tuple[str, str]] = set()


def _warn_unleased(engine: Engine, refusal: Exception) -> None:
    """Say once per store and kind of refusal that reads there hold no lease, and why."""
    seen = (engine.url, type(refusal).__name__)
    if seen in _WARNED_UNLEASED:
        return
    _WARNED_UNLEASED.add(seen)
    logger.warning(
        "kvckpt reads from %s without a read lease, since the store refuses writes (%s). "
        "Checkpoints are read and verified as always, but retention (keep_last, gc) and "
        "re-saves are not held off while a read runs: a value they delete mid-read fails "
        "the read with an error naming the checkpoint; read again.",
        engine.url,
        str(refusal).split(". ")[0],
    )


def _new_token() -> str:
    return os.urandom(8).hex()


def retire_name(checkpoint_id: str, save_id: str) -> str:
    return f"{checkpoint_id}/{save_id}"


def retire(
    index: Index, readers_raw: bytes | None, checkpoint_id: str, save_ids: Iterable[str]
) -> bool:
    """Inside a transaction that removes saves' metadata: decide whether their data can be
    deleted now (True) or must wait for live readers (False, and the saves are recorded in
    ``index.retired`` for ``collect_retired``)."""
    if not live_readers(readers_raw):
        return True
    now = time.time()
    for save_id in save_ids:
        index.retired[retire_name(checkpoint_id, save_id)] = {
            "checkpoint_id": checkpoint_id,
            "save_id": save_id,
            "retired_at": now,
        }
    return False


def collect_retired(engine: Engine, index: Index | None = None) -> int:
    """Delete the data of retired saves whose readers have all finished (or whose leases
    lapsed). Returns the number of keys deleted."""
    index = read_index(engine) if index is None else index
    if not index.retired:
        return 0
    ids = sorted({str(e.get("checkpoint_id")) for e in index.retired.values()})
    busy = {cid for cid in ids if live_readers(engine.get(readers_key(engine.prefix, cid)))}
    done = {n: e for n, e in index.retired.items() if e.get("checkpoint_id") not in busy}
    deleted = 0
    for entry in done.values():
        cid, save_id = entry.get("checkpoint_id"), entry.get("save_id")
        if isinstance(cid, str) and isinstance(save_id, str):
            deleted += engine.delete_prefix(data_prefix(engine.prefix, cid, save_id))
    if done:

        def change(idx: Index) -> None:
            for name in done:
                idx.retired.pop(name, None)

        update_index(engine, change)
    return deleted


@dataclass
class _CommitRun:
    """What one run of a commit's transaction found: the metadata value it replaces, the id's
    read leases, and whether the replaced save's data may be deleted now (False while readers
    hold leases on the id)."""

    replaced: bytes | None = None
    readers: bytes | None = None
    deletable: bool = True


def commit(
    engine: Engine, raw: bytes, entry: dict[str, Any], *, pending: bool = True
) -> tuple[bytes | None, bool]:
    """Write a checkpoint's metadata ``raw`` and its index ``entry`` (see ``summary``) in one
    atomic transaction. Returns the metadata value it replaced (a re-save of the same id) and
    whether that save's data may be deleted now (False while readers hold leases on the id:
    it is then retired, for ``collect_retired``).

    ``pending``: the save registered itself (``mark_pending``) and commits only while that
    entry is still there. ``gc`` removes the entry before it deletes a save's data, so a save
    that ``gc`` took for a crashed writer's fails here instead of publishing missing data.

    Idempotent: a run of the transaction that finds this save already committed (an earlier
    run was applied, but its reply was lost and the client ran it again) writes nothing and
    reports what the applied run replaced. When no run of this call saw the store before the
    commit, the replaced value is unknown and reported as None: its data is left to ``gc``.
    """
    cid, rank, save_id = entry["checkpoint_id"], entry["rank"], entry["save_id"]
    key = meta_key(engine.prefix, cid, rank)
    lease = lease_key(engine.prefix, cid, rank)
    runs: list[_CommitRun] = []

    def extra(current: list[bytes | None]) -> dict[str, bytes | None]:
        runs.append(_CommitRun(replaced=current[0], readers=current[2]))
        held = _decode_lease(current[1])
        writes: dict[str, bytes | None] = {key: raw}
        if held is not None and held.get("save_id") == save_id:
            writes[lease] = None  # the commit releases this save's lease
        return writes

    def change(index: Index) -> bool:
        this = runs[-1]
        name = entry_name(cid, rank)
        if pending and pending_name(cid, save_id, rank) not in index.pending:
            if index.checkpoints.get(name, {}).get("save_id") == save_id:
                # Committed by an earlier run whose reply was lost: that run's findings stand
                # (none known if this call never saw the store before the commit).
                runs.pop()
                runs[:] = runs[-1:] or [_CommitRun()]
                return False
            raise SaveAbandonedError(
                f"checkpoint {cid!r} was not committed in {engine.url}: its save "
                f"{save_id} was removed as incomplete while it was being written, so "
                "its data may be gone. Either `kvckpt gc` took it for a crashed save (an "
                "incomplete_older_than shorter than a save, or a restart's cleanup running "
                "while this save ran: give gc a longer one), or the store lost its memory "
                "(a restart, flush or failover) meanwhile. Save it again."
            )
        old = index.checkpoints.get(name, {}).get("save_id")
        if this.replaced is not None and old != save_id:
            this.deletable = retire(index, this.readers, cid, [old] if isinstance(old, str) else [])
        index.checkpoints[name] = entry
        index.pending.pop(pending_name(cid, save_id, rank), None)
        return True

    readers = readers_key(engine.prefix, cid)
    update_index(engine, change, watch=(key, lease, readers), extra=extra)
    return runs[-1].replaced, runs[-1].deletable


def publish(
    engine: Engine,
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    *,
    checkpoint_id: str,
    save_id: str,
    world_size: int,
    rank: int | None = None,
    ttl: float | None = None,
    created_at: float | None = None,
    pending: bool = True,
) -> float:
    """Commit a checkpoint whose data is stored: encode its metadata, write it and its index
    entry atomically, then delete the data of the save it replaced. Returns the commit time
    (``created_at``, when given: a copy keeps the time its original was taken). ``pending``:
    see ``commit`` (False re-commits a committed save's metadata)."""
    created_at = time.time() if created_at is None else created_at
    raw = encode_metadata(
        metadata,
        locations,
        checkpoint_id=checkpoint_id,
        save_id=save_id,
        world_size=world_size,
        rank=rank,
        created_at=created_at,
    )
    expires_at = None if ttl is None else created_at + ttl
    entry = {
        "checkpoint_id": checkpoint_id,
        "rank": rank,
        "save_id": save_id,
        "created_at": created_at,
        "total_bytes": sum(loc.nbytes for loc in locations.values()),
        "items": len(locations),
        "world_size": world_size,
        "expires_at": expires_at,
    }
    replaced, deletable = commit(engine, raw, entry, pending=pending)
    if ttl is not None and expires_at is not None:
        engine.expire_at([meta_key(engine.prefix, checkpoint_id, rank)], expires_at)
        # Data outlives its metadata by a grace period, so a load that read the metadata just
        # before it expired still finds every value.
        grace = min(max(60.0, 0.1 * ttl), 3600.0)
        engine.expire_at(
            (
                key
                for loc in locations.values()
                for key in loc.keys(engine.prefix, checkpoint_id, save_id)
            ),
            expires_at + grace,
        )
    if replaced is not None and deletable:
        _delete_replaced(engine, checkpoint_id, save_id, replaced)
    try:
        collect_retired(engine)  # data earlier saves left to readers that have since finished
    except Exception as e:
        logger.warning("could not delete retired saves' data in %s: %s (run gc)", engine.url, e)
    return created_at


def _delete_replaced(engine: Engine, checkpoint_id: str, save_id: str, replaced: bytes) -> None:
    """After a commit: delete the data of the save it replaced. The checkpoint is committed
    whatever happens here, so a failure is logged and the data left to ``gc``."""
    try:
        old_save, old_keys = decode_data_keys(
            replaced,
            engine.prefix,
            checkpoint_id,
            where=f"replaced checkpoint {checkpoint_id!r} in {engine.url}",
        )
        if old_save != save_id:
            engine.delete(old_keys)
    except Exception as e:
        logger.warning(
            "checkpoint %r is committed in %s, but the data of the save it replaced was not "
            "deleted: %s (`kvckpt gc URL` deletes it)",
            checkpoint_id,
            engine.url,
            e,
        )


def rebuild_index(engine: Engine, *, write: bool = True) -> Index:
    """Rebuild the index from the metadata keys (a full scan: for repair, not for listing);
    ``write=False`` returns it without storing it (a dry run)."""
    checkpoints: dict[str, dict[str, Any]] = {}
    for key in engine.scan(meta_prefix(engine.prefix)):
        parsed = parse_meta_key(engine.prefix, key)
        raw = engine.get(key)
        if parsed is None or raw is None:
            continue
        try:
            record = decode_metadata(raw, where=f"{key!r} in {engine.url}")
        except MetadataError as e:
            logger.warning("index rebuild skips %s: %s", key, e)
            continue
        checkpoints[entry_name(*parsed)] = summary(record)
    index = Index(checkpoints, {})
    if write:
        key = index_key(engine.prefix)
        engine.transact([key], lambda _: {key: index.encode()})
    return index


#: The ``origin`` of the parts of a save that ``Tiers.prefetch`` brought into a node's store.
PREFETCHED = "prefetch"
#: The ``origin`` of the parts of a save that another node's ranks copied into a node's store
#: (``Tiers(peers=K)``, ``kvckpt.peer_copy``).
PEER = "peer"


def remote_entry(
    checkpoint_id: str, save_id: str, rank: int, origin: str, written_at: float
) -> dict[str, Any]:
    """An index ``remote`` entry: ``rank``'s data of a save, held in this store for
    ``origin`` (the coordinator's store, ``PREFETCHED`` or ``PEER``)."""
    return {
        "checkpoint_id": checkpoint_id,
        "save_id": save_id,
        "rank": rank,
        "origin": origin,
        "written_at": written_at,
    }


def peer_meta_key(prefix: str, checkpoint_id: str, save_id: str) -> str:
    """Where a node that keeps peer copies of the coordinator's node's share keeps the save's
    metadata too (the coordinator's meta value, as it is): ``{P}/peermeta/<id>/<save id>``.
    Not a commit: the checkpoint is not listed there; a restore reads it when the
    coordinator's node is gone."""
    return f"{{{prefix}}}/peermeta/{checkpoint_id}/{save_id}"


def peer_meta_prefix(prefix: str) -> str:
    return f"{{{prefix}}}/peermeta/"


def record_share(engine: Engine, checkpoint_id: str, save_id: str, ranks: list[int]) -> None:
    """After ``Tiers.prefetch`` copied the data of ``ranks`` of a save into a node-local store
    (this node's share of it, without metadata): replace its pending entry with records of
    those ranks' parts, as a save records the parts other nodes' ranks write into a store
    (``tidy_remote_store``), so that ``gc`` keeps them and retention drops them in time."""
    now = time.time()

    def change(idx: Index) -> None:
        idx.pending.pop(pending_name(checkpoint_id, save_id, None), None)
        for rank in ranks:
            idx.remote[pending_name(checkpoint_id, save_id, rank)] = remote_entry(
                checkpoint_id, save_id, rank, PREFETCHED, now
            )

    update_index(engine, change)
    release_lease(engine, checkpoint_id, save_id, None)


def unregister(engine: Engine, checkpoint_id: str, save_id: str) -> None:
    """Drop a save's pending entry and write lease without touching data."""

    def change(idx: Index) -> None:
        idx.pending.pop(pending_name(checkpoint_id, save_id, None), None)

    update_index(engine, change)
    release_lease(engine, checkpoint_id, save_id, None)


def tidy_remote_store(
    engine: Engine,
    *,
    origin: str,
    live: set[tuple[str, str]],
    checkpoint_id: str,
    save_id: str,
    rank: int,
) -> int:
    """On a node-local store that is not the coordinator's (another node's LMDB), before this
    rank writes its part of a save: record the save, and delete this rank's data of earlier
    saves of the same coordinator that the coordinator no longer keeps (``live``: its
    committed, pending and retired saves when this save was planned). This is how
    ``keep_last`` and ``gc`` on the coordinator reach the other nodes' stores, one save later.
    Returns the number of keys deleted."""
    index = read_index(engine)
    stale = {
        name: e
        for name, e in index.remote.items()
        if e.get("origin") in (origin, PREFETCHED)
        and e.get("rank") == rank
        and (e.get("checkpoint_id"), e.get("save_id")) not in live
        and isinstance(e.get("checkpoint_id"), str)
        and isinstance(e.get("save_id"), str)
    }
    deleted = 0
    for e in stale.values():
        head = data_prefix(engine.prefix, e["checkpoint_id"], e["save_id"])
        deleted += engine.delete_prefix(f"{head}{rank}/")

    def change(idx: Index) -> None:
        for name in stale:
            idx.remote.pop(name, None)
        idx.remote[pending_name(checkpoint_id, save_id, rank)] = remote_entry(
            checkpoint_id, save_id, rank, origin, time.time()
        )

    update_index(engine, change)
    return deleted
