"""The ``kvckpt`` command line: list, inspect, delete, verify and move checkpoints.

Exit codes: 0 success; 1 verification found problems; 2 usage error (bad arguments, URL or
checkpoint id); 3 checkpoint or store not found; 4 store unreachable; 5 checkpoint damaged or
unreadable.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import sys
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING, Any, TypeVar

import click

from . import manage, transfer
from .errors import (
    CheckpointNotFoundError,
    InvalidCheckpointIdError,
    InvalidURLError,
    KVCheckpointError,
    StoreUnavailableError,
)
from .stores import open_store

if TYPE_CHECKING:
    from .format import CheckpointRecord

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_DAMAGED = range(6)

F = TypeVar("F", bound=Callable[..., Any])


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


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


def handle_errors(command: F) -> F:
    """Map kvckpt's errors to one line on stderr and a documented exit code."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (InvalidURLError, InvalidCheckpointIdError) as e:
            code, message = EXIT_USAGE, str(e)
        except CheckpointNotFoundError as e:
            code, message = EXIT_NOT_FOUND, str(e)
        except StoreUnavailableError as e:
            code, message = EXIT_UNAVAILABLE, str(e)
        except KVCheckpointError as e:
            code, message = EXIT_DAMAGED, str(e)
        except BaseException as e:  # DCP wraps errors in CheckpointException (a BaseException)
            if isinstance(
                e, KeyboardInterrupt | SystemExit | click.exceptions.Exit | click.ClickException
            ):
                raise
            text = str(e)
            code = EXIT_NOT_FOUND if "not found in" in text else EXIT_DAMAGED
            message = text.strip().splitlines()[-1] if text.strip() else type(e).__name__
        click.echo(f"kvckpt: error: {message}", err=True)
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvckpt")
def main() -> None:
    """Manage PyTorch DCP checkpoints stored in LMDB or Redis.

    URL is a store URL: lmdb:///dev/shm/ckpt, redis://[user:password@]host:6379/0,
    rediss://..., unix:///path/redis.sock; add ?prefix=NAME to pick a namespace.

    \b
    Exit codes: 0 ok, 1 verification failed, 2 usage error, 3 checkpoint/store not found,
    4 store unreachable, 5 checkpoint damaged or unreadable.
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
    """List checkpoints, newest first.

    \b
    Example:
      kvckpt ls redis://localhost:6379/0 --all
    """
    infos = manage.list_checkpoints(url, include_incomplete=show_all)
    if as_json:
        click.echo(json.dumps([i.to_json() for i in infos], indent=2))
        return
    if not infos:
        click.echo(f"no checkpoints in {open_store(url, create=False).url}")
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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .format import dtype_name

    engine = open_store(url, create=False)
    records = transfer._records(engine, checkpoint_id)
    md = records[0].metadata
    nbytes: dict[str, int] = {}
    for record in records:
        for index, loc in record.locations.items():
            nbytes[index.fqn] = nbytes.get(index.fqn, 0) + loc.nbytes
    entries: list[dict[str, Any]] = []
    for fqn, smd in sorted(md.state_dict_metadata.items()):
        if isinstance(smd, TensorStorageMetadata):
            entries.append(
                {
                    "fqn": fqn,
                    "dtype": dtype_name(smd.properties.dtype),
                    "shape": list(smd.size),
                    "chunks": len(smd.chunks),
                    "bytes": nbytes.get(fqn, 0),
                }
            )
        else:
            entries.append(
                {
                    "fqn": fqn,
                    "dtype": "object",
                    "shape": None,
                    "chunks": 1,
                    "bytes": nbytes.get(fqn, 0),
                }
            )
    head = records[0]
    summary: dict[str, Any] = {
        "checkpoint_id": checkpoint_id,
        "save_id": head.save_id if len(records) == 1 else None,
        "created_at": _dt.datetime.fromtimestamp(
            max(r.created_at for r in records), tz=_dt.UTC
        ).isoformat(),
        "world_size": head.world_size,
        "rank_local": head.rank is not None,
        "total_bytes": sum(r.total_bytes for r in records),
        "items": sum(len(r.locations) for r in records),
        "format_version": head.format_version,
        "tensors": entries,
    }
    if show_keys:
        _show_keys(engine.prefix, records, summary, as_json)
        return
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"checkpoint  {checkpoint_id}" + ("  (rank-local)" if summary["rank_local"] else ""))
    click.echo(f"created     {_time(max(r.created_at for r in records))}")
    click.echo(f"world size  {head.world_size}")
    click.echo(f"size        {human_bytes(summary['total_bytes'])} in {summary['items']} items")
    click.echo(f"format      {head.format_version}")
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
    prefix: str, records: list[CheckpointRecord], summary: dict[str, Any], as_json: bool
) -> None:
    """``kvckpt info --keys``: every item of ``records`` and its data keys, in reading order."""
    from .format import part_ranges

    items: list[dict[str, Any]] = [
        {
            "fqn": index.fqn,
            "offsets": None if index.offset is None else list(index.offset),
            "rank": loc.rank,
            "bytes": loc.nbytes,
            "part_bytes": loc.part_bytes,
            "keys": loc.keys(prefix, record.checkpoint_id, record.save_id),
        }
        for record in records
        for index, loc in sorted(record.locations.items(), key=lambda kv: (kv[1].rank, kv[1].n))
    ]
    if as_json:
        del summary["tensors"]
        click.echo(json.dumps({**summary, "write_items": items}, indent=2))
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
@handle_errors
def rm_command(url: str, checkpoint_ids: tuple[str, ...]) -> None:
    """Delete checkpoints (metadata first, so readers see them gone at once).

    \b
    Example:
      kvckpt rm redis://localhost:6379/0 step-100 step-200
    """
    for cid in checkpoint_ids:
        keys = manage.delete_checkpoint(url, cid)
        click.echo(f"deleted {cid} ({keys} data keys)")


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
@handle_errors
def gc_command(url: str, keep_last: int | None, incomplete_older_than: float) -> None:
    """Delete old checkpoints and the data of saves that never committed.

    \b
    Example:
      kvckpt gc lmdb:///dev/shm/ckpt --keep-last 3
    """
    report = manage.gc(url, keep_last=keep_last, incomplete_older_than=incomplete_older_than)
    for cid in report.deleted_checkpoints:
        click.echo(f"deleted checkpoint {cid}")
    for name in report.removed_incomplete:
        click.echo(f"removed incomplete save {name}")
    click.echo(f"{report.deleted_keys} data keys deleted")


@main.command("verify")
@click.argument("url")
@click.argument("checkpoint_id")
@quiet_option
@handle_errors
def verify_command(url: str, checkpoint_id: str, quiet: bool) -> None:
    """Check that every key of a checkpoint is present with the right size (exit 1 if not).

    \b
    Example:
      kvckpt verify redis://localhost:6379/0 step-100
    """
    report = transfer.verify(url, checkpoint_id, progress=_progress(quiet))
    for problem in report.problems[:100]:
        click.echo(problem)
    if len(report.problems) > 100:
        click.echo(f"... and {len(report.problems) - 100} more problems")
    if report.ok:
        click.echo(f"{checkpoint_id}: OK ({report.keys} keys, {human_bytes(report.total_bytes)})")
    else:
        click.echo(
            f"{checkpoint_id}: FAILED ({len(report.problems)} problems in {report.keys} keys)"
        )
        sys.exit(EXIT_VERIFY_FAILED)


@main.command("export")
@click.argument("url")
@click.argument("checkpoint_id")
@click.argument("directory", type=click.Path(file_okay=False))
@quiet_option
@handle_errors
def export_command(url: str, checkpoint_id: str, directory: str, quiet: bool) -> None:
    """Write a checkpoint as a standard DCP directory (read by stock dcp.load).

    \b
    Example:
      kvckpt export redis://localhost:6379/0 step-100 /checkpoints/step-100
    """
    out = transfer.export_checkpoint(url, checkpoint_id, directory, progress=_progress(quiet))
    click.echo(f"exported {checkpoint_id} to {out}")


@main.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("url")
@click.argument("checkpoint_id")
@quiet_option
@handle_errors
def import_command(directory: str, url: str, checkpoint_id: str, quiet: bool) -> None:
    """Import a directory written by DCP's FileSystemWriter (any world size).

    \b
    Example:
      kvckpt import /checkpoints/step-100 lmdb:///dev/shm/ckpt step-100
    """
    record = transfer.import_checkpoint(directory, url, checkpoint_id, progress=_progress(quiet))
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
@handle_errors
def copy_command(
    src_url: str, checkpoint_id: str, dst_url: str, new_id: str | None, force: bool, quiet: bool
) -> None:
    """Copy a checkpoint to another store (or under a new id).

    \b
    Example:
      kvckpt copy lmdb:///dev/shm/ckpt step-100 redis://shared:6379/0
    """
    record = transfer.copy_checkpoint(
        src_url, checkpoint_id, dst_url, new_id, overwrite=force, progress=_progress(quiet)
    )
    click.echo(
        f"copied {checkpoint_id} to {open_store(dst_url).url} as "
        f"{record.checkpoint_id} ({human_bytes(record.total_bytes)})"
    )


@main.command("torch-save")
@click.argument("url")
@click.argument("checkpoint_id")
@click.argument("file", type=click.Path(dir_okay=False))
@handle_errors
def torch_save_command(url: str, checkpoint_id: str, file: str) -> None:
    """Write one torch.save file with full (unsharded) tensors.

    \b
    Example:
      kvckpt torch-save redis://localhost:6379/0 step-100 model.pt
    """
    path = transfer.torch_save_checkpoint(url, checkpoint_id, file)
    click.echo(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    main()
