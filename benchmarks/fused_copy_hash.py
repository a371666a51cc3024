"""What checking a load costs when the copy and the hash are fused in native code.

A verified LMDB load copies each value out of the memory map and hashes it with xxh3, in one of
two ways chosen by timing (``kvckpt.engines._copy_hash_choice``): python-xxhash hashes a piece
and numpy copies it while it is still in the cache, or kvckpt's native loop
(``kvckpt.engines._copy_hash``) hashes and copies 1 KiB at a time (one xxh3 block: the bytes
never leave L1) with the source and destination prefetched 8 KiB ahead. This measures both
against the plain copy and against variants of the loop built here: the same 1 GiB, two threads
taking alternate 4 MiB values (as a load's two copy threads do), copied without a hash (numpy's
copy, glibc's memcpy; and a C loop of non-temporal stores, which write around the cache without
reading each destination line first), by kvckpt's pieces, by kvckpt's native loop, and by the
same 1 KiB loop without prefetch in both orders, and hashing each block and then writing it out
with non-temporal stores. Every C digest is checked against python-xxhash's. Cases take turns;
the median, p90 and slowest round are printed, and the median as extra time over each plain
copy's (the checksum cost ``benchmarks/run.py`` reports is the one over numpy's copy, which an
unverified load runs).

It needs gcc and an x86-64 CPU with AVX2 (the variants are built with ``-mavx2``), and kvckpt
installed with its native loop (``pip install -e .`` where gcc is); the variants use the xxHash
header kvckpt vendors (``vendor/xxhash/xxhash.h``):

    python benchmarks/fused_copy_hash.py --rounds 11
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).parent))
from timing import p90, threads_seconds

from kvckpt.engines._copy_hash_choice import NATIVE_COPY_HASH

# mode 0: copy a block, hash the copy; 1: hash the source block, copy it from L1; 3: as 1, the
# copy with non-temporal stores (kvckpt's native loop is 1 with prefetch). copy_nt: a copy
# with non-temporal stores alone.
_C_SOURCE = r"""
#define XXH_INLINE_ALL
#include "xxhash.h"
#include <stdint.h>
#include <string.h>
#include <x86intrin.h>
static void copy_stream(xxh_u8 *d, const xxh_u8 *s, size_t n) {
    if (((uintptr_t)d & 31) || (n & 31)) { memcpy(d, s, n); return; }
    for (size_t k = 0; k < n; k += 32)
        _mm256_stream_si256((__m256i *)(d + k), _mm256_loadu_si256((const __m256i *)(s + k)));
}
void copy_nt(void *dst, const void *src, size_t len) {
    copy_stream(dst, src, len); _mm_sfence();
}
uint64_t copy_hash(void *dst, const void *src, size_t len, int mode) {
    const xxh_u8 *in = src; xxh_u8 *out = dst;
    if (len <= XXH3_MIDSIZE_MAX) { memcpy(out, in, len); return XXH3_64bits(out, len); }
    const xxh_u8 *secret = XXH3_kSecret; size_t const secret_size = sizeof(XXH3_kSecret);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    size_t const stripes = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    size_t const block = XXH_STRIPE_LEN * stripes, blocks = (len - 1) / block;
    for (size_t n = 0; n < blocks; n++) {
        const xxh_u8 *s = in + n * block; xxh_u8 *d = out + n * block;
        if (mode == 0) { memcpy(d, s, block); XXH3_accumulate(acc, d, secret, stripes); }
        else {
            XXH3_accumulate(acc, s, secret, stripes);
            if (mode == 3) copy_stream(d, s, block); else memcpy(d, s, block);
        }
        XXH3_scrambleAcc(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    if (mode == 3) _mm_sfence();
    size_t done = blocks * block;
    memcpy(out + done, in + done, len - done);
    XXH3_accumulate(acc, out + done, secret, ((len - 1) - done) / XXH_STRIPE_LEN);
    XXH3_accumulate_512(acc, out + len - XXH_STRIPE_LEN,
                        secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START, (xxh_u64)len * XXH_PRIME64_1);
}
"""
_MODES = {
    "fused, copy then hash": 0,
    "fused, hash then copy": 1,
    "fused, hash then stream out": 3,
}
_VALUE = 4 << 20
_VENDORED_HEADER = Path(__file__).parent.parent / "vendor" / "xxhash" / "xxhash.h"
_PIECES = (256 << 10, 512 << 10, 1 << 20, 2 << 20)


def _build(header: Path, workdir: Path) -> ctypes.CDLL:
    (workdir / "copy_hash.c").write_text(_C_SOURCE)
    (workdir / "xxhash.h").write_bytes(header.read_bytes())
    lib = workdir / "copy_hash.so"
    flags = ["-O3", "-mavx2", "-shared", "-fPIC"]
    subprocess.run(["gcc", *flags, "-o", str(lib), str(workdir / "copy_hash.c")], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.copy_hash.restype = ctypes.c_uint64
    dll.copy_hash.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dll.copy_nt.restype = None
    dll.copy_nt.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return dll


def _two_threads(total: int, step: Callable[[int], object]) -> float:
    """Seconds for two threads to run ``step`` over alternate values of ``total`` bytes."""

    def work(first: int) -> None:
        for at in range(first * _VALUE, total, 2 * _VALUE):
            step(at)

    return threads_seconds([functools.partial(work, k) for k in range(2)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--xxhash-h", type=Path, default=_VENDORED_HEADER, help="xxHash's xxhash.h (kvckpt's)"
    )
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    native_copy_hash = NATIVE_COPY_HASH
    if native_copy_hash is None:
        sys.exit("kvckpt's native loop is not built here: `pip install -e .` where gcc is")
    total = args.size_mib << 20
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.ones(total, np.uint8)  # touched: a load copies into tensors that exist
    with tempfile.TemporaryDirectory() as tmp:
        dll = _build(args.xxhash_h, Path(tmp))
    sp, dp = src.ctypes.data, dst.ctypes.data
    for mode in _MODES.values():
        for n in (100, 240, 241, 1024, 1025, 100_000, _VALUE):
            expected = xxhash.xxh3_64_intdigest(src[:n].tobytes())
            assert dll.copy_hash(dp, sp, n, mode) == expected, (mode, n)
            assert np.array_equal(dst[:n], src[:n])

    def plain(at: int) -> None:
        np.copyto(dst[at : at + _VALUE], src[at : at + _VALUE])

    def pieces(size: int) -> Callable[[int], int]:
        def step(at: int) -> int:  # kvckpt's copy_and_hash, with the piece size fixed
            hasher = xxhash.xxh3_64()
            for start in range(at, at + _VALUE, size):
                piece = src[start : start + size]
                hasher.update(piece.data)
                np.copyto(dst[start : start + size], piece)
            return hasher.intdigest()

        return step

    def native(mode: int) -> Callable[[int], int]:
        return lambda at: dll.copy_hash(dp + at, sp + at, _VALUE, mode)

    def streamed(at: int) -> None:
        dll.copy_nt(dp + at, sp + at, _VALUE)

    cases: dict[str, Callable[[int], object]] = {
        "copy alone (numpy)": plain,
        "copy alone (non-temporal, C)": streamed,
    }
    cases |= {f"kvckpt's pieces, {p >> 10} KiB": pieces(p) for p in _PIECES}
    cases["kvckpt's native loop"] = lambda at: native_copy_hash(
        dst[at : at + _VALUE].data, src[at : at + _VALUE].data
    )
    cases |= {name: native(mode) for name, mode in _MODES.items()}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]  # as the rounds start: the machine must be otherwise idle
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, step in cases.items():
            times[name].append(_two_threads(total, step))
    base = statistics.median(times["copy alone (numpy)"])
    base_nt = statistics.median(times["copy alone (non-temporal, C)"])
    print(
        f"{args.size_mib} MiB, two threads, {args.rounds} rounds taking turns;"
        f" load average {load} at the start"
    )
    print(
        f"{'case':32} {'median':>9} {'GB/s':>6} {'cost':>7} {'vs NT':>7} {'p90':>9} {'slowest':>9}"
    )
    for name, seconds in times.items():
        m = statistics.median(seconds)
        print(
            f"{name:32} {m * 1e3:7.1f}ms {total / m / 1e9:6.2f} {m / base - 1:+7.3f}"
            f" {m / base_nt - 1:+7.3f} {p90(seconds) * 1e3:7.1f}ms {max(seconds) * 1e3:7.1f}ms"
        )


if __name__ == "__main__":
    main()
