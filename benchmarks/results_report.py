"""``benchmarks/run.py``'s report: where it ran (the CPU, memcpy's GB/s, LMDB's put ceiling,
xxh3's speed) and whether it met its targets, above the table of every row (``targets.rows``),
written to ``results.json``, ``results.md`` and ``results.png``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from report import figure, markdown_table, write_report
from targets import TARGETS, Row, missed, target_text
from timing import p90
from workload import MIB

#: The two memcpy settings of the store-mode processes: (results key part, label)
SETTINGS = (("default", "glibc's default"), ("nt", "non-temporal stores from the part size"))


def ratio_cell(v: float) -> str:
    """Two decimals; three below 1, where the targets sit (a cost of 0.102 against a bar of
    0.10 must not read 0.10)."""
    return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"


def machine_line(r: dict[str, Any]) -> str:
    """The run's machine line, naming the CPU (a run that did not record it says so)."""
    cpu = r.get("cpu") or "CPU not recorded"
    return r["machine"] if cpu in r["machine"] else f"{cpu}; {r['machine']}"


#: How reports name each copy way of ``kvckpt.engines._copy_ways`` (and ``way_name``).
WAY_NAMES = {
    "native": "native loop",
    "native-stream": "native loop, non-temporal stores",
    "native-no-prefetch": "native loop, no prefetch",
    "native-stream-no-prefetch": "native loop, non-temporal stores, no prefetch",
    "memcpy": "numpy's copy",
    "stream": "native copy, non-temporal stores",
}


def way_name(c: int | str) -> str:
    """A copy way in words: its name, or its piece size."""
    return WAY_NAMES.get(str(c)) or f"{int(c) // 1024} KiB pieces"


def _choice_line(what: str, way: dict[str, Any], by: str = "loads") -> str:
    timed = ", ".join(f"{way_name(c)} {ms:.0f}" for c, ms in way["ms_per_gib"].items())
    if way["chosen"] is None:
        chosen = "not chosen (too few values of a default part or more to time)"
    else:
        chosen = way_name(way["chosen"])
    return f"- {what}, chosen by timing the run's first {by}: {chosen}" + (
        f" (medians, ms per GiB on one thread: {timed})" if timed else ""
    )


def piece_line(r: dict[str, Any]) -> list[str]:
    """The ways to copy and hash (the native loop with either kind of store, or pieces of a
    size) and to copy unverified (numpy's, or the native non-temporal copy) the run's LMDB
    loads chose by timing, the way its LMDB saves chose to copy and hash (runs before saves
    chose apart lack it), and the timings (none for a run made before the choice was timed;
    runs before the native loop chose only a piece size, and copied unverified with numpy)."""
    lines = []
    way = r.get("copy_hash_way") or r.get("copy_hash_piece")
    if way is not None:
        lines.append(_choice_line("the verified LMDB load's copy-and-hash", way))
    if "copy_way" in r:
        lines.append(_choice_line("the unverified LMDB load's copy", r["copy_way"]))
    if "save_copy_hash_way" in r:
        saves = r["save_copy_hash_way"]
        lines.append(_choice_line("the checksummed LMDB save's copy-and-hash", saves, "saves"))
    return lines


def checksum_line(r: dict[str, Any]) -> list[str]:
    """The checksum's own speed, from the cache and from memory, and what it adds to a copy on
    one core that hashes and copies each piece (a verified load's way): at least the hash's
    time from the cache, memcpy's GB/s over the hash's of the copy's time, where the copy
    reads the piece the hash left in the cache or leaves what it read there; the hash's time
    from memory where it does neither (memcpy's ``rep movsb`` on some x86 CPUs). A load copies
    on two cores; where they share memory's bandwidth, one hashes while the other copies
    faster, and the load's cost can fall below these."""
    if "checksum_from_cache" not in r:
        return []
    hashing = r["checksum_from_cache"]["gbps"]
    line = f"- the checksum (xxh3), one thread, from the CPU's cache: {hashing:.1f} GB/s"
    if "checksum_from_memory" in r:
        line += f", from memory: {r['checksum_from_memory']['gbps']:.1f} GB/s"
    if "store_mode_default_memcpy" in r:
        copy = r["store_mode_default_memcpy"]["gbps"]
        line += (
            f"; one thread hashing and copying each piece, one of the two from the cache, adds"
            f" at least {copy / hashing:.3f} of the copy's time"
        )
        if "checksum_from_memory" in r:
            line += (
                f", and {copy / r['checksum_from_memory']['gbps']:.3f} where the copy neither"
                " reads the piece from the cache nor leaves it there"
            )
        line += (
            " (lower is better; a load's two threads, sharing memory's bandwidth, can hide"
            " part of it)"
        )
    return [line]


