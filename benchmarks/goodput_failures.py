"""Phase 3 of ``benchmarks/goodput.py``: each system trains at its interval while a rank is
SIGKILLed three times; per failure, the time lost (relaunch, restore, recompute) and, for
``Tiers``, how far the shared tier's copies lagged the saves."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from goodput_runs import (
    FRESH,
    NONE_STEPS,
    REPLACED,
    Economy,
    Places,
    copies,
    events_of,
    launch,
    wait_quiet,
)


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as e:  # not root
        print(f"cannot drop the page cache: {e}", flush=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def with_failures(
    places: Places,
    econ: Economy,
    system: str,
    interval: int,
    mode: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Train at ``interval`` and SIGKILL rank 0 at each of ``args.kills`` (seconds after
    launch); a kill waits until the job is back at the step the previous kill interrupted and
    has committed a save newer than the checkpoint it restored into the store the restart
    restores from (for ``tiers``, whose node is replaced, the shared tier), so that each
    kill measures a restore of a checkpoint this run wrote since the last. Where that store's
    memory is fresh (``fresh_store``), the kill also waits until it has committed
    ``keep_last`` + 2 saves since the job (re)started: every kill finds the job in its steady
    state, as a failure hours into a job does. The expected loss counts the copy lag of a
    replaced node apart. ``system`` "none" never checkpoints: its failures measure relaunch
    alone."""
    places.clear()
    wait_quiet(args)
    extra = ["--steps", str(args.steps), "--staging", mode]
    extra += ["--every", str(interval) if system != "none" else "0"]
    if system == "tiers":
        extra += ["--wipe-on-restart", str(places.shm / "local")]
    if system == "tiers-peers":  # rank 0's host, the one killed
        extra += ["--wipe-on-restart", str(places.shm / "local" / "host0")]
    launched = time.time()
    proc, events, log = launch(places, econ, system, args, *extra)
    kills: list[float] = []
    reached: list[int] = []

    # the events of committed saves: a plain dcp.save has returned, an async one uploaded;
    # for Tiers on a replaced node, the copies into the store it restores from
    def committed(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if system in REPLACED:
            return copies(mine, system)
        return [e for e in mine if e["event"] == ("save" if mode == "sync" else "uploaded")]

    for attempt, at in enumerate(args.kills):
        while True:  # the running attempt, back where the previous kill found it
            ev = events_of(events)
            starts = [e for e in ev if e["event"] == "start" and e["attempt"] == attempt]
            if system == "none":  # a step into each attempt: relaunch is all it measures
                due = any(e["event"] == "loss" and e["attempt"] == attempt for e in ev)
            else:
                mine = [e for e in ev if e["attempt"] == attempt]
                steps = [e["step"] for e in mine if e["event"] == "loss"]
                back = not reached or max(steps, default=-1) >= reached[-1]
                restored = [e["step"] for e in mine if e["event"] == "ready"]
                newer = bool(restored) and any(e["step"] > restored[0] for e in committed(mine))
                # every kill finds the job in its steady state, as a failure hours into a job
                # does: where the store it restores from has fresh memory, it has since
                # committed the keep_last + 1 saves whose memory it holds, and one more, made
                # once that was paid
                steady = (
                    not fresh_store(system, attempt) or len(committed(mine)) > args.keep_last + 1
                )
                due = back and newer and steady and time.time() >= launched + at
            if starts and due and alive(starts[-1]["pid"]):
                break
            if proc.poll() is not None:
                raise SystemExit(f"[{econ.name}] {system}: the job ended before kill {attempt + 1}")
            time.sleep(0.01)
        killed = time.time()
        kills.append(killed)
        os.kill(starts[-1]["pid"], signal.SIGKILL)
        # the step reached is read once the rank is gone, from every event it wrote before the
        # kill (as the report below reads it): steps logged just before the kill may not have
        # been read yet
        deadline = killed + 30
        while alive(starts[-1]["pid"]) and time.time() < deadline:
            time.sleep(0.005)
        done = [
            e
            for e in events_of(events)
            if e["event"] == "loss" and e["attempt"] == attempt and e["t"] < killed
        ]
        reached.append(max((e["step"] for e in done), default=0))
        if system == "dcp-disk":
            drop_page_cache()
    if system == "none":  # nothing more to learn from it
        while not [e for e in events_of(events) if e["event"] == "ready"][len(kills) :]:
            time.sleep(0.05)
        proc.terminate()
        proc.wait()
        log.close()
        ended, last_step = time.time(), 0
    else:  # the job is stopped once it is back from the last kill: all there is to measure
        ended, last_step = back_from(proc, events, len(kills), reached[-1], econ, system)
        proc.terminate()
        proc.wait()
        log.close()
    ev = events_of(events)
    failures = []
    for attempt, killed in enumerate(kills):
        before = [e for e in ev if e["event"] == "loss" and e["attempt"] == attempt]
        step_reached = max((e["step"] for e in before if e["t"] < killed), default=0)
        (ready,) = [e for e in ev if e["event"] == "ready" and e["attempt"] == attempt + 1]
        (start,) = [e for e in ev if e["event"] == "start" and e["attempt"] == attempt + 1]
        # deleting the local store stands in for a new node, which has nothing to delete
        wipe = start.get("wipe_seconds", 0.0)
        failure = {
            "killed_at": killed - launched,
            "step_reached": step_reached,
            "resumed_from_step": ready["step"],
            "relaunch": ready["restore_start"] - killed - wipe,
            "wipe": wipe,
        }
        if system != "none":
            back = [
                e["t"]
                for e in ev
                if e["event"] == "loss"
                and e["attempt"] == attempt + 1
                and e["step"] >= step_reached
            ]
            resumed = [e for e in ev if e["event"] == "resume" and e["attempt"] == attempt + 1]
            failure |= {
                "tier": resumed[0]["tier"] if resumed else None,
                "restore": ready["restore_end"] - ready["restore_start"],
                "load": resumed[0]["load_seconds"] if resumed else 0.0,
                "recompute": min(back) - ready["restore_end"],
                "lost": min(back) - killed - wipe,
            }
        failures.append(failure)
    saves = [e["blocking_seconds"] for e in ev if e["event"] == "save"]
    return {
        "interval": interval,
        "mode": mode,
        "seconds": ended - launched,
        "last_step": last_step,
        "failures": failures,
        "blocking_median": statistics.median(saves) if saves else 0.0,
        "blocking_max": max(saves, default=0.0),
        **copy_lag(ev, args.keep_last + 1, system),
    }


def fresh_store(system: str, attempt: int) -> bool:
    """Whether the store a start of ``system`` saves into and restores from has fresh memory
    for the saves it holds: the first start's LMDB store and Redis server (a restarted job's
    node keeps its store, a server its memory), and every start's for ``tiers``, whose node
    is replaced (a new node's store; its copies to the shared tier run beside that store's
    first saves). DCP writes every save into new files, so its saves pay for fresh memory in
    a long job's steady state too: nothing to wait for."""
    return system in REPLACED or (attempt == 0 and system in ("lmdb", "redis"))


def back_from(
    proc: subprocess.Popen, events: Path, attempt: int, step: int, econ: Economy, system: str
) -> tuple[float, int]:
    """Wait until ``attempt`` has trained past ``step`` (where the kill before it found the
    job); the time it got there and the step."""
    while True:
        back = [
            e
            for e in events_of(events)
            if e["event"] == "loss" and e["attempt"] == attempt and e["step"] >= step
        ]
        if back:
            return back[0]["t"], back[0]["step"]
        if proc.poll() is not None:
            raise SystemExit(f"[{econ.name}] {system}: the job ended before it was back")
        time.sleep(0.05)


def copy_lag(ev: list[dict[str, Any]], warm_up: int = 0, system: str = "tiers") -> dict[str, Any]:
    """How far behind the first tier a further tier runs: for each save that reached it (the
    "copied" events ``Tiers`` reports), seconds from the save's step to the copy's commit
    there; and how many of the saves got there (``copy="newest"`` skips saves made while a
    copy runs). The lag is that of the steady state the kills find (``with_failures``): the
    first ``warm_up`` copies of each start are left out (into a new node's store and, once
    per server, the shared tier's fresh memory, beside the restart's own work). Empty for a
    system without further tiers."""
    every = copies(ev, system)
    if not every:
        return {}
    steady: list[dict[str, Any]] = []
    per_start: Counter[int] = Counter()
    for e in every:
        per_start[e["attempt"]] += 1
        if per_start[e["attempt"]] > warm_up:
            steady.append(e)
    copied = steady or every
    at = {(e["attempt"], e["step"]): e["t"] for e in ev if e["event"] == "loss"}
    lags = [e["t"] - at[e["attempt"], e["step"]] for e in copied if (e["attempt"], e["step"]) in at]
    return {
        "copy_lag_median": statistics.median(lags) if lags else None,
        "copy_lag_max": max(lags, default=None),
        "copies": len(every),
        "saves": sum(1 for e in ev if e["event"] == "save"),
    }


def schedule(
    args: argparse.Namespace, interval: int, step: float, firsts: dict[str, list[float]]
) -> tuple[list[float], int]:
    """Three kills of a system saving every ``interval`` steps, spaced by an interval's worth
    of steps plus the slowest time to first step (relaunch and restore) and a margin; and
    steps enough that the job is still training after the third, however long the kills
    wait (a run stops once it is back from the third). Each kill also waits until the job is
    back from the one before and has committed a newer save (``with_failures``)."""
    slowest = max(max(v) for v in firsts.values())
    spacing = math.ceil(interval * step + max(8.0, slowest + 3.0))
    kills = [float(spacing * i) for i in (1, 2, 3)]
    return kills, max(args.steps, math.ceil(10 * spacing / step))


def failures(
    places: Places, econ: Economy, args: argparse.Namespace, results: dict[str, Any]
) -> None:
    """Each system trained with three kills (``with_failures``), at its own interval and its
    own kill schedule (``schedule``, or ``--kills`` for every system); its goodput is against
    the never-checkpointing job over the same steps."""
    given = (args.kills, args.steps)
    cal = results["calibration"]
    step = cal["none"]["step_seconds"]
    # the never-checkpointing job's start-up and time per step, both measured above
    fresh = statistics.median(results.get("first_step", {}).get(FRESH) or [0.0])
    per_step = statistics.median(NONE_STEPS.get(econ.name, [0, []])[1] or [0.0]) or step

    def run(system: str, interval: int, mode: str) -> dict[str, Any]:
        args.steps = given[1]  # each system's schedule from the given minimum, not the last's
        if given[0] == "auto":
            args.kills, args.steps = schedule(args, interval, step, results["first_step"])
        else:  # enough steps that the job still trains at the last kill (at least --steps),
            # and that each kill finds the saves it waits for (``with_failures``), however
            # long the interval the calibration chose
            args.kills = given[0]
            args.steps = max(
                given[1],
                math.ceil((max(args.kills) + 10) * 1.5 / step),
                (args.keep_last + 2 + 2 * len(args.kills)) * interval,
            )
        print(f"[{econ.name}] {system}: kills at {args.kills} s, {args.steps} steps", flush=True)
        r = with_failures(places, econ, system, interval, mode, args)
        r |= {"kills": args.kills, "steps": args.steps}
        # over the steps the run trained before it was stopped, back from its last kill
        r["failure_free_seconds"] = fresh + ((r["last_step"] or args.steps) - 1) * per_step
        return r

    if "relaunch_alone" not in results:  # else: the run --resume continues
        results["relaunch_alone"] = run("none", 0, "sync")
    results.setdefault("failures", {})
    for system in args.systems:
        chosen = cal[system]
        results["failures"][system] = run(system, chosen["interval"], chosen["mode"])
        print(f"[{econ.name}] {system}: {results['failures'][system]}", flush=True)
        # what is measured so far, should the run be cut short
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"goodput-{econ.name}-partial.json").write_text(
            json.dumps(results, indent=1)
        )
    args.kills, args.steps = given
