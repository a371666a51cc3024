"""kvckpt side-by-side benchmark: every baseline and every kvckpt path, in one run.

    python benchmarks/run.py                       # 1 GiB state dict, 5 repeats (minutes)
    python benchmarks/run.py --size-mib 4 --repeats 1 --small-tensors 50 --smoke   # smoke run
    python benchmarks/run.py --check               # exit 1 naming each target not met

Baselines: DCP FileSystemWriter/Reader on /dev/shm and on disk, torch.save/load on /dev/shm, a
minimal raw-socket Redis client (pipelined SET from memory, GET with recv_into straight into a
preallocated buffer), raw LMDB put/get, glibc's memcpy, xxh3 from the CPU's cache and from memory.
kvckpt: LMDB (first save into a new store, steady state with keep_last, load), Redis (save into an
empty server and steady saves with keep_last, load), 10,000 small tensors, dcp.async_save blocking
time, and peak anonymous RSS. The 1 GiB saves (kvckpt's, the raw-socket SET, DCP's t=1 and t=2) take
turns, as do the loads. Figures are medians; ratios are taken within this run, and each row says
which way is better. Writes results.json, results.md (the CPU, memcpy's GB/s, LMDB's put ceiling and
the checksum's speed, then every row with its target and whether it passed) and results.png to
--out.
"""

# The modules, each importing only modules below it in this list:
#   run.py             this entry point: the flags, --check
#   results_report.py  results.md (where it ran, every row), results.json, results.png
#   targets.py         the rows, which way each is better, TARGETS (the one table of targets)
#   report.py          tables and files, shared by every benchmark
#   bench.py           the sections of a run, in the order they run
#   store_mode.py      the sections' processes of their own (glibc's memcpy settings)
#   baselines.py       the raw-socket Redis client, LMDB's own put, memcpy, xxh3
#   timing.py          timing in a block, taking turns, peak RSS
#   workload.py        the state dict

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from statistics import median

import bench
import results_report
import targets
import timing
import torch
from baselines import checksum_from_cache_times, checksum_from_memory_times
from report import cpu_name, source_commit

from kvckpt.engines._copy_ways import COPY_HASH_WAY, COPY_WAY, SAVE_COPY_HASH_WAY

warnings.filterwarnings("ignore")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=1024, help="state dict size")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs per case, at least (median taken; cases taking turns run whole rotations)",
    )
    p.add_argument(
        "--small-tensors",
        type=int,
        default=10_000,
        help="number of 4 KiB tensors in the small-tensor case",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that every case runs, not what it measures: the cases taking turns run "
        "--repeats rounds instead of whole rotations (the test suite's run)",
    )
    p.add_argument("--disk-dir", default=None, help="a directory on disk (default: /tmp)")
    p.add_argument(
        "--huge-tmpfs",
        default=None,
        metavar="DIR",
        help="a directory on a tmpfs mounted with huge=within_size or huge=always: the first "
        "saves, LMDB's and DCP's two-thread one, are timed there too",
    )
    p.add_argument("--out", default="benchmarks/results", help="where results go")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1, naming every target row that falls short (measured against target)",
    )
    p.add_argument(
        "--from-json",
        help="measure nothing: the report (and --check) of an earlier run's results.json",
    )
    p.add_argument(
        "--with",
        dest="extra",
        action="append",
        choices=["goodput", "scaling"],
        default=[],
        help="also run benchmarks/goodput.py (training time lost per failure, ~30 min) or "
        "benchmarks/scaling.py (1-4 ranks, one Redis vs a cluster), at their defaults, into --out",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.from_json and args.extra:
        ap.error("--with runs benchmarks: not with --from-json")
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    else:
        timing.WHOLE_ROTATIONS = not args.smoke
        loadavg = os.getloadavg()[0]  # the machine must be otherwise idle: said in the report
        results = bench.run(args)
        results["loadavg_start"] = loadavg
        results["cpu"] = cpu_name()
        results["commit"] = source_commit()
        for key, measure in (
            ("checksum_from_cache", checksum_from_cache_times),
            ("checksum_from_memory", checksum_from_memory_times),
        ):
            hashed, times = measure(repeats=7)
            results[key] = {"median_s": median(times), "gbps": hashed / median(times) / 1e9}
        for key, choice in (
            ("copy_hash_way", COPY_HASH_WAY),  # chosen by timing the run's first loads
            ("copy_way", COPY_WAY),
            ("save_copy_hash_way", SAVE_COPY_HASH_WAY),  # and its first LMDB saves
        ):
            results[key] = {
                "chosen": choice.chosen,
                "ms_per_gib": {str(c): m * 2**30 * 1e3 for c, m in choice.medians().items()},
            }
        results["machine"] = (
            f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f}"
            f" GiB, Python {platform.python_version()}, torch {torch.__version__}"
        )
        results["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        results["command"] = "python benchmarks/run.py " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
    rows = targets.rows(results)
    out = Path(args.out)
    results_report.write(out, results, rows, with_chart=not args.no_chart)
    chart_note = "" if args.no_chart else ", results.png"
    print(f"\nwrote {out / 'results.json'}, results.md{chart_note}")
    for name in args.extra:
        script = Path(__file__).with_name(f"{name}.py")
        subprocess.run([sys.executable, str(script), "--out", str(out)], check=True)
    missed = targets.failures(rows)
    if args.check:
        for line in missed:
            print(f"target not met: {line}")
        print(f"{len(targets.TARGETS) - len(missed)} of {len(targets.TARGETS)} targets met")
        return 1 if missed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