def header(r: dict[str, Any], rows: list[Row]) -> str:
    """Where the run ran and whether it passed: the CPU, memcpy's GB/s and LMDB's put ceiling
    on it, the date and command, the load average as it started, and the targets met and
    missed."""

    def gbps(name: str) -> str:
        return f"{r[name]['gbps']:.2f} GB/s"

    memcpy = [
        f"{gbps(f'store_mode_{key}_memcpy')} with {label}"
        for key, label in SETTINGS
        if f"store_mode_{key}_memcpy" in r
    ]
    own = [
        f"{gbps(f'store_mode_{key}_raw_put')} with {label}"
        for key, label in SETTINGS
        if f"store_mode_{key}_raw_put" in r
    ]
    ceiling = f"{gbps('raw_lmdb_put_steady')}" if "raw_lmdb_put_steady" in r else "not measured"
    if own:
        ceiling += f" (in a process of its own: {', '.join(own)})"
    parts = f" ({r['part_bytes_lmdb']} bytes)" if "part_bytes_lmdb" in r else ""
    gaps = missed(rows)
    short = [name for name, row in gaps if row is not None]
    unmeasured = [name for name, row in gaps if row is None]
    measured = len(TARGETS) - len(unmeasured)
    met = f"{measured - len(short)} of {measured} met"
    if unmeasured:  # (a run made before these rows existed)
        met += f"; not measured by this run: {'; '.join(unmeasured)}"
    lines = [
        f"- CPU: {r.get('cpu') or 'not recorded by this run'}; {r['machine']}",
        f"- memcpy, one thread, LMDB's value-sized pieces{parts} into memory in use: "
        + (", ".join(memcpy) if memcpy else "not measured in this run"),
        "- LMDB's put ceiling (its own put of the same values into a store that holds the "
        f"previous ones, one write transaction, no kvckpt): {ceiling}",
        *checksum_line(r),
        *piece_line(r),
        f"- {r['date']}; `{r['command']}`"
        + (f" at kvckpt commit {r['commit']}" if "commit" in r else "")
        + (
            f"; 1-minute load average {r['loadavg_start']:.2f} at the start"
            if "loadavg_start" in r
            else ""
        ),
        f"- targets: {met}" + ("; not met: " + "; ".join(short) if short else ""),
    ]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    """Every row: which way is better, the value, and the target and whether it passed."""
    return markdown_table(
        ("metric", "better", "measured", "target", "pass", "note"),
        (
            (
                row.metric,
                row.better,
                ratio_cell(row.value),
                target_text(row.target) or "-",
                "-" if row.met is None else "yes" if row.met else "no",
                row.note,
            )
            for row in rows
        ),
    )


def cases(results: dict[str, Any]) -> str:
    """Every case timed: its runs, median, p90 (nearest rank) and slowest run, in seconds, and
    the median's GB/s: the tails behind the ratios above."""

    timed = [(k, v) for k, v in results.items() if isinstance(v, dict) and v.get("runs_s")]
    return markdown_table(
        ("case", "runs", "median s", "p90 s", "max s", "GB/s (median)"),
        (
            (
                name,
                str(len(v["runs_s"])),
                f"{v['median_s']:.3f}",
                f"{p90(v['runs_s']):.3f}",
                f"{max(v['runs_s']):.3f}",
                f"{v['gbps']:.2f}",
            )
            for name, v in timed
        ),
    )


def chart(results: dict[str, Any], path: Path) -> None:
    """Every throughput measured (GB/s, higher is better), kvckpt's in orange."""
    names = [
        k
        for k, v in results.items()
        if isinstance(v, dict) and "gbps" in v and not k.startswith(("small_", "async_"))
    ]
    values = [results[k]["gbps"] for k in names]
    colors = ["tab:orange" if k.startswith("kv_") else "tab:gray" for k in names]
    with figure(path, figsize=(10, 0.35 * len(names) + 1.5)) as (_, ax):
        ax.barh(names[::-1], values[::-1], color=colors[::-1])
        ax.set_xlabel("GB/s (median; higher is better)")
        ax.set_title(
            f"kvckpt vs baselines, {results['state_dict_bytes'] / MIB:.0f} MiB state dict, "
            f"{str(results['date'])[:10]}\n{results.get('cpu') or 'CPU not recorded'}\n"
            f"{results['machine']}",
            fontsize=9,
        )
        for i, v in enumerate(values[::-1]):
            ax.text(v, i, f" {v:.2f}", va="center", fontsize=8)


def write(out: Path, results: dict[str, Any], rows: list[Row], with_chart: bool) -> None:
    """``results.json`` (the rows in ``ratios``), ``results.md`` and, unless not
    ``with_chart`` (or matplotlib is missing), ``results.png``."""
    results["ratios"] = [
        {
            "metric": row.metric,
            "value": row.value,
            "better": row.better,
            "target": target_text(row.target) or None,
            "met": row.met,
            "note": row.note,
        }
        for row in rows
    ]
    write_report(
        out,
        "results",
        f"{table(rows)}\n\nEvery case timed (the tails; `runs_s` in results.json has each run):"
        f"\n\n{cases(results)}",
        machine_line(results),
        results,
        head=header(results, rows),
        date=str(results["date"])[:10],
    )
    if with_chart:
        with contextlib.suppress(ImportError):
            chart(results, out / "results.png")
