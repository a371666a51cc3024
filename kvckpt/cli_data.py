"""The ``kvckpt`` commands that move checkpoint data: verify, export, import, copy and
torch-save. Each imports torch (through the module that does the work) only when it runs, so
the commands that list and inspect stay quick to start.
"""

from __future__ import annotations

import sys

import click

from .cli_common import (
    EXIT_VERIFY_FAILED,
    count,
    emit,
    handle_errors,
    human_bytes,
    json_option,
    quiet_option,
    show_progress,
)
from .stores import open_store


@click.command("verify")
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
    from .verify import verify

    report = verify(url, checkpoint_id, progress=show_progress(quiet))
    if as_json:
        emit(
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
            click.echo(f"... and {count(len(report.problems) - 100, 'more problem')}")
        keys = count(report.keys, "key")
        if report.ok:
            click.echo(f"{checkpoint_id}: OK ({keys}, {human_bytes(report.total_bytes)})")
        else:
            problems = count(len(report.problems), "problem")
            click.echo(f"{checkpoint_id}: FAILED ({problems} in {keys})")
    if not report.ok:
        sys.exit(EXIT_VERIFY_FAILED)


@click.command("export")
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
    Face safetensors for evaluation and serving (--format safetensors). DIRECTORY must be new
    or empty.

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
        from .dcp_files import export_checkpoint

        out = export_checkpoint(url, checkpoint_id, directory, progress=show_progress(quiet))
    if as_json:
        emit({"checkpoint_id": checkpoint_id, "directory": str(out), "format": fmt})
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


@click.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.argument("url")
@click.argument("checkpoint_id")
@quiet_option
@json_option
@handle_errors
def import_command(
    directory: str, url: str, checkpoint_id: str, quiet: bool, as_json: bool
) -> None:
    """Import a directory written by DCP's FileSystemWriter (any world size). A store that
    cannot take it safely (a Redis that may evict keys, one without room) is refused before
    anything is written (exit 6).

    --json: {"directory", "url", "checkpoint_id", "items", "total_bytes"}.

    \b
    Example:
      kvckpt import /checkpoints/step-100 lmdb:///dev/shm/ckpt step-100
    """
    from .dcp_files import import_checkpoint

    record = import_checkpoint(directory, url, checkpoint_id, progress=show_progress(quiet))
    if as_json:
        emit(
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
        f"imported {directory} as {checkpoint_id} ({count(len(record.locations), 'item')}, "
        f"{human_bytes(record.total_bytes)})"
    )


@click.command("copy")
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
    """Copy a checkpoint to another store (or under a new id). A destination that cannot take
    it safely (a Redis that may evict keys, one without room) is refused before anything is
    written (exit 6).

    --json: {"source", "checkpoint_id", "destination", "new_id", "total_bytes"}.

    \b
    Example:
      kvckpt copy lmdb:///dev/shm/ckpt step-100 redis://shared:6379/0
    """
    from .copying import copy_checkpoint

    record = copy_checkpoint(
        src_url, checkpoint_id, dst_url, new_id, overwrite=force, progress=show_progress(quiet)
    )
    destination = open_store(dst_url).url
    if as_json:
        emit(
            {
                "source": open_store(src_url, create=False).url,
                "checkpoint_id": checkpoint_id,
                "destination": destination,
                "new_id": record.checkpoint_id,
                "total_bytes": record.total_bytes,
            }
        )
        return
    click.echo(
        f"copied {checkpoint_id} to {destination} as "
        f"{record.checkpoint_id} ({human_bytes(record.total_bytes)})"
    )


@click.command("torch-save")
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
    from .dcp_files import torch_save_checkpoint

    path = torch_save_checkpoint(url, checkpoint_id, file)
    if as_json:
        emit({"checkpoint_id": checkpoint_id, "file": str(path)})
        return
    click.echo(f"wrote {path}")


#: The commands above, for the ``kvckpt`` group to add.
COMMANDS = (verify_command, export_command, import_command, copy_command, torch_save_command)
