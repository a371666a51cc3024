"""How every benchmark reports: markdown tables, the JSON and markdown files of a run, and
charts.

Each benchmark prints its table and the machine line on stdout, and writes ``NAME.json`` (the
data), ``NAME.md`` (the table, then the machine and date) and, where it has one, ``NAME.png``
into its output directory.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name and its family and model numbers (``/proc/cpuinfo``), for the
    machine line: figures from one VM type are not another's, and a VM may name its CPU only
    "AMD EPYC", which the family (25: Zen 3 and 4; 26: Zen 5) tells apart."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block ends
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def source_commit() -> str:
    """The commit of the kvckpt checkout a benchmark ran from (``-dirty`` with uncommitted
    changes), for the report: which code made the figures; ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "kvckpt", "benchmarks"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; cells are written as they are (format numbers before)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(
    out: str | Path,
    name: str,
    table: str,
    machine: str,
    data: dict[str, Any],
    *,
    head: str = "",
    date: str | None = None,
) -> None:
    """``NAME.json`` and ``NAME.md`` into ``out``: ``head`` (if any) above the table, the
    machine and ``date`` (today's unless given) below it."""
    text = f"{head}\n\n{table}" if head else table
    print(text)
    print(machine)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": machine, **data}, indent=1))
    (out / f"{name}.md").write_text(f"{text}\n\n{machine}; {date or time.strftime('%Y-%m-%d')}\n")


@contextmanager
def figure(path: str | Path, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` of ``plt.subplots(**subplots)`` (matplotlib without a display), saved
    to ``path`` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
