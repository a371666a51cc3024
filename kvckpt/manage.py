"""Managing the checkpoints of a namespace: list, latest, delete, garbage collection.

Everything here reads the catalog index (one key) rather than scanning data keys, except
``gc``'s search for orphaned data, which by its nature must look at every data key once.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .catalog import (
    PEER,
    Index,
    collect_retired,
    index_key,
    live_readers,
    pending_name,
    publish,
    read_index,
    readers_key,
    rebuild_index,
    release_lease,
    retire,
    update_index,
)
from .engines.base import Engine
from .errors import CheckpointNotFoundError, MetadataError, StoreFullError, StoreNotFoundError
from .format import decode_data_keys, decode_metadata
from .keys import data_prefix, meta_key, parse_meta_key, spare_key, spare_prefix
from .stores import open_store
from .urls import validate_name


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a namespace, as ``list_checkpoints`` reports it."""

    checkpoint_id: str
    created_at: float  #: Unix time of the commit (of the start, for an incomplete save)
    total_bytes: int
    num_items: int
    world_size: int | None
    complete: bool
    save_id: str | None = None
    expires_at: float | None = None
    rank_local: bool = False  #: saved with ``use_collectives=False``

    @property
    def created(self) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.created_at, tz=_dt.UTC)

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "created_at": self.created.isoformat(),
            "total_bytes": self.total_bytes,
            "num_items": self.num_items,
            "world_size": self.world_size,
            "complete": self.complete,
            "save_id": self.save_id,
            "expires_at": None
            if self.expires_at is None
            else _dt.datetime.fromtimestamp(self.expires_at, tz=_dt.UTC).isoformat(),
            "rank_local": self.rank_local,
        }


@dataclass
class GcReport:
    """What ``gc`` removed, or with ``dry_run=True`` what it would remove."""

    #: Complete checkpoints deleted by ``keep_last``, newest first.
    deleted_checkpoints: list[str] = field(default_factory=list)
    #: Saves whose data was removed: ``<checkpoint id>/<save id>/<rank or "all">`` for a save
    #: that never committed, ``<checkpoint id>/<save id> (orphaned)`` for data that no
    #: checkpoint and no save in progress refers to.
    removed_incomplete: list[str] = field(default_factory=list)
    #: Keys deleted, of all the above together and of the spares (``spare_keys``). In a dry
    #: run, the keys found that would be deleted: a checkpoint that a reader is loading keeps
    #: its data until the reader finishes, so a real run may delete fewer now.
    deleted_keys: int = 0
    #: Of ``deleted_keys``, the spares deleted: values that retention kept under
    #: ``{prefix}/spare/`` for the next save to write over (``Engine.retire_values``), which
    #: hold memory but belong to no checkpoint.
    spare_keys: int = 0
    #: True for ``gc(dry_run=True)``: nothing was deleted.
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "deleted_checkpoints": list(self.deleted_checkpoints),
            "removed_incomplete": list(self.removed_incomplete),
            "deleted_keys": self.deleted_keys,
            "spare_keys": self.spare_keys,
        }


def _engine(store: str | Engine) -> Engine:
    """Nothing here creates a store: deleting from one that does not exist is an error
    (``StoreNotFoundError``), not a new empty store."""
    return open_store(store, create=False)


def _field(entry: dict[str, Any], name: str, types: tuple[type, ...], where: str) -> Any:
    value = entry.get(name)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise MetadataError(
            f"the checkpoint index of {where} has a bad {name!r} ({value!r}); rebuild it with "
            "`kvckpt gc URL`"
        )
    return value


