"""How ``benchmarks/run.py`` times its cases: in a block (``timed``), taking turns
(``take_turns``), after a new LMDB store's background work is done (``settle``), and the peak
of anonymous memory a call uses (``peak_anon_rss_delta``)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

from workload import KIB

#: ``{name: (fn, setup)}``: a case and what runs untimed before each of its runs
Cases = dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]


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


def take_turns(
    cases: Cases, repeats: int, after: Callable[[], Any] | None = None
) -> dict[str, list[float]]:
    """Time ``{name: (fn, setup)}``, one repeat of each case per round, ``repeats`` rounds,
    each round starting one case further along; ``after()`` (untimed) checks each run's result.
    Each case starts once the previous one's background work is done (``settle``).

    For cases compared with each other (kvckpt against the raw client, verified against
    unverified loads, the small-tensor round trips): this VM's timings drift and jump during a
    run (loopback Redis loads came in two clusters, ~105 and ~155 ms, whichever client ran),
    and cases timed in blocks one after another would each catch a different part of that
    drift. (The DCP baselines at the start of the run are timed in blocks.)
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(repeats):
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
    (``Engine.get_ready``): a training job's steps overlap that work, the next case must not."""
    for thread in threading.enumerate():
        if thread.name == "kvckpt-lmdb-get-ready":
            thread.join()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * KIB
    return 0


def peak_anon_rss_delta(fn: Callable[[], Any]) -> int:
    """Peak anonymous RSS above the level at the start of ``fn`` (sampled every ms)."""
    gc.collect()
    base = _rss_anon()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(0, max(peak, _rss_anon()) - base)
