"""Two checkouts of kvckpt against each other, taking turns: is a change slower?

Each round runs one worker process per checkout (``PYTHONPATH`` set to it; the order
alternates between rounds), and each worker times the same cases on a fresh LMDB store in
/dev/shm and a shared local redis-server:

- 10,000 tensors of 4 KiB: ``dcp.save`` and ``dcp.load`` (planning, metadata, many keys);
- 1 GiB in 64 tensors: ``dcp.save`` re-saving one checkpoint id (the steady state) and
  ``dcp.load``.

Reports each case's median and p90 per checkout and the ratio new / old (time: above 1 is
slower), with JSON and markdown (``compare.json``, ``compare.md``).

    python benchmarks/compare.py --old ../kvckpt-main --new . --out docs/benchmark

Check ``/proc/loadavg`` first: the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import markdown_table, write_report
from timing import p90

CASES = ["small_save", "small_load", "big_save", "big_load"]
STORES = ["lmdb", "redis"]


def worker(args: argparse.Namespace) -> None:
    """Time every case ``--repeats`` times (after one warm-up) with the kvckpt on sys.path."""
    import torch
    import torch.distributed.checkpoint as dcp

    import kvckpt
    from kvckpt.format import FORMAT_VERSION

    small = {f"p{i}": torch.rand(1024) for i in range(args.small_tensors)}
    big = {f"w{i}": torch.rand(args.big_mib * 2**20 // 4 // 64) for i in range(64)}
    times: dict[str, list[float]] = {}
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-compare-", dir="/dev/shm"))
    try:
        for store in STORES:
            url = f"lmdb://{shm / 'store'}" if store == "lmdb" else args.redis
            for name, sd in (("small", small), ("big", big)):
                dest = {k: torch.zeros_like(v) for k, v in sd.items()}
                for rep in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    writer = kvckpt.KVStorageWriter(url, keep_last=1)
                    dcp.save(sd, storage_writer=writer, checkpoint_id=f"{name}-{rep % 2}")
                    t1 = time.perf_counter()
                    reader = kvckpt.KVStorageReader(url)
                    dcp.load(dest, storage_reader=reader, checkpoint_id=f"{name}-{rep % 2}")
                    t2 = time.perf_counter()
                    if rep:  # the first is the warm-up (fresh memory, connections)
                        times.setdefault(f"{store}/{name}_save", []).append(t1 - t0)
                        times.setdefault(f"{store}/{name}_load", []).append(t2 - t1)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps({"kvckpt": kvckpt.__file__, "format": FORMAT_VERSION, "times": times}))


def run_worker(tree: Path, args: argparse.Namespace, redis_url: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, __file__, "--worker", "--redis", redis_url]
    cmd += ["--repeats", str(args.repeats), "--small-tensors", str(args.small_tensors)]
    cmd += ["--big-mib", str(args.big_mib)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["kvckpt"].startswith(str(tree)):
        raise SystemExit(f"the worker for {tree} imported {result['kvckpt']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", help="the checkout to compare against")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case per worker")
    ap.add_argument("--small-tensors", type=int, default=10_000)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.old:
        ap.error("--old is required")

    sys.path.insert(0, str(Path(args.new).resolve()))
    from kvckpt.testing import RedisServer

    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    work = Path(tempfile.mkdtemp(prefix="kvckpt-compare-"))
    server = RedisServer(work / "redis")
    times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    formats = {}
    try:
        for rnd in range(args.rounds):
            order = ["old", "new"] if rnd % 2 == 0 else ["new", "old"]
            for which in order:
                server.client().flushall()
                result = run_worker(trees[which], args, server.url())
                formats[which] = result["format"]
                for case, values in result["times"].items():
                    times[which].setdefault(case, []).extend(values)
            print(f"round {rnd + 1} of {args.rounds} done (loadavg {os.getloadavg()[0]:.2f})")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for case in times["new"]:
        old, new = times["old"][case], times["new"][case]
        rows.append(
            (
                case,
                f"{statistics.median(old):.3f} / {p90(old):.3f}",
                f"{statistics.median(new):.3f} / {p90(new):.3f}",
                f"{statistics.median(new) / statistics.median(old):.2f}",
                f"{p90(new) / p90(old):.2f}",
            )
        )
    header = (
        "case",
        f"old (format {formats['old']}): median / p90 (s)",
        f"new (format {formats['new']}): median / p90 (s)",
        "new / old, median",
        "new / old, p90",
    )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{args.rounds} rounds taking turns, {args.repeats} timed repeats each; "
        f"small: {args.small_tensors} x 4 KiB, big: {args.big_mib} MiB in 64 tensors"
    )
    data = {"args": vars(args), "trees": {k: str(v) for k, v in trees.items()}, "times": times}
    write_report(args.out, "compare", markdown_table(header, rows), machine, data)


if __name__ == "__main__":
    main()