def _infos(index: Index, where: str, include_incomplete: bool) -> list[CheckpointInfo]:
    now = time.time()
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in index.checkpoints.values():
        expires = entry.get("expires_at")
        if isinstance(expires, int | float) and expires <= now:
            continue  # Redis has expired (or is expiring) its keys
        groups[_field(entry, "checkpoint_id", (str,), where)].append(entry)
    infos: list[CheckpointInfo] = []
    for cid, entries in groups.items():
        collective = [e for e in entries if e.get("rank") is None]
        chosen = collective or entries
        num = (int, float)
        created = max(float(_field(e, "created_at", num, where)) for e in chosen)
        total = sum(_field(e, "total_bytes", (int,), where) for e in chosen)
        items = sum(_field(e, "items", (int,), where) for e in chosen)
        world = _field(chosen[0], "world_size", (int,), where)
        if collective:
            complete, save_id = True, _field(chosen[0], "save_id", (str,), where)
        else:  # rank-local: complete once every rank has committed
            ranks = {e.get("rank") for e in entries}
            complete, save_id = ranks >= set(range(world)), None
        if complete or include_incomplete:
            expires = [e.get("expires_at") for e in chosen if e.get("expires_at") is not None]
            infos.append(
                CheckpointInfo(
                    cid,
                    created,
                    total,
                    items,
                    world,
                    complete,
                    save_id,
                    min(expires) if expires else None,
                    rank_local=not collective,
                )
            )
    if include_incomplete:
        for p in index.pending.values():
            infos.append(
                CheckpointInfo(
                    _field(p, "checkpoint_id", (str,), where),
                    float(_field(p, "started_at", (int, float), where)),
                    0,
                    0,
                    None,
                    False,
                    _field(p, "save_id", (str,), where),
                    rank_local=p.get("rank") is not None,
                )
            )
    infos.sort(key=lambda i: (i.created_at, i.checkpoint_id), reverse=True)
    return infos


def list_checkpoints(
    store: str | Engine,
    *,
    include_incomplete: bool = False,
) -> list[CheckpointInfo]:
    """The checkpoints of a namespace, newest first.

    Reads the catalog index only (one key), however many checkpoints and data keys there are.
    ``include_incomplete`` adds saves that started but never committed (a writer that crashed
    or is still writing) and rank-local checkpoints that some ranks have not committed.

    A store that does not exist yet (an LMDB directory no save has created) has no
    checkpoints: the answer is ``[]``, and nothing is created.
    """
    try:
        return stored_checkpoints(_engine(store), include_incomplete=include_incomplete)
    except StoreNotFoundError:
        return []


def stored_checkpoints(engine: Engine, *, include_incomplete: bool = False) -> list[CheckpointInfo]:
    """``list_checkpoints``, but a store that does not exist is an error
    (``StoreNotFoundError``): for ``kvckpt ls``, where it is most likely a mistyped path."""
    return _infos(read_index(engine), engine.url, include_incomplete)


def latest_checkpoint(store: str | Engine) -> str | None:
    """The id of the newest complete checkpoint: the one a restarted job resumes from. None
    where there is none, a store that does not exist yet included (a job's first run); nothing
    is created."""
    complete = [i for i in list_checkpoints(store) if i.complete]
    return complete[0].checkpoint_id if complete else None


@dataclass(frozen=True)
class NamespaceInfo:
    """One namespace (``?prefix=NAME``) of a store, as ``list_namespaces`` reports it."""

    prefix: str
    #: Its complete checkpoints; None where its index cannot be read (``kvckpt gc`` rebuilds it)
    checkpoints: int | None
    #: Their bytes of tensor data; None where only the metadata keys tell the checkpoints
    total_bytes: int | None
    #: Whether it has an index (without one, its metadata keys were counted)
    indexed: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "checkpoints": self.checkpoints,
            "total_bytes": self.total_bytes,
            "indexed": self.indexed,
        }


#: A namespace's bookkeeping key (its index, metadata, leases): ``{NAME}/...``. Data and
#: spare keys (``NAME/...``) carry no braces, so a scan of names that begin with "{" skips them.
_BOOKKEEPING = re.compile(r"\{([^{}/]+)\}/.*", re.DOTALL)


