"""Checkpoints of many small items: what a large MoE model saved with FSDP looks like to the
storage layer (hundreds of thousands of items).

For each item count (``--items``, 100,000 and 1,000,000 by default), one process saves and
loads a state dict of that many small fp32 tensors (``--floats`` each, 16 by default), taking
turns, ``--repeats`` rounds (3; counts of 500,000 and more ``--large-repeats`` rounds, 1 by
default: one DCP round trip of 1,000,000 items takes minutes here):

- DCP ``FileSystemWriter`` / ``FileSystemReader`` on /dev/shm (``thread_count=1``);
- kvckpt into LMDB on /dev/shm and into a local redis-server.

Reported per case: save, load and save + load wall time (medians, and the slowest run); and
the metadata decode alone: kvckpt's msgpack decode of its metadata value (``decode_metadata``)
against DCP's unpickling of its ``.metadata`` file, for the same checkpoint. Ratios are against
DCP in the same run.

    python benchmarks/many_items.py --out docs/benchmark        # ~20 min on 2 cores
    python benchmarks/many_items.py --items 2000 --repeats 1    # a smoke run (the tests)

Check ``/proc/loadavg`` first: the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from report import markdown_table, write_report

import kvckpt
from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.engines.lmdb import close_idle_environments
from kvckpt.format import decode_metadata
from kvckpt.keys import meta_key
from kvckpt.testing import RedisServer


def state(items: int, floats: int) -> dict[str, torch.Tensor]:
    """``items`` tensors named as FSDP names an MoE model's experts' parameters."""
    return {
        f"model.layers.{i // 512}.experts.{i % 512}.w{i % 3}": torch.full((floats,), float(i))
        for i in range(items)
    }


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(n: int, args: argparse.Namespace, shm: Path, redis_url: str) -> dict[str, Any]:
    sd = state(n, args.floats)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    out: dict[str, dict[str, list[float]]] = {}
    places = {
        "DCP FileSystemWriter/Reader, /dev/shm": "dcp",
        "kvckpt LMDB, /dev/shm": "lmdb",
        "kvckpt Redis": "redis",
    }
    names = list(places)
    repeats = args.repeats if n < 500_000 else args.large_repeats
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kind = places[name]
            where = shm / f"{kind}-{n}-{r}"
            url = {"dcp": str(where), "lmdb": f"lmdb://{where}", "redis": redis_url}[kind]
            writer: Any = (
                dcp.FileSystemWriter(url, thread_count=1)
                if kind == "dcp"
                else KVStorageWriter(url, keep_last=1)
            )
            cid = None if kind == "dcp" else f"c{r}"
            save = timed(lambda w=writer, c=cid: dcp.save(sd, storage_writer=w, checkpoint_id=c))
            reader: Any = (
                dcp.FileSystemReader(url)
                if kind == "dcp"
                else KVStorageReader(url, checkpoint_id=cid)
            )
            load = timed(lambda rd=reader: dcp.load(dest, storage_reader=rd))
            assert torch.equal(dest[next(reversed(dest))], sd[next(reversed(sd))])
            decode = _decode(kind, url, cid)
            cell = out.setdefault(name, {"save": [], "load": [], "total": [], "decode": []})
            cell["save"].append(save)
            cell["load"].append(load)
            cell["total"].append(save + load)
            cell["decode"].append(decode)
            print(
                f"[{n} items] {name}: save {save:.2f} s, load {load:.2f} s, decode {decode:.3f} s"
            )
            if kind == "dcp":
                shutil.rmtree(where)
            elif kind == "lmdb":
                close_idle_environments(str(where))
                shutil.rmtree(where)
        for v in dest.values():
            v.zero_()
    return out


def _decode(kind: str, url: str, cid: str | None) -> float:
    """The metadata decode alone, from bytes already in memory: DCP unpickles ``.metadata``;
    kvckpt decodes its msgpack value (with every check a load makes)."""
    if kind == "dcp":
        raw = (Path(url) / ".metadata").read_bytes()
        start = time.perf_counter()
        pickle.loads(raw)  # DCP's own format, written by this run
    else:
        engine = kvckpt.open_store(url)
        assert cid is not None
        value = engine.get(meta_key(engine.prefix, cid))
        assert value is not None
        raw = bytes(value)
        start = time.perf_counter()
        decode_metadata(raw, where="benchmark")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", default="100000,1000000", help="item counts, comma-separated")
    ap.add_argument("--floats", type=int, default=16, help="fp32 values per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-repeats", type=int, default=1, help="rounds at 500,000 items and more")
    ap.add_argument("--out", default=None, help="write many_items.json and .md here")
    args = ap.parse_args()
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-many-", dir="/dev/shm"))
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvckpt-many-redis-")))
    started = time.time()
    results: dict[str, Any] = {}
    try:
        for n in (int(x) for x in args.items.split(",")):
            results[str(n)] = measure(n, args, shm, server.url())
            server.client().flushall()
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
    rows = []
    for n, cases in results.items():
        base = cases["DCP FileSystemWriter/Reader, /dev/shm"]
        for name, cell in cases.items():
            med = {k: statistics.median(v) for k, v in cell.items()}
            ratio = {k: med[k] / statistics.median(base[k]) for k in med}
            rows.append(
                (
                    f"{int(n):,}",
                    name,
                    f"{med['save']:.2f}",
                    f"{med['load']:.2f}",
                    f"{med['total']:.2f} (max {max(cell['total']):.2f})",
                    f"{ratio['total']:.2f}",
                    f"{med['decode']:.3f}",
                    f"{ratio['decode']:.2f}",
                )
            )
    table = markdown_table(
        (
            "items",
            "system",
            "save (s)",
            "load (s)",
            "save + load (s)",
            "save + load / DCP",
            "metadata decode (s)",
            "decode / DCP unpickle",
        ),
        rows,
    )
    minutes = (time.time() - started) / 60
    machine = (
        f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores, torch "
        f"{torch.__version__}; {args.floats} floats per tensor; medians of {args.repeats} "
        f"({args.large_repeats} at 500,000 items and more), taking turns; {minutes:.0f} min"
    )
    if args.out:
        write_report(
            args.out, "many_items", table, machine, {"args": vars(args), "results": results}
        )
    else:
        print(table)
        print(machine)


if __name__ == "__main__":
    main()
