"""How ``benchmarks/run.py`` times its cases: in a block (``timed``), taking turns
(``take_turns``), after a new LMDB store's background work is done (``settle``), and the peak
of anonymous memory a call uses (``peak_anon_rss_delta``); how long calls on threads of their
own take together (``threads_seconds``); and the tail every report gives (``p90``)."""

from __future__ import annotations

import gc
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from workload import KIB

#: ``{name: (fn, setup)}``: a case and what runs untimed before each of its runs
Cases = dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]


def p90(runs: list[float]) -> float:
    """The 90th percentile of ``runs``, nearest rank: a run that happened, never interpolated."""
    ordered = sorted(runs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def threads_seconds(calls: list[Callable[[], Any]]) -> float:
    """Seconds for ``calls`` to run, each on a thread of its own, all started together."""
    threads = [threading.Thread(target=call) for call in calls]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def timed(
    fn: Callable[[], Any],
    repeats: int,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], Any] | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, one after the other (a block)."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if teardown is not None:
            teardown()
    return times


#: False in a smoke run (``run.py --smoke``): ``repeats`` rounds, not whole rotations
WHOLE_ROTATIONS = True


def rounds_for(repeats: int, cases: int) -> int:
    """``repeats`` rounded up to whole rotations: with each round starting one case further
    along, every case then runs once in every place of the round, the first (after whatever
    ran before) included, as often as every other case. A smoke run, which checks that every
    case runs and not what it measures, takes ``repeats`` rounds (``WHOLE_ROTATIONS``)."""
    if not WHOLE_ROTATIONS:
        return max(1, repeats)
    cases = max(1, cases)
    return -(-max(1, repeats) // cases) * cases


def take_turns(
    cases: Cases, repeats: int, after: Callable[[], Any] | None = None
) -> dict[str, list[float]]:
    """Time ``{name: (fn, setup)}``, one repeat of each case per round, ``repeats`` rounds or
    more (``rounds_for``), each round starting one case further along; ``after()`` (untimed)
    checks each run's result. Each case starts once the previous one's background work is done
    (``settle``).

    For cases compared with each other (kvckpt against the raw client, verified against
    unverified loads, the small-tensor round trips): this VM's timings drift and jump during a
    run (loopback Redis loads came in two clusters, ~105 and ~155 ms, whichever client ran),
    and cases timed in blocks one after another would each catch a different part of that
    drift. (The DCP baselines at the start of the run are timed in blocks.)
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds_for(repeats, len(names))):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, setup = cases[name]
            if setup is not None:
                setup()
            settle()
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if after is not None:
                after()
    return times


def settle() -> None:
    """Wait for the pages a new LMDB store gets ready in the background after its first save
    (``Engine.get_ready``) and the spares Redis makes ahead of a job's next save
    (``Engine.make_spares``): a training job's steps overlap that work, the next case must not."""
    for thread in threading.enumerate():
        if thread.name in ("kvckpt-lmdb-get-ready", "kvckpt-redis-spares"):
            thread.join()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * KIB
    return 0


class AnonPeak:
    """The peak of this process's anonymous resident memory over a block, above its level as
    the block started, sampled every millisecond (``above``, once the block is done)."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> AnonPeak:
        self.start = self.peak = _rss_anon()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def above(self) -> int:
        return max(0, self.peak - self.start)


def peak_anon_rss_delta(fn: Callable[[], Any]) -> int:
    """Peak anonymous RSS above the level at the start of ``fn`` (sampled every ms)."""
    gc.collect()
    with AnonPeak() as peak:
        fn()
    return peak.above