def list_namespaces(store: str | Engine) -> list[NamespaceInfo]:
    """The namespaces a store holds, by name, with their complete checkpoints.

    They are found from key names alone: one scan of the names that begin with "{", the
    namespaces' bookkeeping keys (``{NAME}/index``, ``{NAME}/meta/...``; on Redis one ``SCAN``
    whose ``MATCH`` pattern leaves data keys out), then each namespace's index, one small
    value, for its count. No data key is read. A namespace without an index (metadata keys
    only) counts its metadata keys. The store's own prefix does not matter; a store that does
    not exist raises ``StoreNotFoundError`` and is not created."""
    engine = _engine(store)
    indexed: set[str] = set()
    metas: dict[str, set[str]] = defaultdict(set)
    for key in engine.scan("{"):
        found = _BOOKKEEPING.fullmatch(key)
        if found is None:
            continue
        prefix = found.group(1)
        if key == index_key(prefix):
            indexed.add(prefix)
        elif (parsed := parse_meta_key(prefix, key)) is not None:
            metas[prefix].add(parsed[0])
    out = []
    for prefix in sorted(indexed | set(metas)):
        if prefix not in indexed:
            out.append(NamespaceInfo(prefix, len(metas[prefix]), None, indexed=False))
            continue
        where = f"namespace {prefix!r} of {engine.url}"
        try:
            index = Index.decode(engine.get(index_key(prefix)), where=where)
            infos = _infos(index, where, False)
        except MetadataError:
            out.append(NamespaceInfo(prefix, None, None))
            continue
        out.append(NamespaceInfo(prefix, len(infos), sum(i.total_bytes for i in infos)))
    return out


def peer_shares(engine: Engine) -> list[dict[str, Any]]:
    """The shares of other nodes' ranks that this node-local store keeps as peer copies
    (``Tiers(peers=K)``), a save at a time: ``{"checkpoint_id", "save_id", "ranks"}``, newest
    first. From the index alone."""
    saves: dict[tuple[str, str], tuple[float, list[int]]] = {}
    for e in read_index(_engine(engine)).remote.values():
        cid, sid, rank = e.get("checkpoint_id"), e.get("save_id"), e.get("rank")
        if e.get("origin") != PEER or not isinstance(cid, str) or not isinstance(sid, str):
            continue
        _, ranks = saves.setdefault((cid, sid), (float(e.get("written_at") or 0), []))
        if isinstance(rank, int):
            ranks.append(rank)
    return [
        {"checkpoint_id": cid, "save_id": sid, "ranks": sorted(ranks)}
        for (cid, sid), (_, ranks) in sorted(saves.items(), key=lambda kv: -kv[1][0])
    ]


def held_bytes(engine: Engine) -> int | None:
    """The memory a node-local store's file holds (LMDB: the blocks its data file has
    allocated), which exceeds ``usage().used_bytes`` by the pages made ready ahead of the next
    saves (``Engine.get_ready``) and the freed pages LMDB reuses; the file never shrinks.
    None for other stores."""
    from .engines.lmdb import LMDBEngine

    if not isinstance(engine, LMDBEngine):
        return None
    try:
        return os.stat(os.path.join(engine.path, "data.mdb")).st_blocks * 512
    except OSError:
        return None


def _checkpoint_meta_keys(engine: Engine, index: Index, checkpoint_id: str) -> list[str]:
    keys = {meta_key(engine.prefix, checkpoint_id)}
    for entry in index.checkpoints.values():
        if entry.get("checkpoint_id") == checkpoint_id and isinstance(entry.get("rank"), int):
            keys.add(meta_key(engine.prefix, checkpoint_id, entry["rank"]))
    return sorted(keys)


