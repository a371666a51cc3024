"""One row per published run of ``benchmarks/run.py``: where it ran, the seconds users ask
about, and the targets it met and missed.

    python benchmarks/hosts.py docs/benchmark/intel-xeon docs/benchmark/amd-epyc ...
    python benchmarks/hosts.py --summary docs/benchmark/intel-xeon ...

Reads each directory's ``results.json`` and prints the markdown table that
``docs/PERFORMANCE.md`` shows under "Every host measured", or with ``--summary`` the shorter
one at its top (each run's ratios against DCP and its checksum costs), so neither table is
typed by hand. Measures nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report import markdown_table

#: (heading, cases): medians in seconds for the run's state dict, one column per store.
_SECONDS = (
    (
        "LMDB s: first / steady / load",
        ("kv_lmdb_save_first", "kv_lmdb_save_steady", "kv_lmdb_load"),
    ),
    (
        "Redis s: first / steady / load",
        ("kv_redis_save", "kv_redis_save_steady", "kv_redis_load"),
    ),
    ("DCP s: t=2 save / load", ("dcp_fs_shm_save_t2_turns", "dcp_fs_shm_load")),
)
#: Shorter words for the target rows' names, applied in order.
_SHORTER = (
    (r" \((speed-up|time ratio|extra time, fraction)\)$", ""),
    (r", taking turns", ""),
    (r"DCP FileSystemReader shm", "DCP's reader"),
    (r"DCP FS shm ", "DCP "),
    (r"save first, new store", "first save"),
    (r"save steady", "steady save"),
    (r"checksum cost, ", "checksums: "),
)


def short_name(metric: str) -> str:
    """A target row's name as the table gives it."""
    for pattern, words in _SHORTER:
        metric = re.sub(pattern, words, metric)
    return metric


def _gbps(results: dict[str, Any], case: str) -> str:
    value = results.get(case, {}).get("gbps")
    return f"{value:.1f}" if value else "-"


def _targets(results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run's target rows, and those of them it missed."""
    targets = [r for r in results.get("ratios", []) if r.get("target")]
    return targets, [r for r in targets if not r["met"]]


def row(directory: Path) -> list[str]:
    """The table's row for the run whose files are in ``directory``."""
    results = json.loads((directory / "results.json").read_text())
    seconds = []
    for _, cases in _SECONDS:
        medians = [results.get(case, {}).get("median_s") for case in cases]
        seconds.append(" / ".join(f"{m:.2f}" if m is not None else "-" for m in medians))
    targets, missed = _targets(results)
    return [
        f"{results.get('date', '?')[:10]}, `{directory.name}/`",
        str(results.get("cpu", "?")),
        _gbps(results, "store_mode_default_memcpy"),
        _gbps(results, "raw_lmdb_put_steady"),
        _gbps(results, "checksum_from_cache"),
        *seconds,
        f"{len(targets) - len(missed)} of {len(targets)}",
        "; ".join(f"{short_name(r['metric'])} {r['value']:#.3g}" for r in missed) or "none",
    ]


#: (heading, [(metric, how to write its value)]): the summary's columns, from a run's ratios.
_SUMMARY = (
    ("LMDB load, x DCP's reader", (("LMDB load / DCP FileSystemReader shm", "{:.1f}x"),)),
    (
        "LMDB save, steady / first, x DCP t=2",
        (
            ("LMDB save steady / DCP FS shm t=2, taking turns", "{:.1f}x"),
            ("LMDB save first, new store / DCP FS shm t=2, taking turns", "{:.2f}x"),
        ),
    ),
    ("Redis save, x DCP t=1", (("Redis save / DCP FS shm t=1, taking turns", "{:.2f}x"),)),
    (
        "async_save blocks, LMDB / Redis, x DCP's (lower is better)",
        (
            ("async_save blocking: LMDB / DCP default stager", "{:.2f}x"),
            ("async_save blocking: Redis / DCP default stager", "{:.2f}x"),
        ),
    ),
    (
        "checksum cost, LMDB save / load",
        (("checksum cost, LMDB save", "{:.3f}"), ("checksum cost, LMDB load", "{:.3f}")),
    ),
    (
        "checksum cost, Redis save / load",
        (("checksum cost, Redis save", "{:.3f}"), ("checksum cost, Redis load", "{:.3f}")),
    ),
)


def _ratio(results: dict[str, Any], metric: str, form: str) -> str:
    """The run's ratio named ``metric`` (its name less the kind in parentheses), or "-"."""
    for r in results.get("ratios", []):
        if re.sub(r" \([^()]*\)$", "", r["metric"]) == metric:
            return form.format(r["value"])
    return "-"


def summary_row(directory: Path) -> list[str]:
    """The summary's row for the run whose files are in ``directory``."""
    results = json.loads((directory / "results.json").read_text())
    targets, missed = _targets(results)
    return [
        f"{results.get('cpu', '?')}, {results.get('date', '?')[:10]}, `{directory.name}/`",
        *(" / ".join(_ratio(results, m, form) for m, form in cells) for _, cells in _SUMMARY),
        f"{len(targets) - len(missed)} of {len(targets)}",
    ]


def summary(directories: list[Path]) -> str:
    header = ["CPU, run", *(heading for heading, _ in _SUMMARY), "targets met"]
    return markdown_table(header, [summary_row(d) for d in directories])


def table(directories: list[Path]) -> str:
    header = [
        "run, files",
        "CPU",
        "memcpy GB/s",
        "LMDB put GB/s",
        "xxh3 GB/s",
        *(heading for heading, _ in _SECONDS),
        "targets met",
        "missed (measured)",
    ]
    return markdown_table(header, [row(d) for d in directories])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="directories holding results.json")
    parser.add_argument(
        "--summary", action="store_true", help="the ratios against DCP and the checksum costs"
    )
    args = parser.parse_args(argv)
    print(summary(args.runs) if args.summary else table(args.runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
