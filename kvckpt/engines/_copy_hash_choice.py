"""How a verified load copies and hashes each value, chosen by timing on this machine.

A verified load copies each value out of the store and hashes it. Done as two passes, memory is
read twice; done together, once. There are two ways to do it together:

- **native**: the compiled loop of ``kvckpt.engines._copy_hash`` (``csrc/``), built when kvckpt
  is installed where a C compiler is. It hashes each 1 KiB block with xxHash's own kernel and
  copies it while it is in L1, prefetching ahead.
- **pieces**: python-xxhash hashes a piece of the value, numpy copies it while it is still in
  the CPU's cache. The best piece size depends on the CPU's caches and on how fast it copies
  and hashes.

Which is faster depends on the CPU too: on some x86 server CPUs the native loop hides the hash
behind the copy where the pieces cannot, on others the pieces are the faster
(``benchmarks/run.py`` reports each candidate's time and the choice). So a process does not
guess from the CPU's model: its first verified values are copied each way in turn (the native
loop and each piece size), each value timed, and once every candidate has been timed a few
times the one with the lowest median time per byte is kept for the rest of the process.

The values timed are the load's own: nothing extra is copied, and timing costs two clock reads
per value. Until the choice is made, values too small to time well use ``DEFAULT``.

``KVCKPT_NATIVE_COPY_HASH=0`` leaves the native loop out of the candidates.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
from collections.abc import Callable

import numpy as np
import xxhash

_KIB = 1024

#: A way to copy and hash: a piece size in bytes, or ``NATIVE``.
Way = int | str
#: The compiled loop, as a candidate.
NATIVE = "native"


#: Values of ``KVCKPT_NATIVE_COPY_HASH`` that turn the native loop off.
_OFF = ("0", "false", "no", "off")


def _load_native() -> tuple[Callable[[memoryview, memoryview], int] | None, str]:
    """The compiled ``copy_hash(dst, src) -> digest``, or None where it is not built, is
    turned off (``KVCKPT_NATIVE_COPY_HASH=0``), or disagrees with python-xxhash; and which, in
    words (``kvckpt --version`` prints them)."""
    if os.environ.get("KVCKPT_NATIVE_COPY_HASH", "1").strip() in _OFF:
        return None, "turned off (KVCKPT_NATIVE_COPY_HASH=0): numpy's pieces"
    try:
        from ._copy_hash import copy_hash, kernel
    except ImportError:
        return None, "not built (no C compiler at install): numpy's pieces"
    src = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8)
    dst = np.empty_like(src)
    for n in (0, 7, 240, 241, 1024, 1025, 9_000, 70_000):
        digest = copy_hash(dst[:n].data, src[:n].data)
        if digest != xxhash.xxh3_64_intdigest(src[:n].data) or not np.array_equal(dst[:n], src[:n]):
            return None, "built but disagrees with python-xxhash, so unused: numpy's pieces"
    return copy_hash, f"built ({kernel()}), timed against numpy's pieces"


#: The compiled loop, where it is built and agrees with python-xxhash; and its state in words.
NATIVE_COPY_HASH, NATIVE_STATUS = _load_native()


#: The piece sizes tried: a quarter to all of the largest L2 of current server cores (2 MiB),
#: each still splitting a value of the default part size (4 MiB less 64 bytes) into two pieces
#: or more.
PIECES = (256 * _KIB, 512 * _KIB, 1024 * _KIB, 2048 * _KIB)
#: Every way tried in this process.
CANDIDATES: tuple[Way, ...] = ((NATIVE,) if NATIVE_COPY_HASH is not None else ()) + PIECES
#: The way used before the choice is made, and for values too small to time.
DEFAULT: Way = 1024 * _KIB
#: Timings per candidate before choosing: enough for a median to ignore a page fault or a
#: preempted thread.
SAMPLES = 8
#: Values smaller than this are not timed: a few pieces say little about the per-piece cost.
#: A part of the default size (``base.DEFAULT_PART_BYTES``, 64 bytes under 4 MiB) is timed.
MIN_TIMED_BYTES = 2 * max(PIECES) - 64


class CopyHashChoice:
    """The copy-and-hash way of this process: candidates take turns, one per timed value,
    until each has ``samples`` timings; then the fastest by median stays. Safe to use from
    several threads (the two copy threads of a load time their values at once)."""

    def __init__(
        self,
        candidates: tuple[Way, ...] = CANDIDATES,
        *,
        samples: int = SAMPLES,
        default: Way = DEFAULT,
        min_timed: int = MIN_TIMED_BYTES,
    ) -> None:
        if not candidates or samples < 1:
            raise ValueError("CopyHashChoice needs at least one candidate and one sample")
        self.candidates = candidates
        self.samples = samples
        self.default = default
        self.min_timed = min_timed
        #: The way kept for the process, None while candidates are still being timed.
        self.chosen: Way | None = candidates[0] if len(candidates) == 1 else None
        self._seconds_per_byte: dict[Way, list[float]] = {c: [] for c in candidates}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def trial(self, nbytes: int) -> Way | None:
        """The candidate to copy a value of ``nbytes`` with and time, or None: copy it with
        ``way()`` and do not time it (the choice is made, or the value is too small)."""
        if self.chosen is not None or nbytes < self.min_timed:
            return None
        return self.candidates[next(self._turn) % len(self.candidates)]

    def way(self) -> Way:
        """The way to copy an untimed value with."""
        return self.chosen if self.chosen is not None else self.default

    def record(self, way: Way, nbytes: int, seconds: float) -> None:
        """A value of ``nbytes`` copied and hashed ``way`` took ``seconds``."""
        with self._lock:
            if self.chosen is not None:
                return
            self._seconds_per_byte[way].append(seconds / nbytes)
            if all(len(t) >= self.samples for t in self._seconds_per_byte.values()):
                medians = self.medians()
                self.chosen = min(self.candidates, key=medians.__getitem__)

    def after_fork(self) -> None:
        """A fork copies the lock as it was: held, if another thread was recording."""
        self._lock = threading.Lock()

    def medians(self) -> dict[Way, float]:
        """Median seconds per byte of each candidate timed so far (for reports)."""
        return {c: statistics.median(t) for c, t in self._seconds_per_byte.items() if t}


#: The process's choice, shared by every engine that copies and hashes.
COPY_HASH_WAY = CopyHashChoice()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=COPY_HASH_WAY.after_fork)