def delete_checkpoint(store: str | Engine, checkpoint_id: str, *, reuse: bool = False) -> int:
    """Delete a checkpoint: its metadata and index entry first, atomically, so readers see it
    gone at once; then its data keys in bounded batches (``UNLINK`` on Redis, so the server
    never blocks on a big delete). Returns the number of data keys deleted.

    ``reuse`` (retention's deletes): an engine that ``reuses_values`` keeps the data as spares
    for the next save to write over (``Engine.retire_values``) instead of freeing it."""
    engine = _engine(store)
    validate_name(checkpoint_id)
    keys = _checkpoint_meta_keys(engine, read_index(engine), checkpoint_id)
    # Each run of the transaction's findings: the metadata values it removes, the id's read
    # leases, and whether the data may go now. A run that finds nothing left after a run that
    # found the checkpoint is the same delete run again (its reply was lost): that run stands.
    runs: list[tuple[list[bytes | None], bytes | None]] = []
    deletable = [True]

    def extra(current: list[bytes | None]) -> dict[str, bytes | None]:
        runs.append((current[:-1], current[-1]))
        return dict.fromkeys(keys)

    def change(index: Index) -> bool:
        names = [n for n, e in index.checkpoints.items() if e.get("checkpoint_id") == checkpoint_id]
        if not names and all(v is None for v in runs[-1][0]) and len(runs) > 1:
            runs.pop()
            return False
        save_ids = {index.checkpoints[n].get("save_id") for n in names}
        deletable[0] = retire(
            index, runs[-1][1], checkpoint_id, sorted(s for s in save_ids if isinstance(s, str))
        )
        for name in names:
            del index.checkpoints[name]
        return True

    watch = (*keys, readers_key(engine.prefix, checkpoint_id))
    update_index(engine, change, watch=watch, extra=extra)
    old_meta = runs[-1][0]
    if all(v is None for v in old_meta):
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id!r} not found in {engine.url}; `kvckpt ls URL` lists "
            "the checkpoints there"
        )
    if not deletable[0]:
        return 0  # readers are loading it: its data goes once they finish (collect_retired)
    deleted = 0
    for raw in old_meta:
        if raw is None:
            continue
        try:
            _, data_keys = decode_data_keys(
                raw,
                engine.prefix,
                checkpoint_id,
                where=f"checkpoint {checkpoint_id!r} in {engine.url}",
            )
        except MetadataError:
            deleted += engine.delete_prefix(data_prefix(engine.prefix, checkpoint_id))
            continue
        if reuse and engine.reuses_values:
            deleted += engine.retire_values([(k, spare_key(engine.prefix, k)) for k in data_keys])
        else:
            deleted += engine.delete(data_keys)
    return deleted


def remove_items(store: str | Engine, checkpoint_id: str, fqns: Iterable[str]) -> int:
    """Rewrite a committed checkpoint without the items named ``fqns`` (their tensors and
    objects); returns how many data keys were deleted.

    The smaller metadata is committed first (the same save and creation time, and any expiry
    kept), and only then are the removed items' values deleted, so a new reader never finds
    metadata without its data. Run it while nothing saves or loads this checkpoint: a load that
    already read the old metadata fails on the removed items."""
    engine = _engine(store)
    where = f"checkpoint {checkpoint_id!r} in {engine.url}"
    raw = engine.get(meta_key(engine.prefix, checkpoint_id))
    if raw is None:
        raise CheckpointNotFoundError(f"{where} does not exist (kvckpt list {engine.url})")
    record = decode_metadata(raw, where=where)
    removed = set(fqns)
    md = record.metadata
    kept = {i: loc for i, loc in record.locations.items() if i.fqn not in removed}
    planner_data = md.planner_data
    if isinstance(planner_data, dict):
        planner_data = {k: v for k, v in planner_data.items() if k not in removed}
    smaller = dataclasses.replace(
        md,
        state_dict_metadata={k: v for k, v in md.state_dict_metadata.items() if k not in removed},
        planner_data=planner_data,
        storage_data=kept,
    )
    info = next((i for i in list_checkpoints(engine) if i.checkpoint_id == checkpoint_id), None)
    expires_at = None if info is None else info.expires_at
    publish(
        engine,
        smaller,
        kept,
        checkpoint_id=checkpoint_id,
        save_id=record.save_id,
        world_size=record.world_size,
        ttl=None if expires_at is None else max(expires_at - record.created_at, 1.0),
        created_at=record.created_at,
        pending=False,  # the same save, committed again smaller
    )
    return engine.delete(
        key
        for index, loc in record.locations.items()
        if index.fqn in removed
        for key in loc.keys(engine.prefix, checkpoint_id, record.save_id)
    )


