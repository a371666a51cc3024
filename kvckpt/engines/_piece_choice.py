"""How much of a value to copy before hashing it, chosen by timing on this machine.

A verified load copies each value out of the store and hashes it. Hashing a piece and then
copying it while it is still in the CPU's cache reads memory once. How large that piece should
be depends on the CPU: its cache sizes and how fast it copies and hashes. On one x86 server CPU
pieces of half the best size double what checking costs; on another, that best size costs a
quarter more than pieces of a quarter of it. So a process does not guess from the CPU's model:
its first verified values are copied with each candidate size in turn, each value timed, and
once every candidate has been timed a few times the one with the lowest median time per byte is
kept for the rest of the process.

The values timed are the load's own: nothing extra is copied, and timing costs two clock reads
per value. Until the choice is made, values too small to time well use ``DEFAULT``.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading

_KIB = 1024

#: The piece sizes tried: a quarter to all of the largest L2 of current server cores (2 MiB),
#: each still splitting a value of the default part size (4 MiB less 64 bytes) into two pieces
#: or more.
CANDIDATES = (256 * _KIB, 512 * _KIB, 1024 * _KIB, 2048 * _KIB)
#: The size used before the choice is made, and for values too small to time.
DEFAULT = 1024 * _KIB
#: Timings per candidate before choosing: enough for a median to ignore a page fault or a
#: preempted thread.
SAMPLES = 8
#: Values smaller than this are not timed: a few pieces say little about the per-piece cost.
#: A part of the default size (``base.DEFAULT_PART_BYTES``, 64 bytes under 4 MiB) is timed.
MIN_TIMED_BYTES = 2 * max(CANDIDATES) - 64


class PieceChoice:
    """The copy-and-hash piece size of this process: candidates take turns, one per timed
    value, until each has ``samples`` timings; then the fastest by median stays. Safe to use
    from several threads (the two copy threads of a load time their values at once)."""

    def __init__(
        self,
        candidates: tuple[int, ...] = CANDIDATES,
        *,
        samples: int = SAMPLES,
        default: int = DEFAULT,
        min_timed: int = MIN_TIMED_BYTES,
    ) -> None:
        if not candidates or samples < 1:
            raise ValueError("PieceChoice needs at least one candidate and one sample")
        self.candidates = candidates
        self.samples = samples
        self.default = default
        self.min_timed = min_timed
        #: The size kept for the process, None while candidates are still being timed.
        self.chosen: int | None = candidates[0] if len(candidates) == 1 else None
        self._seconds_per_byte: dict[int, list[float]] = {c: [] for c in candidates}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def trial(self, nbytes: int) -> int | None:
        """The candidate to copy a value of ``nbytes`` with and time, or None: copy it with
        ``piece()`` and do not time it (the choice is made, or the value is too small)."""
        if self.chosen is not None or nbytes < self.min_timed:
            return None
        return self.candidates[next(self._turn) % len(self.candidates)]

    def piece(self) -> int:
        """The size to copy an untimed value with."""
        return self.chosen if self.chosen is not None else self.default

    def record(self, size: int, nbytes: int, seconds: float) -> None:
        """A value of ``nbytes`` copied and hashed with pieces of ``size`` took ``seconds``."""
        with self._lock:
            if self.chosen is not None:
                return
            self._seconds_per_byte[size].append(seconds / nbytes)
            if all(len(t) >= self.samples for t in self._seconds_per_byte.values()):
                medians = self.medians()
                self.chosen = min(self.candidates, key=medians.__getitem__)

    def after_fork(self) -> None:
        """A fork copies the lock as it was: held, if another thread was recording."""
        self._lock = threading.Lock()

    def medians(self) -> dict[int, float]:
        """Median seconds per byte of each candidate timed so far (for reports)."""
        return {c: statistics.median(t) for c, t in self._seconds_per_byte.items() if t}


#: The process's choice, shared by every engine that copies and hashes.
COPY_HASH_PIECE = PieceChoice()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=COPY_HASH_PIECE.after_fork)
