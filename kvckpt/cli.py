"""The ``kvckpt`` command line: list, inspect, delete, verify and move checkpoints.

Listing, inspecting, deleting and ``gc`` never import torch (only moving data does: verify,
export, import, copy, torch-save), so they answer at once.

Exit codes (``EXIT_CODES``): 0 success; 1 verification found problems; 2 usage error (bad
arguments, URL, URL option or checkpoint id); 3 checkpoint or store not found; 4 store
unreachable (down, or refused the credentials); 5 checkpoint damaged or unreadable; 6 the
destination cannot be written (a store that is full, read-only, or unsafe to write, a
checkpoint id another writer holds or one that exists where ``copy`` was not told to replace
it, or a file or directory that cannot be created); 7 any
other error.

With ``--json``, every command prints one JSON document on stdout, an error included:
``{"error": MESSAGE, "exit_code": CODE}``.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import sys
from collections.abc import Callable, Sequence, Set
from typing import Any, TypeVar

import click

from . import manage
from .engines.base import Engine
from .errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    DataError,
    InvalidCheckpointIdError,
    InvalidURLError,
    KVCheckpointError,
    MetadataError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreUnavailableError,
    UnsafeObjectError,
    UnsafeStoreError,
    UnwritablePathError,
)
from .stores import open_store

(
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    EXIT_USAGE,
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    EXIT_DAMAGED,
    EXIT_DESTINATION,
    EXIT_OTHER,
) = range(8)

#: exit code -> what it means (the table of ``kvckpt --help`` and docs/reference/cli.md)
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_VERIFY_FAILED: "verification found problems",
    EXIT_USAGE: "usage error: bad arguments, URL, URL option or checkpoint id",
    EXIT_NOT_FOUND: "checkpoint or store not found",
    EXIT_UNAVAILABLE: "store unreachable, or it refused the credentials",
    EXIT_DAMAGED: "checkpoint damaged or unreadable",
    EXIT_DESTINATION: "destination cannot be written: store full, read-only or unsafe, "
    "checkpoint id held by another writer, file or directory that cannot be created",
    EXIT_OTHER: "any other error",
}

F = TypeVar("F", bound=Callable[..., Any])


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.UTC).isoformat()


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Set[int] = frozenset(),
) -> str:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def exit_code(error: BaseException) -> int:
    """The documented exit code for an error a command raised."""
    # DCP wraps each rank's error in a CheckpointException (a BaseException): its first
    # rank's error decides.
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) and first else first
        if isinstance(inner, BaseException):
            return exit_code(inner)
    if isinstance(error, InvalidURLError | InvalidCheckpointIdError):
        return EXIT_USAGE
    if isinstance(error, CheckpointNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(
        error,
        StoreFullError
        | ReadOnlyStoreError
        | UnsafeStoreError
        | CheckpointLockedError
        | CheckpointExistsError
        | UnwritablePathError,
    ):
        return EXIT_DESTINATION
    if isinstance(error, StoreUnavailableError):
        return EXIT_UNAVAILABLE
    if isinstance(error, MetadataError | DataError | UnsafeObjectError):
        return EXIT_DAMAGED
    if isinstance(error, KVCheckpointError):
        return EXIT_OTHER
    if isinstance(error, OSError):  # a file or directory that export or torch-save writes
        return EXIT_DESTINATION
    return EXIT_OTHER


def _message(error: BaseException) -> str:
    text = str(error).strip()
    if not isinstance(error, KVCheckpointError) and text:
        text = text.splitlines()[-1]  # DCP's CheckpointException ends with the rank's error
    return text or type(error).__name__


def handle_errors(command: F) -> F:
    """Map errors to one line on stderr and a documented exit code (``exit_code``); with
    ``--json``, also to a JSON document on stdout."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit, click.exceptions.Exit, click.ClickException):
            raise
        except BaseException as e:
            code, message = exit_code(e), _message(e)
        click.echo(f"kvckpt: error: {message}", err=True)
        if kwargs.get("as_json"):
            _emit({"error": message, "exit_code": code})
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _emit(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2))


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout (errors too)."
)