def _data_key_save(prefix: str, key: str) -> tuple[str, str] | None:
    rest = key[len(data_prefix(prefix)) :].split("/")
    return (rest[0], rest[1]) if len(rest) >= 2 else None


def gc(
    store: str | Engine,
    *,
    keep_last: int | None = None,
    incomplete_older_than: float | _dt.timedelta = 3600.0,
    protect: Iterable[str] = (),
    scan_orphans: bool = True,
    reuse: bool = False,
    dry_run: bool = False,
) -> GcReport:
    """Remove old checkpoints and the data of saves that never committed.

    - ``keep_last=N``: delete complete checkpoints beyond the newest N (never one in
      ``protect``).
    - Saves that started more than ``incomplete_older_than`` ago (seconds or a timedelta) and
      never committed — a writer that crashed — have their data deleted.
    - ``scan_orphans``: one pass over every data and spare key of the namespace deletes data
      that no checkpoint and no save in progress refers to, and the spares retention kept for
      reuse (counted in ``deleted_keys`` and ``spare_keys``).
    - ``reuse``: ``keep_last``'s deletes keep the data as spares for the next save to write
      over, where the engine can (a writer's ``keep_last``; see ``delete_checkpoint``).
    - ``dry_run``: change nothing, and report what would be removed (``GcReport.dry_run``).

    A corrupt or missing index is rebuilt from the metadata keys first (in a dry run, in
    memory only).
    """
    engine = _engine(store)
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, not {keep_last}")
    if isinstance(incomplete_older_than, _dt.timedelta):
        incomplete_older_than = incomplete_older_than.total_seconds()
    if dry_run:
        return _gc_dry_run(engine, keep_last, incomplete_older_than, protect, scan_orphans)
    report = GcReport()
    try:
        index = read_index(engine)
    except MetadataError:
        index = rebuild_index(engine)

    if keep_last is not None:
        for info in _beyond_keep_last(index, engine.url, keep_last, protect):
            try:
                report.deleted_keys += delete_checkpoint(engine, info.checkpoint_id, reuse=reuse)
                report.deleted_checkpoints.append(info.checkpoint_id)
            except CheckpointNotFoundError:
                pass  # deleted concurrently

    _remove_incomplete(engine, index, incomplete_older_than, report)
    report.deleted_keys += collect_retired(engine)

    if scan_orphans:
        _remove_orphans(engine, report)
    return report


def _remove_incomplete(engine: Engine, index: Index, older_than: float, report: GcReport) -> None:
    """Remove the saves that started more than ``older_than`` seconds ago and never
    committed, and the index entries of checkpoints whose keys have expired."""
    expired, stale = _expired_and_stale(index, older_than)
    if not (stale or expired):
        return
    # The pending entries go first, in one transaction, and only the saves still pending
    # then lose their data: a save that committed meanwhile keeps it, and one that is
    # still writing finds its entry gone when it commits and fails (``commit``).
    removed: dict[str, dict[str, Any]] = {}

    def change(idx: Index) -> None:
        removed.clear()
        for name in stale:
            if name in idx.pending:
                removed[name] = idx.pending.pop(name)
        for name in expired:
            idx.checkpoints.pop(name, None)

    update_index(engine, change)
    for name, p in removed.items():
        cid, save_id, rank = p.get("checkpoint_id"), p.get("save_id"), p.get("rank")
        if isinstance(cid, str) and isinstance(save_id, str):
            report.deleted_keys += _delete_save_data(
                engine, cid, save_id, rank if isinstance(rank, int) else None
            )
        report.removed_incomplete.append(name)


