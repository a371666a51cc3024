"""The Redis throughput ceiling: raw-socket SET / GET-into-buffer over N parallel connections
(one thread each) against one redis-server with 1, 4 or 8 ``io-threads``, with GETs sent a
window of ``--read-ahead-mib`` ahead of the reply being read (``all``: every GET at once).

This is the upper bound any client, kvckpt included, can reach from one process against one
server on this machine; ``benchmarks/run.py`` compares kvckpt to the one-connection case.

    python benchmarks/redis_ceiling.py --size-mib 1024 --part-mib 4 --read-ahead-mib 16 all
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from run import MIB, RawRedis, make_state_dict, tensor_parts

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
    calls: list[Callable[..., None]] = [getattr(c, op) for c in conns]
    threads = [
        threading.Thread(target=f, args=(g, *args)) for f, g in zip(calls, groups, strict=True)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


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
    args = parser.parse_args(argv)
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