_EXIT_TABLE = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="\b\nExit codes:\n" + _EXIT_TABLE,
)
@click.version_option(package_name="kvckpt")
def main() -> None:
    """Manage PyTorch DCP checkpoints stored in LMDB or Redis.

    URL is a store URL: lmdb:///dev/shm/ckpt, redis://[user:password@]host:6379/0,
    rediss://..., unix:///path/redis.sock; add ?prefix=NAME to pick a namespace.
    Every command takes --json for one JSON document on stdout.
    """


@main.command("ls")
@click.argument("url")
@click.option(
    "--all",
    "-a",
    "show_all",
    is_flag=True,
    help="Include incomplete checkpoints (saves that never committed).",
)
@json_option
@handle_errors
def ls_command(url: str, show_all: bool, as_json: bool) -> None:
    """List checkpoints, newest first (--json: a list of checkpoints).

    \b
    Example:
      kvckpt ls redis://localhost:6379/0 --all
    """
    engine = open_store(url, create=False)
    # a store that is not there is an error (exit 3), not "no checkpoints": a mistyped path
    infos = manage.stored_checkpoints(engine, include_incomplete=show_all)
    if as_json:
        _emit([i.to_json() for i in infos])
        return
    if not infos:
        click.echo(f"no checkpoints in {engine.url}")
        return
    rows = [
        (
            i.checkpoint_id,
            _time(i.created_at),
            human_bytes(i.total_bytes),
            i.num_items,
            i.world_size if i.world_size is not None else "-",
            ("complete" if i.complete else "incomplete")
            + (f", expires {_time(i.expires_at)}" if i.expires_at else ""),
        )
        for i in infos
    ]
    click.echo(table(("ID", "CREATED", "SIZE", "ITEMS", "WORLD", "STATUS"), rows, {2, 3, 4}))


@main.command("stats")
@click.argument("url")
@json_option
@handle_errors
def stats_command(url: str, as_json: bool) -> None:
    """A store's checkpoints, their bytes, and the store's memory in use and its limit.

    --json: {"url", "checkpoints", "checkpoint_bytes", "used_bytes", "limit_bytes",
    "limit_from"} (the byte counts null where the store cannot tell).

    \b
    Example:
      kvckpt stats redis://localhost:6379/0
    """
    engine = open_store(url, create=False)
    infos = manage.stored_checkpoints(engine, include_incomplete=False)
    usage = engine.usage()
    held = sum(i.total_bytes for i in infos)
    if as_json:
        _emit(
            {
                "url": engine.url,
                "checkpoints": len(infos),
                "checkpoint_bytes": held,
                "used_bytes": usage.used_bytes,
                "limit_bytes": usage.limit_bytes,
                "limit_from": usage.limit_from or None,
            }
        )
        return
    click.echo(f"store        {engine.url}")
    click.echo(f"checkpoints  {len(infos)}, {human_bytes(held)} of tensor data")
    used = "unknown" if usage.used_bytes is None else human_bytes(usage.used_bytes)
    if usage.limit_bytes is None:
        limit = f"no limit set ({usage.limit_from})" if usage.limit_from else "limit unknown"
    else:
        share = f" ({usage.used_bytes / usage.limit_bytes:.0%})" if usage.used_bytes else ""
        limit = f"of {human_bytes(usage.limit_bytes)}{share}, {usage.limit_from}"
    click.echo(f"memory       {used} in use, {limit}")
    if infos:
        rows = [
            (i.checkpoint_id, _time(i.created_at), human_bytes(i.total_bytes), i.num_items)
            for i in infos
        ]
        click.echo("")
        click.echo(table(("ID", "CREATED", "SIZE", "ITEMS"), rows, {2, 3}))


