"""What every ``kvckpt`` command shares: the exit codes and the mapping of errors to them, the
``--json`` and ``--quiet`` options, and the formatting of sizes, times, counts and tables.

Imports no torch, so the commands that only list and inspect answer at once.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import sys
from collections.abc import Callable, Sequence, Set
from typing import Any, TypeVar

import click

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


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and the noun in the number it takes: "1 key", "2 keys", "0 keys"."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def show_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def iso_time(ts: float) -> str:
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
            emit({"error": message, "exit_code": code})
        sys.exit(code)

    return wrapper  # type: ignore[return-value]


def emit(doc: Any) -> None:
    """Print ``doc`` as the command's one JSON document."""
    click.echo(json.dumps(doc, indent=2))


def show_progress(quiet: bool) -> bool:
    """Whether to draw a progress bar: on a terminal, unless ``--quiet``."""
    return not quiet and sys.stderr.isatty()


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout (errors too)."
)