def _scan_data_and_spares(engine: Engine) -> tuple[dict[tuple[str, str], list[str]], list[str]]:
    """One pass over the namespace's data and spare keys: the data keys by (checkpoint id,
    save id), and the spares."""
    data_head, spare_head = data_prefix(engine.prefix), spare_prefix(engine.prefix)
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    spares: list[str] = []
    for key in engine.scan(f"{engine.prefix}/"):  # both heads; bookkeeping keys are "{...}/"
        if key.startswith(spare_head):
            spares.append(key)
        elif key.startswith(data_head) and (save := _data_key_save(engine.prefix, key)):
            found[save].append(key)
    return found, spares


def _remove_orphans(engine: Engine, report: GcReport) -> None:
    """Delete data that no checkpoint and no save in progress refers to, and the spares."""
    # Scan first, read the index after: a save that starts meanwhile registers as pending
    # before it writes any data, so its keys are seen as referenced.
    found, spares = _scan_data_and_spares(engine)
    index = read_index(engine)
    live = index.live_saves(remote=True)
    for save, keys in found.items():
        if save not in live:
            report.deleted_keys += engine.delete(keys)
            report.removed_incomplete.append(f"{save[0]}/{save[1]} (orphaned)")
    removed = engine.delete(spares)  # a spare a save took over meanwhile is not there to delete
    report.spare_keys += removed
    report.deleted_keys += removed


def _beyond_keep_last(
    index: Index, where: str, keep_last: int, protect: Iterable[str]
) -> list[CheckpointInfo]:
    """The complete checkpoints ``keep_last`` deletes: those beyond the newest ``keep_last``,
    except the protected ones."""
    protected = set(protect)
    complete = [i for i in _infos(index, where, False) if i.complete]
    return [i for i in complete[keep_last:] if i.checkpoint_id not in protected]


