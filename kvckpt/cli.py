"""The ``kvckpt`` command line: list, inspect, delete, verify and move checkpoints.

Listing, inspecting, deleting and ``gc`` never import torch (only moving data does: verify,
export, import, copy, torch-save, in ``cli_data``), so they answer at once.

Exit codes (``EXIT_CODES``): 0 success; 1 verification found problems; 2 usage error (bad
arguments, URL, URL option or checkpoint id); 3 checkpoint or store not found; 4 store
unreachable (down, or refused the credentials); 5 checkpoint damaged or unreadable; 6 the
destination cannot be written (a store that is full, read-only, or unsafe to write, a
checkpoint id another writer holds or one that exists where ``copy`` was not told to replace
it, or a file, directory or store path that cannot be created); 7 any
other error.

With ``--json``, every command prints one JSON document on stdout, an error included:
``{"error": MESSAGE, "exit_code": CODE}``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode

import click

from . import cli_data, manage
from .cli_common import (
    EXIT_CODES,
    count,
    emit,
    exit_code,
    handle_errors,
    human_bytes,
    iso_time,
    json_option,
    show_time,
    table,
)
from .engines._copy_ways import NATIVE_STATUS
from .engines.base import Engine
from .errors import CheckpointNotFoundError, MetadataError
from .stores import open_store

#: Names the command line's users and tests import from here.
__all__ = ["EXIT_CODES", "exit_code", "human_bytes", "main"]

_EXIT_TABLE = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nExit codes:\n" + _EXIT_TABLE,
)
@click.version_option(
    package_name="kvckpt",
    message=f"%(prog)s %(version)s; native copy-and-hash: {NATIVE_STATUS}",
)
def main() -> None:
    """Manage PyTorch DCP checkpoints stored in LMDB or Redis.

    URL is a store URL: lmdb:///dev/shm/ckpt, redis://[user:password@]host:6379/0,
    rediss://..., unix:///path/redis.sock; add ?prefix=NAME to pick a namespace
    (kvckpt ls --namespaces URL lists them). Every command takes --json for one JSON
    document on stdout.
    """


for _command in cli_data.COMMANDS:
    main.add_command(_command)


def with_prefix(url: str, prefix: str) -> str:
    """``url`` (as an engine shows it, password masked) with its ``?prefix=`` set to
    ``prefix``: the URL of another namespace of the same store."""
    base, _, query = url.partition("?")
    pairs = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "prefix"]
    pairs.append(("prefix", prefix))
    return f"{base}?{urlencode(pairs, safe='*/:')}"


@main.command("ls")
@click.argument("url")
@click.option(
    "--all",
    "-a",
    "show_all",
    is_flag=True,
    help="Include incomplete checkpoints (saves that never committed).",
)
@click.option(
    "--namespaces",
    "show_namespaces",
    is_flag=True,
    help="List the store's namespaces (?prefix=NAME) and their checkpoints instead.",
)
@json_option
@handle_errors
def ls_command(url: str, show_all: bool, show_namespaces: bool, as_json: bool) -> None:
    """List checkpoints, newest first (--json: a list of checkpoints). Where the URL's
    namespace has none, the other namespaces the store holds are named.

    With --namespaces, the store's namespaces instead, found from key names and each one's
    index, never from data keys (--json: a list of {"prefix", "url", "checkpoints",
    "total_bytes", "indexed"}).

    \b
    Example:
      kvckpt ls redis://localhost:6379/0 --all
      kvckpt ls --namespaces lmdb:///dev/shm/ckpt
    """
    engine = open_store(url, create=False)
    if show_namespaces:
        _list_namespaces(engine, as_json)
        return
    # a store that is not there is an error (exit 3), not "no checkpoints": a mistyped path
    infos = manage.stored_checkpoints(engine, include_incomplete=show_all)
    if as_json:
        emit([i.to_json() for i in infos])
        if not infos:
            _other_namespaces(engine, err=True)
        return
    if not infos:
        click.echo(f"no checkpoints in {engine.url}")
        _other_namespaces(engine, err=False)
        return
    rows = [
        (
            i.checkpoint_id,
            show_time(i.created_at),
            human_bytes(i.total_bytes),
            i.num_items,
            i.world_size if i.world_size is not None else "-",
            ("complete" if i.complete else "incomplete")
            + (f", expires {show_time(i.expires_at)}" if i.expires_at else ""),
        )
        for i in infos
    ]
    click.echo(table(("ID", "CREATED", "SIZE", "ITEMS", "WORLD", "STATUS"), rows, {2, 3, 4}))


def _other_namespaces(engine: Engine, *, err: bool) -> None:
    """Where the URL's namespace is empty: the store's other namespaces that hold
    checkpoints, and how to pick one (on stderr with ``err``, beside a JSON document)."""
    others = [
        n for n in manage.list_namespaces(engine) if n.prefix != engine.prefix and n.checkpoints
    ]
    if not others:
        return
    names = ", ".join(
        f"{n.prefix!r} ("
        + ("index unreadable" if n.checkpoints is None else count(n.checkpoints, "checkpoint"))
        + ")"
        for n in others
    )
    click.echo(
        f"the store holds checkpoints in other namespaces: {names}. Pick one with "
        f"?prefix=NAME, e.g. kvckpt ls '{with_prefix(engine.url, others[0].prefix)}' "
        f"(kvckpt ls --namespaces '{engine.url}' lists them)",
        err=err,
    )


def _list_namespaces(engine: Engine, as_json: bool) -> None:
    """``kvckpt ls --namespaces``."""
    spaces = manage.list_namespaces(engine)
    if as_json:
        emit([{**n.to_json(), "url": with_prefix(engine.url, n.prefix)} for n in spaces])
        return
    if not spaces:
        click.echo(f"no namespaces in {engine.url}: the store holds no checkpoints")
        return
    rows = [
        (
            n.prefix,
            "?" if n.checkpoints is None else n.checkpoints,
            "-" if n.total_bytes is None else human_bytes(n.total_bytes),
            with_prefix(engine.url, n.prefix)
            + ("" if n.indexed else "  (no index: run kvckpt gc on it)")
            + ("  (index unreadable: run kvckpt gc on it)" if n.checkpoints is None else ""),
        )
        for n in spaces
    ]
    click.echo(table(("NAMESPACE", "CHECKPOINTS", "SIZE", "URL"), rows, {1, 2}))


@main.command("stats")
@click.argument("url")
@json_option
@handle_errors
def stats_command(url: str, as_json: bool) -> None:
    """A store's checkpoints, their bytes, and the store's memory in use and its limit; for
    LMDB also the memory its file holds, pages made ready ahead of the next saves included.

    --json: {"url", "checkpoints", "checkpoint_bytes", "used_bytes", "limit_bytes",
    "limit_from", "held_bytes", "checkpoint_list", "peer_shares"} (the byte counts null where
    the store cannot tell; "checkpoint_list" as kvckpt ls --json lists them; "peer_shares":
    the other nodes' shares a node-local store keeps for Tiers(peers=K), each
    {"checkpoint_id", "save_id", "ranks"}).

    \b
    Example:
      kvckpt stats redis://localhost:6379/0
    """
    engine = open_store(url, create=False)
    infos = manage.stored_checkpoints(engine, include_incomplete=False)
    usage = engine.usage()
    held = manage.held_bytes(engine)
    shares = manage.peer_shares(engine)
    stored = sum(i.total_bytes for i in infos)
    if as_json:
        emit(
            {
                "url": engine.url,
                "checkpoints": len(infos),
                "checkpoint_bytes": stored,
                "used_bytes": usage.used_bytes,
                "limit_bytes": usage.limit_bytes,
                "limit_from": usage.limit_from or None,
                "held_bytes": held,
                "checkpoint_list": [i.to_json() for i in infos],
                "peer_shares": shares,
            }
        )
        return
    click.echo(f"store        {engine.url}")
    click.echo(f"checkpoints  {len(infos)}, {human_bytes(stored)} of tensor data")
    used = "unknown" if usage.used_bytes is None else human_bytes(usage.used_bytes)
    if usage.limit_bytes is None:
        limit = f"no limit set ({usage.limit_from})" if usage.limit_from else "limit unknown"
    else:
        share = f" ({usage.used_bytes / usage.limit_bytes:.0%})" if usage.used_bytes else ""
        limit = f"of {human_bytes(usage.limit_bytes)}{share}, {usage.limit_from}"
    click.echo(f"memory       {used} in use, {limit}")
    if held is not None:
        beyond = held - (usage.used_bytes or 0)
        why = (
            f": {human_bytes(beyond)} more than in use, pages made ready ahead of the next "
            "saves and freed pages kept for reuse"
            if beyond > 0
            else ""
        )
        click.echo(f"memory held  {human_bytes(held)} by the store's file{why}")
    if shares:
        ids = list(dict.fromkeys(s["checkpoint_id"] for s in shares))
        click.echo(
            f"peer copies  other nodes' shares of {count(len(ids), 'checkpoint')} "
            f"({', '.join(repr(i) for i in ids[:5])}), kept for Tiers(peers=K)"
        )
    if infos:
        rows = [
            (i.checkpoint_id, show_time(i.created_at), human_bytes(i.total_bytes), i.num_items)
            for i in infos
        ]
        click.echo("")
        click.echo(table(("ID", "CREATED", "SIZE", "ITEMS"), rows, {2, 3}))


def _summaries(engine: Engine, checkpoint_id: str) -> list[dict[str, Any]]:
    """A checkpoint's metadata, decoded without torch (``format.decode_summary``): one for a
    collective save, one per rank for a rank-local one."""
    from .format import decode_summary
    from .keys import meta_key
    from .urls import validate_name

    validate_name(checkpoint_id)
    where = f"checkpoint {checkpoint_id!r} in {engine.url}"
    raws = [engine.get(meta_key(engine.prefix, checkpoint_id))]
    if raws[0] is None:
        infos = [
            i
            for i in manage.list_checkpoints(engine, include_incomplete=True)
            if i.checkpoint_id == checkpoint_id and i.rank_local and i.world_size is not None
        ]
        if infos and infos[0].complete:
            ranks = range(infos[0].world_size)  # type: ignore[arg-type]
            raws = [engine.get(meta_key(engine.prefix, checkpoint_id, r)) for r in ranks]
    if not raws or any(raw is None for raw in raws):
        ids = sorted({i.checkpoint_id for i in manage.list_checkpoints(engine)})
        there = (
            "the store has no checkpoints"
            if not ids
            else "checkpoints there: "
            + ", ".join(repr(i) for i in ids[:50])
            + (f" and {len(ids) - 50} more" if len(ids) > 50 else "")
        )
        raise CheckpointNotFoundError(
            f"checkpoint {checkpoint_id!r} not found in {engine.url}; {there}"
        )
    summaries = [decode_summary(raw, where=where) for raw in raws if raw is not None]
    for summary in summaries:
        if summary["checkpoint_id"] != checkpoint_id:
            raise MetadataError(
                f"metadata stored for {where} names checkpoint {summary['checkpoint_id']!r}: "
                "the value was copied or overwritten under the wrong key"
            )
    return summaries


@main.command("info")
@click.argument("url")
@click.argument("checkpoint_id")
@click.option(
    "--keys", "show_keys", is_flag=True, help="List each item's data keys in the store instead."
)
@json_option
@handle_errors
def info_command(url: str, checkpoint_id: str, show_keys: bool, as_json: bool) -> None:
    """Show a checkpoint's tensors: fqn, dtype, global shape, chunks, bytes.

    With --keys, each write item instead (a tensor's chunk, or an object): its fqn, offsets,
    the rank that wrote it, and the store key of each of its parts, to look at with the
    store's own tools (redis-cli, mdb_dump).

    \b
    Example:
      kvckpt info lmdb:///dev/shm/ckpt step-100
      kvckpt info redis://host:6379 step-100 --keys
    """
    engine = open_store(url, create=False)
    records = _summaries(engine, checkpoint_id)
    nbytes: dict[str, int] = {}
    for record in records:
        for item in record["items"]:
            nbytes[item["fqn"]] = nbytes.get(item["fqn"], 0) + item["nbytes"]
    head = records[0]
    names = sorted({*head["tensors"], *head["objects"]})
    entries: list[dict[str, Any]] = []
    for fqn in names:
        tensor = head["tensors"].get(fqn)
        entries.append(
            {
                "fqn": fqn,
                "dtype": "object" if tensor is None else tensor["dtype"],
                "shape": None if tensor is None else tensor["size"],
                "chunks": 1 if tensor is None else tensor["chunks"],
                "bytes": nbytes.get(fqn, 0),
            }
        )
    created = max(r["created_at"] for r in records)
    summary: dict[str, Any] = {
        "checkpoint_id": checkpoint_id,
        "save_id": head["save_id"] if len(records) == 1 else None,
        "created_at": iso_time(created),
        "world_size": head["world_size"],
        "rank_local": head["rank"] is not None,
        "total_bytes": sum(r["total_bytes"] for r in records),
        "items": sum(len(r["items"]) for r in records),
        "format_version": head["format_version"],
        "tensors": entries,
    }
    if show_keys:
        _show_keys(engine.prefix, records, summary, as_json)
        return
    if as_json:
        emit(summary)
        return
    click.echo(f"checkpoint  {checkpoint_id}" + ("  (rank-local)" if summary["rank_local"] else ""))
    click.echo(f"created     {show_time(created)}")
    click.echo(f"world size  {head['world_size']}")
    click.echo(
        f"size        {human_bytes(summary['total_bytes'])} in {count(summary['items'], 'item')}"
    )
    click.echo(f"format      {head['format_version']}")
    click.echo("")
    rows = [
        (
            e["fqn"],
            e["dtype"],
            "-" if e["shape"] is None else "(" + ", ".join(map(str, e["shape"])) + ")",
            e["chunks"],
            human_bytes(e["bytes"]),
        )
        for e in entries
    ]
    click.echo(table(("FQN", "DTYPE", "SHAPE", "CHUNKS", "BYTES"), rows, {3, 4}))


def _show_keys(
    prefix: str, records: list[dict[str, Any]], summary: dict[str, Any], as_json: bool
) -> None:
    """``kvckpt info --keys``: every item of ``records`` and its data keys, in reading order."""
    from .keys import data_prefix, item_keys, part_ranges

    items: list[dict[str, Any]] = [
        {
            "fqn": item["fqn"],
            "offsets": item["offsets"],
            "rank": item["rank"],
            "bytes": item["nbytes"],
            "part_bytes": item["part_bytes"],
            "keys": item_keys(
                data_prefix(prefix, record["checkpoint_id"], record["save_id"]),
                item["rank"],
                item["n"] if item["name"] is None else item["name"],
                item["nbytes"],
                item["part_bytes"],
            ),
        }
        for record in records
        for item in sorted(record["items"], key=lambda i: (i["rank"], i["n"]))
    ]
    if as_json:
        del summary["tensors"]
        emit({**summary, "write_items": items})
        return
    click.echo(
        f"checkpoint {summary['checkpoint_id']}: {count(len(items), 'item')}, format "
        f"{summary['format_version']}"
    )
    rows = [
        (
            item["fqn"],
            "-" if item["offsets"] is None else "[" + ", ".join(map(str, item["offsets"])) + "]",
            item["rank"],
            human_bytes(stop - start),
            key,
        )
        for item in items
        for key, (start, stop) in zip(
            item["keys"], part_ranges(item["bytes"], item["part_bytes"]), strict=True
        )
    ]
    click.echo(table(("FQN", "OFFSETS", "RANK", "BYTES", "KEY"), rows, {2, 3}))


@main.command("rm")
@click.argument("url")
@click.argument("checkpoint_ids", nargs=-1, required=True)
@json_option
@handle_errors
def rm_command(url: str, checkpoint_ids: tuple[str, ...], as_json: bool) -> None:
    """Delete checkpoints (metadata first, so readers see them gone at once).

    --json: {"url", "deleted": [{"checkpoint_id", "data_keys"}]}.

    \b
    Example:
      kvckpt rm redis://localhost:6379/0 step-100 step-200
    """
    engine = open_store(url, create=False)
    deleted = []
    for cid in checkpoint_ids:
        keys = manage.delete_checkpoint(engine, cid)
        deleted.append({"checkpoint_id": cid, "data_keys": keys})
        if not as_json:
            click.echo(f"deleted {cid} ({count(keys, 'data key')})")
    if as_json:
        emit({"url": engine.url, "deleted": deleted})


@main.command("gc")
@click.argument("url")
@click.option(
    "--keep-last",
    type=click.IntRange(min=0),
    default=None,
    help="Keep only the newest N complete checkpoints.",
)
@click.option(
    "--incomplete-older-than",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    help="Seconds after which an uncommitted save is garbage.",
)
@click.option("--dry-run", "-n", is_flag=True, help="Change nothing: report what would be removed.")
@json_option
@handle_errors
def gc_command(
    url: str, keep_last: int | None, incomplete_older_than: float, dry_run: bool, as_json: bool
) -> None:
    """Delete old checkpoints, the data of saves that never committed, and the spares that
    retention kept for the next save to write over (Redis).

    --json: {"url", "dry_run", "deleted_checkpoints", "removed_incomplete", "deleted_keys",
    "spare_keys"} ("deleted_keys" counts every key, the spares in "spare_keys" included).

    \b
    Example:
      kvckpt gc lmdb:///dev/shm/ckpt --keep-last 3 --dry-run
    """
    engine = open_store(url, create=False)
    report = manage.gc(
        engine, keep_last=keep_last, incomplete_older_than=incomplete_older_than, dry_run=dry_run
    )
    if as_json:
        emit({"url": engine.url, **report.to_json()})
        return
    delete, remove = ("would delete", "would remove") if dry_run else ("deleted", "removed")
    for cid in report.deleted_checkpoints:
        click.echo(f"{delete} checkpoint {cid}")
    for name in report.removed_incomplete:
        click.echo(f"{remove} incomplete save {name}")
    if report.spare_keys:
        click.echo(
            f"{delete} {count(report.spare_keys, 'spare key')} (values retention kept for the "
            "next save to write over)"
        )
    keys = count(report.deleted_keys - report.spare_keys, "data key")
    if report.spare_keys:
        keys += f" and {count(report.spare_keys, 'spare key')}"
    click.echo(
        f"{keys} " + ("would be deleted (dry run: nothing changed)" if dry_run else "deleted")
    )


if __name__ == "__main__":  # pragma: no cover
    main()