def _summaries(engine: Engine, checkpoint_id: str) -> list[dict[str, Any]]:
    """A checkpoint's metadata, decoded without torch (``format.decode_summary``): one for a
    collective save, one per rank for a rank-local one."""
    from .format import decode_summary, meta_key
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
        "created_at": _iso(created),
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
        _emit(summary)
        return
    click.echo(f"checkpoint  {checkpoint_id}" + ("  (rank-local)" if summary["rank_local"] else ""))
    click.echo(f"created     {_time(created)}")
    click.echo(f"world size  {head['world_size']}")
    click.echo(f"size        {human_bytes(summary['total_bytes'])} in {summary['items']} items")
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
    from .format import data_prefix, item_keys, part_ranges

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
        _emit({**summary, "write_items": items})
        return
    click.echo(
        f"checkpoint {summary['checkpoint_id']}: {len(items)} items, format "
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
            click.echo(f"deleted {cid} ({keys} data keys)")
    if as_json:
        _emit({"url": engine.url, "deleted": deleted})


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
    """Delete old checkpoints and the data of saves that never committed.

    --json: {"url", "dry_run", "deleted_checkpoints", "removed_incomplete", "deleted_keys"}.

    \b
    Example:
      kvckpt gc lmdb:///dev/shm/ckpt --keep-last 3 --dry-run
    """
    engine = open_store(url, create=False)
    report = manage.gc(
        engine, keep_last=keep_last, incomplete_older_than=incomplete_older_than, dry_run=dry_run
    )
    if as_json:
        _emit({"url": engine.url, **report.to_json()})
        return
    delete, remove = ("would delete", "would remove") if dry_run else ("deleted", "removed")
    for cid in report.deleted_checkpoints:
        click.echo(f"{delete} checkpoint {cid}")
    for name in report.removed_incomplete:
        click.echo(f"{remove} incomplete save {name}")
    click.echo(
        f"{report.deleted_keys} data keys "
        + ("would be deleted (dry run: nothing changed)" if dry_run else "deleted")
    )


@main.command("verify")
@click.argument("url")
@click.argument("checkpoint_id")
@quiet_option
@json_option
@handle_errors
def verify_command(url: str, checkpoint_id: str, quiet: bool, as_json: bool) -> None:
    """Check that every key of a checkpoint is present with the right size (exit 1 if not).

    --json: {"checkpoint_id", "ok", "keys", "total_bytes", "problems"}.

    \b
    Example:
      kvckpt verify redis://localhost:6379/0 step-100
    """
    from . import transfer

    report = transfer.verify(url, checkpoint_id, progress=_progress(quiet))
    if as_json:
        _emit(
            {
                "checkpoint_id": checkpoint_id,
                "ok": report.ok,
                "keys": report.keys,
                "total_bytes": report.total_bytes,
                "problems": report.problems,
            }
        )
    else:
        for problem in report.problems[:100]:
            click.echo(problem)
        if len(report.problems) > 100:
            click.echo(f"... and {len(report.problems) - 100} more problems")
        if report.ok:
            click.echo(
                f"{checkpoint_id}: OK ({report.keys} keys, {human_bytes(report.total_bytes)})"
            )
        else:
            click.echo(
                f"{checkpoint_id}: FAILED ({len(report.problems)} problems in {report.keys} keys)"
            )
    if not report.ok:
        sys.exit(EXIT_VERIFY_FAILED)


@main.command("export")
@click.argument("url")
@click.argument("checkpoint_id")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["dcp", "safetensors"]),
    default="dcp",
    show_default=True,
    help="dcp: a standard DCP directory. safetensors: Hugging Face safetensors shards of "
    "full tensors plus model.safetensors.index.json.",
)
@click.option(
    "--prefix",
    default="model.",
    show_default=True,
    help="safetensors: export the tensors under this prefix, named without it ('' for all).",
)
@click.option("--include", default=None, help="safetensors: a regex the names must match.")
@click.option(
    "--dtype", default=None, help="safetensors: write floating-point tensors as, e.g., bfloat16."
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="safetensors: the most bytes of tensor data in one file (e.g. 2GB, 500MiB).",
)
@quiet_option
@json_option
@handle_errors
def export_command(
    url: str,
    checkpoint_id: str,
    directory: str,
    fmt: str,
    prefix: str,
    include: str | None,
    dtype: str | None,
    max_shard_size: str,
    quiet: bool,
    as_json: bool,
) -> None:
    """Write a checkpoint as a standard DCP directory (read by stock dcp.load), or as Hugging
    Face safetensors for evaluation and serving (--format safetensors).

    --json: {"checkpoint_id", "directory", "format"}.

    \b
    Example:
      kvckpt export redis://localhost:6379/0 step-100 /checkpoints/step-100
      kvckpt export lmdb:///dev/shm/ckpt step-100 /models/step-100 --format safetensors \\
          --dtype bfloat16
    """
    if fmt == "safetensors":
        from .safetensors_export import export_safetensors

        out = export_safetensors(
            url,
            checkpoint_id,
            directory,
            prefix=prefix,
            include=include,
            dtype=dtype,
            max_shard_bytes=_parse_size(max_shard_size),
        )
    else:
        from . import transfer

        out = transfer.export_checkpoint(url, checkpoint_id, directory, progress=_progress(quiet))
    if as_json:
        _emit({"checkpoint_id": checkpoint_id, "directory": str(out), "format": fmt})
        return
    click.echo(f"exported {checkpoint_id} to {out}" + (" as safetensors" if fmt != "dcp" else ""))