def _expired_and_stale(
    index: Index, incomplete_older_than: float
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The index entries of checkpoints whose keys have expired, and the pending entries of
    saves that started more than ``incomplete_older_than`` seconds ago."""
    now = time.time()
    expired = [
        n
        for n, e in index.checkpoints.items()
        if isinstance(e.get("expires_at"), int | float) and e["expires_at"] <= now
    ]
    stale = {
        n: p
        for n, p in index.pending.items()
        if isinstance(p.get("started_at"), int | float)
        and now - p["started_at"] >= incomplete_older_than
    }
    return expired, stale


def _index_in_memory(engine: Engine) -> Index:
    """The index, or where it is corrupt the index ``rebuild_index`` would write, unwritten."""
    try:
        return read_index(engine)
    except MetadataError:
        return rebuild_index(engine, write=False)


def _gc_dry_run(
    engine: Engine,
    keep_last: int | None,
    incomplete_older_than: float,
    protect: Iterable[str],
    scan_orphans: bool,
) -> GcReport:
    """What ``gc`` would remove, found with reads only."""
    report = GcReport(dry_run=True)
    index = _index_in_memory(engine)
    if keep_last is not None:
        for info in _beyond_keep_last(index, engine.url, keep_last, protect):
            report.deleted_checkpoints.append(info.checkpoint_id)
            for key in _checkpoint_meta_keys(engine, index, info.checkpoint_id):
                raw = engine.get(key)
                if raw is None:
                    continue
                where = f"checkpoint {info.checkpoint_id!r} in {engine.url}"
                try:
                    _, data_keys = decode_data_keys(
                        raw, engine.prefix, info.checkpoint_id, where=where
                    )
                    report.deleted_keys += len(data_keys)
                except MetadataError:
                    head = data_prefix(engine.prefix, info.checkpoint_id)
                    report.deleted_keys += sum(1 for _ in engine.scan(head))
    _, stale = _expired_and_stale(index, incomplete_older_than)
    for name, p in stale.items():
        cid, save_id, rank = p.get("checkpoint_id"), p.get("save_id"), p.get("rank")
        if isinstance(cid, str) and isinstance(save_id, str):
            head = data_prefix(engine.prefix, cid, save_id)
            head += f"{rank}/" if isinstance(rank, int) else ""
            report.deleted_keys += sum(1 for _ in engine.scan(head))
        report.removed_incomplete.append(name)
    busy: dict[str, bool] = {}
    for entry in index.retired.values():
        cid, save_id = entry.get("checkpoint_id"), entry.get("save_id")
        if not isinstance(cid, str) or not isinstance(save_id, str):
            continue
        if cid not in busy:
            busy[cid] = bool(live_readers(engine.get(readers_key(engine.prefix, cid))))
        if not busy[cid]:
            report.deleted_keys += sum(
                1 for _ in engine.scan(data_prefix(engine.prefix, cid, save_id))
            )
    if scan_orphans:
        found, spares = _scan_data_and_spares(engine)
        live = index.live_saves(remote=True)
        for save, keys in found.items():
            if save not in live:
                report.deleted_keys += len(keys)
                report.removed_incomplete.append(f"{save[0]}/{save[1]} (orphaned)")
        report.spare_keys += len(spares)
        report.deleted_keys += len(spares)
    return report


def preflight(engine: Engine, nbytes: int) -> None:
    """``Engine.preflight`` for a write of ``nbytes`` (a save's, a copy's), counting the spares
    retention kept as room: the write takes their memory over rather than adding to it."""
    try:
        engine.preflight(nbytes)
    except StoreFullError:
        if not engine.reuses_values:
            raise
        engine.preflight(max(0, nbytes - spare_bytes(engine)))


def spare_bytes(engine: Engine) -> int:
    """Bytes of the spares retention keeps for the next save to write over (``reuse``)."""
    spares = list(engine.scan(spare_prefix(engine.prefix)))
    return sum(n or 0 for n in engine.value_sizes(spares))


def _delete_save_data(engine: Engine, checkpoint_id: str, save_id: str, rank: int | None) -> int:
    """Delete an uncommitted save's data (one rank's, for a rank-local save) and release its
    write lease, so the id can be saved again at once. Returns the number of keys deleted."""
    head = data_prefix(engine.prefix, checkpoint_id, save_id)
    deleted = engine.delete_prefix(head if rank is None else f"{head}{rank}/")
    release_lease(engine, checkpoint_id, save_id, rank)
    return deleted


def discard_save(engine: Engine, checkpoint_id: str, save_id: str, rank: int | None = None) -> int:
    """Drop a save that will never commit (a failed save, a failed copy of ``Tiers``): its data
    (one rank's, for a rank-local save), its pending entry and its write lease, as ``gc`` does
    for a crashed writer's save, so it is not listed as incomplete until the next ``gc``.
    Returns the number of data keys deleted.

    The data goes first. A save that failed because the store is full leaves it full, and a
    full Redis refuses every write but never a delete: deleting the data frees the memory the
    save took, and the bookkeeping after it, which only shrinks (``RedisEngine.transact`` runs
    such a transaction even at ``maxmemory``), then succeeds. Only the writer of this save
    could commit it, and it is the one giving up.

    A save that the index records as committed (or retired, with readers) keeps its data: a
    caller that took its commit for failed (its reply lost on the way) must not delete what a
    committed checkpoint names."""

    def committed(idx: Index) -> bool:
        return any(
            e.get("checkpoint_id") == checkpoint_id and e.get("save_id") == save_id
            for e in (*idx.checkpoints.values(), *idx.retired.values())
        )

    if committed(read_index(engine)):
        return 0
    head = data_prefix(engine.prefix, checkpoint_id, save_id)
    deleted = engine.delete_prefix(head if rank is None else f"{head}{rank}/")

    def drop(idx: Index) -> bool:
        return idx.pending.pop(pending_name(checkpoint_id, save_id, rank), None) is not None

    update_index(engine, drop)
    release_lease(engine, checkpoint_id, save_id, rank)
    return deleted


#: ``gc(..., incomplete_older_than=NEVER)`` leaves every pending save alone.
NEVER = math.inf
