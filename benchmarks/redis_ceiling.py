"""The Redis throughput ceiling: raw-socket SET / GET-into-buffer over N parallel connections
(one thread each) against one redis-server with 1, 4 or 8 ``io-threads``, with GETs sent a
window of ``--read-ahead-mib`` ahead of the reply being read (``all``: every GET at once).

This is the upper bound any client, kvckpt included, can reach from one process against one
server on this machine; ``benchmarks/run.py`` compares kvckpt to the one-connection case.

    python benchmarks/redis_ceiling.py --size-mib 1024 --part-mib 4 --read-ahead-mib 16 all

``--ranks N`` measures instead what the ranks of a data-parallel job meet when they load: N
processes, started together, each GET every value into its own buffer (one raw connection each,
a 16 MiB window), alone and then all at once, into memory already touched and into fresh memory,
taking turns. ``benchmarks/goodput.py``'s Redis restore (2 ranks, 1 GiB each in its accel
economy) is bounded by this:

    python benchmarks/redis_ceiling.py --ranks 2 --size-mib 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from baselines import RawRedis
from timing import threads_seconds
from workload import MIB, make_state_dict, tensor_parts

from kvckpt.testing import RedisServer

Items = list[tuple[bytes, memoryview]]


def split(items: Items, n: int) -> list[Items]:
    """``n`` contiguous groups of about equal bytes."""
    total = sum(len(v) for _, v in items)
    groups: list[Items] = [[] for _ in range(n)]
    done = 0
    for key, value in items:
        groups[min(n - 1, done * n // total)].append((key, value))
        done += len(value)
    return groups


def in_parallel(conns: list[RawRedis], groups: list[Items], op: str, *args: int) -> float:
    pairs = zip(conns, groups, strict=True)
    return threads_seconds([functools.partial(getattr(c, op), g, *args) for c, g in pairs])


def rank_reader(
    port: int, size_mib: int, part_mib: int, fresh: bool, start: Any, times: Any
) -> None:
    """One rank's load: GET every value into this process's own (fresh or touched) buffer."""
    sd = make_state_dict(size_mib * MIB)
    dest = {k: torch.empty_like(v) if fresh else torch.zeros_like(v) for k, v in sd.items()}
    items = tensor_parts(sd, part_mib * MIB)
    dests = tensor_parts(dest, part_mib * MIB)
    dest_items = [(k, d) for (k, _), (_, d) in zip(items, dests, strict=True)]
    conn = RawRedis(port)
    start.wait()
    t0 = time.perf_counter()
    conn.get_into(dest_items, 16 * MIB)
    elapsed = time.perf_counter() - t0
    if not all(torch.equal(sd[k], dest[k]) for k in sd):
        raise AssertionError("round trip differs")
    times.put(elapsed)


def ranks_loading(args: argparse.Namespace) -> int:
    """``--ranks N``: N processes each load the whole state, as the ranks of a DDP job do."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix="kvckpt-ceiling-")))
    conn = RawRedis(server.port)
    sd = make_state_dict(args.size_mib * MIB)
    size = sum(t.nbytes for t in sd.values())
    conn.set_many(tensor_parts(sd, args.part_mib * MIB))
    conn.sock.close()
    del sd
    ctx = mp.get_context("spawn")
    cases = [(n, fresh) for n in sorted({1, args.ranks}) for fresh in (False, True)]
    slowest: dict[tuple[int, bool], list[float]] = {case: [] for case in cases}
    try:
        for _ in range(args.repeats):
            for n, fresh in cases:
                start, times = ctx.Barrier(n), ctx.Queue()
                procs = [
                    ctx.Process(
                        target=rank_reader,
                        args=(server.port, args.size_mib, args.part_mib, fresh, start, times),
                    )
                    for _ in range(n)
                ]
                for p in procs:
                    p.start()
                slowest[(n, fresh)].append(max(times.get() for _ in procs))
                for p in procs:
                    p.join()
                    if p.exitcode:
                        raise SystemExit(f"a reader failed (exit code {p.exitcode})")
    finally:
        server.stop()
    print(
        "| ranks loading at once | destination | each rank's load, median / max (s) "
        "| aggregate GB/s |\n|---|---|---|---|"
    )
    for (n, fresh), times_s in slowest.items():
        med = statistics.median(times_s)
        print(
            f"| {n} | {'fresh memory' if fresh else 'touched memory'} | {med:.2f} / "
            f"{max(times_s):.2f} | {n * size / med / 1e9:.2f} |",
            flush=True,
        )
    print(f"\n{size / 2**30:.2f} GiB per rank in {args.part_mib} MiB values; one redis-server")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--part-mib", type=int, default=4, help="value size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--io-threads", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--read-ahead-mib",
        nargs="+",
        default=["16", "all"],
        help="bytes of GET replies outstanding per connection (all: every GET at once)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="instead: this many processes each GET every value, alone and at once",
    )
    args = parser.parse_args(argv)
    if args.ranks:
        return ranks_loading(args)
    windows = [(w, 1 << 62 if w == "all" else int(w) * MIB) for w in args.read_ahead_mib]

    sd = make_state_dict(args.size_mib * MIB)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    items = tensor_parts(sd, args.part_mib * MIB)
    dests = tensor_parts(dest, args.part_mib * MIB)
    dest_items = [(k, d) for (k, _), (_, d) in zip(items, dests, strict=True)]
    size = sum(len(v) for _, v in items)
    print(
        "| io-threads | connections | read-ahead MiB | SET GB/s | GET-into GB/s |\n"
        "|---|---|---|---|---|"
    )
    for io in args.io_threads:
        extra = ("--io-threads", str(io), "--io-threads-do-reads", "yes") if io > 1 else ()
        server = RedisServer(Path(tempfile.mkdtemp(prefix="kvckpt-ceiling-")), *extra)
        client = server.client()
        try:
            for n in args.connections:
                conns = [RawRedis(server.port) for _ in range(n)]
                sets: list[float] = []
                gets: dict[str, list[float]] = {w: [] for w, _ in windows}
                for _ in range(args.repeats):
                    client.flushall()
                    sets.append(in_parallel(conns, split(items, n), "set_many"))
                    for w, window in windows:
                        gets[w].append(in_parallel(conns, split(dest_items, n), "get_into", window))
                if not all(torch.equal(sd[k], dest[k]) for k in sd):
                    raise AssertionError("round trip differs")
                for conn in conns:
                    conn.sock.close()
                for w, _ in windows:
                    print(
                        f"| {io} | {n} | {w} | {size / statistics.median(sets) / 1e9:.2f} | "
                        f"{size / statistics.median(gets[w]) / 1e9:.2f} |",
                        flush=True,
                    )
        finally:
            client.close()
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