def _parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MiB`` or ``1000000``."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    number = text.strip()
    digits = number.rstrip("KMGTBIkmgtbi")
    unit = number[len(digits) :].upper()
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise click.BadParameter(
            f"{text!r} is not a size: write e.g. 5GB, 500MiB or 1000000",
            param_hint="--max-shard-size",
        )
    return int(value * units[unit])


@main.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("url")
@click.argument("checkpoint_id")
@quiet_option
@json_option
@handle_errors
def import_command(
    directory: str, url: str, checkpoint_id: str, quiet: bool, as_json: bool
) -> None:
    """Import a directory written by DCP's FileSystemWriter (any world size).

    --json: {"directory", "url", "checkpoint_id", "items", "total_bytes"}.

    \b
    Example:
      kvckpt import /checkpoints/step-100 lmdb:///dev/shm/ckpt step-100
    """
    from . import transfer

    record = transfer.import_checkpoint(directory, url, checkpoint_id, progress=_progress(quiet))
    if as_json:
        _emit(
            {
                "directory": directory,
                "url": open_store(url).url,
                "checkpoint_id": record.checkpoint_id,
                "items": len(record.locations),
                "total_bytes": record.total_bytes,
            }
        )
        return
    click.echo(
        f"imported {directory} as {checkpoint_id} ({len(record.locations)} items, "
        f"{human_bytes(record.total_bytes)})"
    )


@main.command("copy")
@click.argument("src_url")
@click.argument("checkpoint_id")
@click.argument("dst_url")
@click.argument("new_id", required=False)
@click.option("--force", is_flag=True, help="Replace a checkpoint of that id at the destination.")
@quiet_option
@json_option
@handle_errors
def copy_command(
    src_url: str,
    checkpoint_id: str,
    dst_url: str,
    new_id: str | None,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """Copy a checkpoint to another store (or under a new id).

    --json: {"source", "checkpoint_id", "destination", "new_id", "total_bytes"}.

    \b
    Example:
      kvckpt copy lmdb:///dev/shm/ckpt step-100 redis://shared:6379/0
    """
    from . import transfer

    record = transfer.copy_checkpoint(
        src_url, checkpoint_id, dst_url, new_id, overwrite=force, progress=_progress(quiet)
    )
    if as_json:
        _emit(
            {
                "source": open_store(src_url, create=False).url,
                "checkpoint_id": checkpoint_id,
                "destination": open_store(dst_url).url,
                "new_id": record.checkpoint_id,
                "total_bytes": record.total_bytes,
            }
        )
        return
    click.echo(
        f"copied {checkpoint_id} to {open_store(dst_url).url} as "
        f"{record.checkpoint_id} ({human_bytes(record.total_bytes)})"
    )


@main.command("torch-save")
@click.argument("url")
@click.argument("checkpoint_id")
@click.argument("file", type=click.Path(dir_okay=False))
@json_option
@handle_errors
def torch_save_command(url: str, checkpoint_id: str, file: str, as_json: bool) -> None:
    """Write one torch.save file with full (unsharded) tensors.

    --json: {"checkpoint_id", "file"}.

    \b
    Example:
      kvckpt torch-save redis://localhost:6379/0 step-100 model.pt
    """
    from . import transfer

    path = transfer.torch_save_checkpoint(url, checkpoint_id, file)
    if as_json:
        _emit({"checkpoint_id": checkpoint_id, "file": str(path)})
        return
    click.echo(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    main()
