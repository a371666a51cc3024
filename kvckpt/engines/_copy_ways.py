"""How a load copies each value out of a store, and hashes it when it verifies, and how a save
copies each value into LMDB's map and hashes it: chosen by timing on this machine.

A verified load copies each value out of the store and hashes it (a checksummed save into
reserved room, each value into the store). Done as two passes, memory is
read twice; done together, once. There are three ways to do it together:

- **native**: the compiled loop of ``kvckpt.engines._copy_hash`` (``csrc/``), built when kvckpt
  is installed where a C compiler is. It hashes each 64-byte stripe with xxHash's own kernel
  and copies it while it is in L1, prefetching the source ahead.
- **native-stream**: the same loop writing with non-temporal stores, which skip reading each
  destination line into the cache before writing it: a third less memory traffic for a copy
  that waits on memory.
- **native-no-prefetch**, **native-stream-no-prefetch**: the same two without prefetching the
  source, for CPUs whose own prefetcher does better alone.
- **pieces**: python-xxhash hashes a piece of the value, numpy copies it while it is still in
  the CPU's cache. The best piece size depends on the CPU's caches and on how fast it copies
  and hashes.

A load that does not verify copies with numpy (glibc's ``memcpy``, ``MEMCPY``) or with the
compiled loop's non-temporal stores alone (``STREAM``).

Which is faster depends on the CPU and on its memory: non-temporal stores take a third off a
copy on some 2-core server VMs and nothing on others, and the native loop hides the hash behind
the copy on some x86 CPUs where the pieces cannot (``benchmarks/run.py`` reports each
candidate's time and the choices). So a process does not guess from the CPU's model: its first
values are copied each way in turn, each value timed, and once every candidate has been timed
a few times the one with the lowest median time per byte is kept for the rest of the process.
Each candidate takes a few values in a row (``RUN``), so a load's two threads time it running
on both, as it will run once chosen.
Verified and unverified copies are chosen apart (``COPY_HASH_WAY``, ``COPY_WAY``), and copies
into a store apart from copies out of it (``SAVE_COPY_HASH_WAY``, ``SAVE_COPY_WAY``).

The values timed are the load's own: nothing extra is copied, and timing costs two clock reads
per value. Until a choice is made, values too small to time well use the default way. Values
under ``STREAM_MIN_BYTES`` are written with ordinary stores whichever way is chosen: they fit
the cache, where the next reader finds them.

``KVCKPT_NATIVE_COPY_HASH=0`` leaves the compiled loops out of the candidates.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
from typing import Protocol

import numpy as np
import xxhash

_KIB = 1024

#: A way to copy (and hash): a piece size in bytes, or one of the names below.
Way = int | str
#: The compiled loop, as a candidate for verified copies; the same writing with non-temporal
#: stores; and both without prefetching the source ahead.
NATIVE = "native"
NATIVE_STREAM = "native-stream"
NATIVE_NO_PREFETCH = "native-no-prefetch"
NATIVE_STREAM_NO_PREFETCH = "native-stream-no-prefetch"
#: How each way of the compiled loop runs it: (non-temporal stores, prefetch ahead).
NATIVE_WAYS: dict[str, tuple[bool, bool]] = {
    NATIVE: (False, True),
    NATIVE_STREAM: (True, True),
    NATIVE_NO_PREFETCH: (False, False),
    NATIVE_STREAM_NO_PREFETCH: (True, False),
}
#: The candidates for unverified copies: numpy's copy, and the compiled non-temporal copy.
MEMCPY = "memcpy"
STREAM = "stream"
#: Values smaller than this are written with ordinary stores whichever way is chosen: they fit
#: a core's cache, where non-temporal stores would not leave them for the next reader.
STREAM_MIN_BYTES = 1024 * _KIB


class NativeCopyHash(Protocol):
    """``_copy_hash.copy_hash``: copy ``src`` into ``dst`` and return XXH3-64 of the bytes."""

    def __call__(
        self, dst: memoryview, src: memoryview, stream: bool = False, prefetch: bool = True, /
    ) -> int: ...


class NativeCopy(Protocol):
    """``_copy_hash.stream_copy``: copy ``src`` into ``dst`` with non-temporal stores."""

    def __call__(self, dst: memoryview, src: memoryview, /) -> None: ...


#: Values of ``KVCKPT_NATIVE_COPY_HASH`` that turn the native loop off.
_OFF = ("0", "false", "no", "off")


def _load_native() -> tuple[NativeCopyHash | None, NativeCopy | None, str]:
    """The compiled ``copy_hash(dst, src, stream=False, prefetch=True) -> digest`` and
    ``stream_copy(dst, src)``, or None where they are not built, are turned off
    (``KVCKPT_NATIVE_COPY_HASH=0``), or disagree with python-xxhash or with the source; and
    which, in words (``kvckpt --version`` prints them)."""
    if os.environ.get("KVCKPT_NATIVE_COPY_HASH", "1").strip() in _OFF:
        return None, None, "turned off (KVCKPT_NATIVE_COPY_HASH=0): numpy's pieces"
    try:
        from ._copy_hash import copy_hash, kernel, stream_copy
    except ImportError:
        return None, None, "not built (no C compiler at install): numpy's pieces"
    src = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8)
    out = np.empty(src.size + 64, dtype=np.uint8)
    for n in (0, 7, 240, 241, 1024, 1025, 9_000, 70_000):
        expected = xxhash.xxh3_64_intdigest(src[:n].data)
        for shift in (0, 3, 32):  # the destination's alignment: streaming stores care
            dst = out[shift : shift + n]
            for stream, prefetch in NATIVE_WAYS.values():
                dst[:] = 0
                digest = copy_hash(dst.data, src[:n].data, stream, prefetch)
                if digest != expected or not np.array_equal(dst, src[:n]):
                    return None, None, "built but disagrees with python-xxhash, so unused"
            dst[:] = 0
            stream_copy(dst.data, src[:n].data)
            if not np.array_equal(dst, src[:n]):
                return None, None, "built but copies wrongly, so unused"
    return copy_hash, stream_copy, f"built ({kernel()}), timed against numpy's pieces and copy"


#: The compiled loops, where they are built and agree with python-xxhash and the source; and
#: their state in words.
NATIVE_COPY_HASH, NATIVE_STREAM_COPY, NATIVE_STATUS = _load_native()


#: The piece sizes tried: a quarter to all of the largest L2 of current server cores (2 MiB),
#: each still splitting a value of the default part size (4 MiB less 64 bytes) into two pieces
#: or more.
PIECES = (256 * _KIB, 512 * _KIB, 1024 * _KIB, 2048 * _KIB)
#: Every way a verified copy tries in this process.
CANDIDATES: tuple[Way, ...] = (tuple(NATIVE_WAYS) if NATIVE_COPY_HASH is not None else ()) + PIECES
#: Every way an unverified copy tries in this process.
COPY_CANDIDATES: tuple[Way, ...] = (MEMCPY, STREAM) if NATIVE_STREAM_COPY is not None else (MEMCPY,)
#: The way a verified copy uses before the choice is made, and for values too small to time.
DEFAULT: Way = 1024 * _KIB
#: Timings per candidate before choosing: enough for a median to ignore a page fault or a
#: preempted thread.
SAMPLES = 8
#: Each candidate copies this many timed values in a row, so that a load's two copy threads
#: time the same way at once: a way's memory traffic slows the other thread's copy too (a copy
#: with ordinary stores reads each destination line first), which timings of two ways side by
#: side would charge to both.
RUN = 4
#: Values smaller than this are not timed: a few pieces say little about the per-piece cost.
#: A part of the default size (``base.DEFAULT_PART_BYTES``, 64 bytes under 4 MiB) is timed.
MIN_TIMED_BYTES = 2 * max(PIECES) - 64


class TimedChoice:
    """A copy way of this process: candidates take turns, ``run`` timed values each, until
    each has ``samples`` timings; then the fastest by median stays. Safe to use from several
    threads (the two copy threads of a load time their values at once, each turn's way on
    both)."""

    def __init__(
        self,
        candidates: tuple[Way, ...] = CANDIDATES,
        *,
        samples: int = SAMPLES,
        run: int = RUN,
        default: Way = DEFAULT,
        min_timed: int = MIN_TIMED_BYTES,
    ) -> None:
        if not candidates or samples < 1 or run < 1:
            raise ValueError("TimedChoice needs at least one candidate, one sample and a run")
        self.candidates = candidates
        self.samples = samples
        self.run = run
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
        return self.candidates[next(self._turn) // self.run % len(self.candidates)]

    def way(self) -> Way:
        """The way to copy an untimed value with."""
        return self.chosen if self.chosen is not None else self.default

    def record(self, way: Way, nbytes: int, seconds: float) -> None:
        """A value of ``nbytes`` copied (and hashed) ``way`` took ``seconds``."""
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


#: The process's choices, shared by every engine that copies out of its memory: verified copies
#: (copy and hash), and unverified ones.
COPY_HASH_WAY = TimedChoice()
COPY_WAY = TimedChoice(COPY_CANDIDATES, default=MEMCPY)
#: The same for copies into a store's memory (a save writing into LMDB's map), chosen apart:
#: they move memory the other way, and the fastest way can differ (on an Emerald Rapids VM the
#: non-temporal loop loaded far faster than the loop with ordinary stores and saved no faster).
SAVE_COPY_HASH_WAY = TimedChoice()
SAVE_COPY_WAY = TimedChoice(COPY_CANDIDATES, default=MEMCPY)
if hasattr(os, "register_at_fork"):
    for _choice in (COPY_HASH_WAY, COPY_WAY, SAVE_COPY_HASH_WAY, SAVE_COPY_WAY):
        os.register_at_fork(after_in_child=_choice.after_fork)
