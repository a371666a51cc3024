"""kvckpt with a CUDA state dict, next to DCP's FileSystemWriter on /dev/shm, in one run.

What a GPU training job waits for: ``dcp.save`` of the model on the GPU, ``dcp.load`` into
preallocated CUDA tensors, and the blocking part of ``dcp.async_save`` (staging the GPU state
to host memory). Medians of ``--repeats`` runs; ratios are against DCP on /dev/shm measured in
the same run. Needs a CUDA GPU; prints a markdown table and writes ``gpu.json`` to ``--out``.

    python benchmarks/gpu.py --size-mib 1024 --repeats 5 --out docs/benchmark/h100
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).parent))
from report import markdown_table, write_report
from workload import MIB, make_state_dict

from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.testing import RedisServer


def median_time(fn: Callable[[], Any], repeats: int, between: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        between()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2

    sd = {k: v.cuda() for k, v in make_state_dict(args.size_mib * MIB).items()}
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    size = sum(t.numel() * t.element_size() for t in sd.values())
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-gpu-", dir="/dev/shm"))
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvckpt-gpu-redis-")))
    lmdb_url = f"lmdb://{shm / 'store'}"
    ids = iter(range(10**9))
    fs_dirs: list[Path] = []

    def pause() -> None:
        # the training steps between two checkpoints; also lets the previous save's worker
        # thread drop its staged copy, so every writer starts from the same memory state
        gc.collect()
        time.sleep(0.25)

    def fs_writer() -> dcp.FileSystemWriter:
        for old in fs_dirs:
            shutil.rmtree(old, ignore_errors=True)
        fs_dirs[:] = [shm / f"fs{next(ids)}"]
        return dcp.FileSystemWriter(fs_dirs[0])

    last_id: dict[str, str] = {}

    def kv_writer(url: str) -> KVStorageWriter:
        last_id[url] = f"c{next(ids)}"
        return KVStorageWriter(url, checkpoint_id=last_id[url], keep_last=1)

    stores = {"kv_lmdb": lmdb_url, "kv_redis": server.url()}
    writers: dict[str, Callable[[], Any]] = {
        "dcp_fs_shm": fs_writer,
        "kv_lmdb": lambda: kv_writer(lmdb_url),
        "kv_redis": lambda: kv_writer(stores["kv_redis"]),
    }
    results: dict[str, Any] = {"state_dict_bytes": size}
    try:
        for name, make in writers.items():
            results[f"{name}_save"] = median_time(
                lambda m=make: dcp.save(sd, storage_writer=m()), args.repeats, pause
            )

            def load(name: str = name) -> None:
                if name == "dcp_fs_shm":
                    reader: Any = dcp.FileSystemReader(fs_dirs[0])
                else:
                    url = stores[name]
                    reader = KVStorageReader(url, checkpoint_id=last_id[url])
                dcp.load(dest, storage_reader=reader)

            results[f"{name}_load"] = median_time(load, args.repeats, pause)
            for k in sd:
                if not torch.equal(sd[k], dest[k]):
                    raise AssertionError(f"{name}: round trip differs at {k}")
                dest[k].zero_()

        blocked: dict[str, list[float]] = {name: [] for name in writers}
        for _ in range(args.repeats):
            for name, make in writers.items():  # writers take turns, one repeat each
                writer = make()
                pause()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=None)
                blocked[name].append(time.perf_counter() - t0)
                fut.result()
                del fut, writer
        for name, times in blocked.items():
            results[f"{name}_async_block"] = statistics.median(times)
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)

    rows = []
    for what, label in (
        ("save", "`dcp.save` from CUDA"),
        ("load", "`dcp.load` into CUDA"),
        ("async_block", "`dcp.async_save` blocking"),
    ):
        base = results[f"dcp_fs_shm_{what}"]
        rows.append(
            (
                label,
                f"{base:.3f}",
                f"{results[f'kv_lmdb_{what}'] / base:.2f}",
                f"{results[f'kv_redis_{what}'] / base:.2f}",
            )
        )
    gpu = torch.cuda.get_device_name(0)
    results["machine"] = (
        f"{gpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )
    results["command"] = "python benchmarks/gpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header = ("path", "DCP on /dev/shm (s)", "kvckpt LMDB / DCP", "kvckpt Redis / DCP")
    table = markdown_table(header, rows)
    print(
        f"{size / MIB:.0f} MiB state dict; medians of {args.repeats}; time ratios (lower is faster)"
    )
    write_report(args.out, "gpu", table, results.pop("machine"), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
