"""What each way a load copies a value out of a store costs on this machine, with and without
its checksum.

An LMDB load copies each value out of the memory map on two threads (alternate values). A
verified load also hashes it with xxh3, in one of the ways each process chooses among by timing
(``kvckpt.engines._copy_ways``): kvckpt's native loop, with ordinary stores or with
non-temporal ones, prefetching the source ahead or not, or python-xxhash hashing a piece that
numpy then copies while it is still in the cache. An unverified load copies with numpy or
with the native non-temporal copy. This runs every way over the same 1 GiB, two threads taking
alternate 4 MiB values into memory already in use (as a load copies into tensors that exist);
the ways take turns, round by round. It prints each way's median, p90 and slowest round, and
each verified way's median as extra time over each unverified copy's (the checksum cost
``benchmarks/run.py`` reports is the chosen verified way's over the chosen unverified way's).

It needs kvckpt installed with its native loop (``pip install -e .`` where a C compiler is):

    python benchmarks/copy_ways.py --rounds 11
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from results_report import way_name
from timing import p90, threads_seconds

from kvckpt.engines import _copy_ways

_VALUE = 4 << 20


def _two_threads(total: int, step: Callable[[int], object]) -> float:
    """Seconds for two threads to run ``step`` over alternate values of ``total`` bytes."""

    def work(first: int) -> None:
        for at in range(first * _VALUE, total, 2 * _VALUE):
            step(at)

    return threads_seconds([functools.partial(work, k) for k in range(2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    copy_hash, stream_copy = _copy_ways.NATIVE_COPY_HASH, _copy_ways.NATIVE_STREAM_COPY
    if copy_hash is None or stream_copy is None:
        sys.exit(f"kvckpt's native loop is not in use here ({_copy_ways.NATIVE_STATUS})")
    total = args.size_mib << 20
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = torch.ones(total, dtype=torch.uint8).numpy()  # a tensor's memory, touched

    def view(a: np.ndarray, at: int) -> memoryview:
        return a[at : at + _VALUE].data

    def pieces(size: int) -> Callable[[int], int]:
        def step(at: int) -> int:  # kvckpt's copy_and_hash, with the piece size fixed
            hasher = xxhash.xxh3_64()
            for start in range(at, at + _VALUE, size):
                piece = src[start : start + size]
                hasher.update(piece.data)
                np.copyto(dst[start : start + size], piece)
            return hasher.intdigest()

        return step

    unverified: dict[str, Callable[[int], object]] = {
        "copy (numpy)": lambda at: np.copyto(dst[at : at + _VALUE], src[at : at + _VALUE]),
        "copy (native, non-temporal stores)": lambda at: stream_copy(view(dst, at), view(src, at)),
    }
    verified: dict[str, Callable[[int], object]] = {
        f"copy and hash, {p >> 10} KiB pieces": pieces(p) for p in _copy_ways.PIECES
    }
    for way, (stream, prefetch) in _copy_ways.NATIVE_WAYS.items():
        verified[f"copy and hash, {way_name(way)}"] = lambda at, s=stream, p=prefetch: copy_hash(
            view(dst, at), view(src, at), s, p
        )
    for step in verified.values():  # every way copies and hashes right
        for at in (0, total - _VALUE):
            dst[at : at + _VALUE] = 0
            digest = step(at)
            assert digest == xxhash.xxh3_64_intdigest(view(src, at))
            assert np.array_equal(dst[at : at + _VALUE], src[at : at + _VALUE])
    cases = unverified | verified
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]  # as the rounds start: the machine must be otherwise idle
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            times[name].append(_two_threads(total, step))
    base = {name: statistics.median(times[name]) for name in unverified}
    print(
        f"{args.size_mib} MiB, two threads, {args.rounds} rounds taking turns;"
        f" load average {load} at the start; extra time over each unverified copy"
    )
    width = max(map(len, times))
    print(
        f"{'way':{width}} {'median':>9} {'GB/s':>6} {'p90':>9} {'slowest':>9}"
        f" {'vs numpy':>9} {'vs NT':>7}"
    )
    for name, seconds in times.items():
        m = statistics.median(seconds)
        over = (
            f" {m / base['copy (numpy)'] - 1:+9.3f}"
            f" {m / base['copy (native, non-temporal stores)'] - 1:+7.3f}"
        )
        print(
            f"{name:{width}} {m * 1e3:7.1f}ms {total / m / 1e9:6.2f} {p90(seconds) * 1e3:7.1f}ms"
            f" {max(seconds) * 1e3:7.1f}ms{over}"
        )


if __name__ == "__main__":
    main()
