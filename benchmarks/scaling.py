"""Aggregate save and load throughput with 1, 2 and 4 ranks: one Redis server vs a 3-primary
Redis Cluster, in the same run.

Each rank saves (and then loads) its own shard of ``--mib-per-rank`` MiB of fp32 tensors, all
ranks at once, in one collective ``dcp.save`` / ``dcp.load``; throughput is total bytes over the
wall time of the slowest rank, median of ``--repeats``.

    python benchmarks/scaling.py --mib-per-rank 128 --repeats 3 --out docs/benchmark
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import markdown_table, write_report  # noqa: E402

from kvckpt import KVStorageReader, KVStorageWriter, open_store  # noqa: E402
from kvckpt.testing import RedisClusterProcesses, RedisServer, free_port  # noqa: E402


def rank_state(rank: int, mib: int) -> dict[str, torch.Tensor]:
    n = max(1, mib // 8)  # 8 MiB tensors
    return {f"r{rank}.t{i}": torch.full((2 << 20,), float(rank + i)) for i in range(n)}


def worker(rank: int, world: int, port: int, url: str, mib: int, repeats: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    sd = rank_state(rank, mib)
    times: dict[str, list[float]] = {"save": [], "load": []}
    for rep in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id=f"c{rep}")
        dist.barrier()
        times["save"].append(time.perf_counter() - t)
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        dist.barrier()
        t = time.perf_counter()
        dcp.load(target, storage_reader=KVStorageReader(url, checkpoint_id=f"c{rep}"))
        dist.barrier()
        times["load"].append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(url: str, world: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    out = tmp / f"times-{world}.json"
    mp.spawn(
        worker,
        args=(world, free_port(), url, args.mib_per_rank, args.repeats, str(out)),
        nprocs=world,
        join=True,
    )
    times = json.loads(out.read_text())
    total = world * max(1, args.mib_per_rank // 8) * 8 * 2**20
    engine = open_store(url)
    engine.delete_prefix("")
    return {op: total / statistics.median(times[op]) / 1e9 for op in ("save", "load")}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mib-per-rank", type=int, default=128)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvckpt-scaling-"))
    server = RedisServer(tmp / "single")
    cluster = RedisClusterProcesses(tmp / "cluster", masters=3)
    results: dict[str, dict[int, dict[str, float]]] = {"one server": {}, "3-primary cluster": {}}
    try:
        for world in [int(r) for r in args.ranks.split(",")]:
            results["one server"][world] = measure(server.url(), world, args, tmp)
            results["3-primary cluster"][world] = measure(cluster.url(), world, args, tmp)
            print(world, {k: v[world] for k, v in results.items()}, flush=True)
    finally:
        server.stop()
        cluster.stop()
    rows = []
    for world, one in results["one server"].items():
        many = results["3-primary cluster"][world]
        rows.append(
            (
                world,
                f"{one['save']:.2f}",
                f"{many['save']:.2f}",
                f"{many['save'] / one['save']:.2f}",
                f"{one['load']:.2f}",
                f"{many['load']:.2f}",
                f"{many['load'] / one['load']:.2f}",
            )
        )
    header = ("ranks", "one server save GB/s", "cluster save GB/s", "cluster / one")
    header += ("one server load GB/s", "cluster load GB/s", "cluster / one")
    table = markdown_table(header, rows)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, all servers and ranks on this one "
        f"machine; {args.mib_per_rank} MiB per rank; medians of {args.repeats}"
    )
    write_report(args.out, "scaling", table, machine, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
