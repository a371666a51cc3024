"""Training time lost per failure, and goodput, for each checkpointing system, in the economy
users train in.

Runs ``examples/train_resume.py`` under ``torchrun`` for each system, in each economy
(``--economy``, both by default, each labelled in every table):

- ``accel``: an accelerator node, simulated: 2 ranks, each with ``--accel-state-gib`` (1 GiB) of
  state of its own; a step waits ``--accel-step-seconds`` (1 s) while the host's cores stay
  free, runs DDP's all-reduces (one per gradient bucket, of one element) and changes the state.
  Left out: the device-to-host copy of a save and of a restore (PCIe), the gradients' bytes on
  the interconnect, NCCL's start-up.
- ``cpu``: 2 ranks of DDP and AdamW on the host's cores, which then have nothing to spare: every
  byte a background save moves costs training time.
- ``cuda`` (on a GPU machine; not in the default): a small transformer trained on the GPU, one
  rank, saves staged into pinned host memory.

Systems:

- DCP ``FileSystemWriter`` on disk, the page cache dropped after each kill (a replaced node
  starts cold);
- DCP ``FileSystemWriter`` on /dev/shm;
- kvckpt LMDB on /dev/shm; kvckpt Redis (a local redis-server);
- kvckpt ``Tiers`` (LMDB, then Redis) with the node-local store wiped at each restart (a
  replaced node), restoring through ``Tiers.prefetch()``;
- kvckpt ``Tiers(peers=1, shared_every=--peers-shared-every)`` on two simulated hosts (each
  rank its own ``KVCKPT_NODE`` and LMDB store), the killed rank's host's store wiped at each
  restart: its share comes back from the other host's store.

Every system saves either through ``dcp.async_save`` staged by ``kvckpt.background_stager()``
(DCP's own ``DefaultStager`` set up for this host) or with a plain ``dcp.save``, whichever
costs it less (below), so the systems differ only in where the bytes go and how. Per economy:

1. **Interval.** A failure-free run per system and saving mode (``async_save`` with
   ``kvckpt.background_stager()``, or a plain ``dcp.save``; ``--cpu-modes`` / ``--accel-modes``),
   taking turns with a run that never checkpoints, saving every ``--calibrate-every`` steps.
   After ``--calibrate-warmup`` saves (fresh memory, paid once), the overhead of one save is
   the extra time of the steps the next ``--calibrate-saves`` saves span, less any wait for the
   previous save's upload. Each system uses its cheaper mode, at the smallest interval whose
   estimated overhead is at most ``--overhead`` (5%) of training time; the estimate is then
   **measured at the interval** (a run saving at it against a run that never saves); where that
   came in under half the limit (a high estimate), twice more, moving down (by half at most).
   With ``--search`` the interval then moves in proportion to the measured overhead until the
   smallest interval that passes is within 10% of the largest that fails (``--verify-tries``).
2. **Time to first step.** A fresh start that never checkpoints, against a start that restores
   ``Tiers``' newest checkpoint on a new node: with ``prefetch()`` (which copies only where a
   core is spare) and without; taking turns. ``--search`` adds ``prefetch(force=True)`` and a
   restore whose node kept its store (the best a prefetch can leave).
3. **Failures.** Each system trains at its interval while a rank is SIGKILLed three times,
   spaced by the system's interval plus the slowest time to first step (``--kills`` gives
   seconds after launch for every system instead); a kill waits until the job is back from
   the one before and in its steady state: since it (re)started it has committed
   ``--keep-last`` + 2 saves (for ``tiers``, in the shared tier a replaced node restores
   from), the newest one newer than the checkpoint it restored; torchrun
   restarts the job. A run that never checkpoints is killed the same way, for the relaunch
   that no checkpointing system can avoid. A run stops once it is back from its third kill:
   all there is to measure. Per failure: *lost* = kill
   -> the job is back at the step it had reached, split into relaunch (kill -> the restore
   starts), restore and recompute; for ``Tiers`` less the time the restarted job takes to
   delete the node-local store, which stands in for a new node (that has nothing to delete).
   *Expected lost* puts half an interval of steps in the recompute's place (three kills land
   where they land), and for ``Tiers`` on a new node, which restores what the shared tier
   holds, also the median time from a save's step to its copy's commit there (*copy lag*,
   from the copies ``kvckpt.events`` reports). *Checkpoint-attributable* = restore + that
   recompute + what the system adds to relaunch over the never-checkpointing run's (a
   prefetch competing with start-up, say). *Goodput* = failure-free time (the
   never-checkpointing job's measured start-up plus its measured time per step, over the same
   steps) / this run's time, from launch until it is back from its third kill.

    python benchmarks/goodput.py --out docs/benchmark          # both economies, 27-38 min
    python benchmarks/goodput.py --economy cuda --out docs/benchmark/h100   # on a GPU machine

Check ``/proc/loadavg`` first: the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from goodput_failures import failures
from goodput_report import chart, interval_table, report
from goodput_runs import (
    FORCED,
    FRESH,
    NO_PREFETCH,
    NONE_STEPS,
    PREFETCH,
    REPLACED,
    SETTLE_STEPS,
    SURVIVED,
    SYSTEMS,
    Economy,
    Places,
    copies,
    economies,
    run_to_end,
    steady_start,
    step_times,
    wait_quiet,
    warm_up,
)
from report import write_report

from kvckpt.testing import RedisServer


def calibrate(places: Places, econ: Economy, args: argparse.Namespace) -> dict[str, Any]:
    """Each system's overhead per save in each of the economy's saving modes, and the interval
    and mode that it then checkpoints at: the mode with the least overhead (each at its best)."""
    every, saves = args.calibrate_every, args.calibrate_saves
    # The window spans ``saves`` saves after the warm-up (``warm_up``) and the steps their
    # background work overlaps: the steady state a long job is in.
    early, after = warm_up(args)
    first = every * math.ceil(after / every)
    window = (first, first + every * saves)
    steps = window[1]
    cases = ["none", *(f"{system}/{mode}" for system in args.systems for mode in econ.modes)]
    if args.blocking and "dcp-disk" in args.systems:
        cases.append("dcp-disk/blocking")  # DCP's default async_save: the blocking comparison
    cases = list(dict.fromkeys(cases))
    spans: dict[str, list[float]] = {c: [] for c in cases}
    blocking: dict[str, list[float]] = {c: [] for c in cases}
    waiting: dict[str, list[float]] = {c: [] for c in cases}
    flight: dict[str, list[float]] = {c: [] for c in cases}
    after: dict[str, list[float]] = {c: [] for c in cases}  # each save's steps, less its wait
    for rnd in range(args.calibrate_rounds):
        for case in cases[rnd % len(cases) :] + cases[: rnd % len(cases)]:  # taking turns
            system, _, mode = case.partition("/")
            places.clear()
            wait_quiet(args)
            how = ["--every", "0"]
            if case != "none":
                how = ["--every", str(every), "--every-from", str(first), "--staging", mode]
                how += ["--also-save-at", ",".join(map(str, early))]
            ev = run_to_end(places, econ, system, args, "--steps", str(steps), *how)
            t = step_times(ev)
            spans[case].append(t[window[1]] - t[window[0]])
            measured = [
                e for e in ev if e["event"] == "save" and window[0] <= e["step"] < window[1]
            ]
            blocking[case] += [e["blocking_seconds"] for e in measured]
            waiting[case] += [e["waiting_for_previous_seconds"] for e in measured]
            after[case] += [
                t[e["step"] + every] - t[e["step"]] - e["waiting_for_previous_seconds"]
                for e in measured
                if e["step"] + every in t
            ]
            flight[case] += [  # from the save's call until its upload is done
                e["seconds"]
                for e in ev
                if e["event"] == "uploaded" and window[0] <= e["step"] < window[1]
            ] or [e["blocking_seconds"] for e in measured]
            print(f"[{econ.name}] calibrate {case}: {spans[case][-1]:.2f} s", flush=True)
    base = statistics.median(spans["none"])
    step = base / (window[1] - window[0])
    out: dict[str, dict[str, Any]] = {"none": {"step_seconds": step, "spans": spans["none"]}}
    for case in cases[1:]:
        # Each save's cost: the time of the steps up to the next save beyond the same steps
        # never checkpointing, less the save's wait for the previous upload (which goes away
        # at an interval longer than the upload: in the slower system's favour). The median
        # over the window's saves, so that one save still paying for fresh memory does not
        # count as every save's cost.
        measured = (statistics.median(spans[case]) - base) / saves
        per_save = max(0.0, statistics.median(after[case]) - every * step)
        in_flight = statistics.median(flight[case])
        out[case] = {
            "spans": spans[case],
            "measured_overhead_per_save_seconds": measured,
            "waiting_for_previous_median": statistics.median(waiting[case]),
            "overhead_per_save_seconds": per_save,
            "in_flight_seconds": in_flight,
            # at most the overhead's share of training, and no wait for the previous save
            "interval": max(
                1, math.ceil(per_save / (args.overhead * step)), math.ceil(in_flight / step)
            ),
            "blocking_median": statistics.median(blocking[case]),
            "blocking_max": max(blocking[case]),
            "blocking": blocking[case],
        }
        print(
            f"[{econ.name}] {case}: {per_save:.2f} s per save, {in_flight:.2f} s in flight",
            flush=True,
        )
    for system in args.systems:
        best = min(
            (f"{system}/{m}" for m in econ.modes), key=lambda c: out[c]["overhead_per_save_seconds"]
        )
        out[system] = {**out[best], "mode": best.partition("/")[2]}
    return out


def verify(
    places: Places, econ: Economy, args: argparse.Namespace, calibration: dict[str, Any]
) -> None:
    """Measure each system's overhead at its estimated interval: a run saving at the interval
    (over at least ``--verify-steps`` steps and ``--verify-saves`` saves) against the time
    per step of a run that never checkpoints (``none_step``). With
    ``--search`` (``--verify-tries`` above 1) the interval then moves in proportion to the
    measured overhead (``next_interval``), up while above the limit, down while well under it,
    until the smallest passing interval is within 10% of the largest failing one.

    The estimate times saves ``--calibrate-every`` steps apart and leaves out waits for the
    previous upload; at a shorter interval a save's background work can still be running at
    the next save, or compete with training for the cores. Only a run at the interval itself
    shows that. An interval measured above the limit on the last try is raised in proportion
    (not measured again; the report says so).

    The warm-up saves that pay for fresh memory come first, as in the estimate (``warm_up``),
    and the saves at the interval start after them (``--every-from``): the check measures the
    steady state a long job is in, from the interval's first save, whatever the interval. For
    ``tiers`` the window starts later, at the first save at the interval after the shared tier
    has committed ``--keep-last`` + 1 copies (``steady_start``): until then each copy there
    also pays for fresh memory, once per server, which a long job's shared tier has long
    paid. What the warm-up costs after a restart (a replaced node's new store) is in the
    failure runs."""
    early, after = warm_up(args)
    for system in args.systems:
        chosen = calibration[system]
        interval: int | None = chosen["interval"]
        tries: list[dict[str, Any]] = []
        while interval is not None and (len(tries) < args.verify_tries or _well_under(tries, args)):
            saves = max(args.verify_saves, math.ceil(args.verify_steps / interval))
            start = interval * max(1, math.ceil(after / interval))  # the interval's first save
            last = start + interval * saves + (SETTLE_STEPS if system in REPLACED else 0)
            places.clear()
            wait_quiet(args)
            how = ["--every", str(interval), "--every-from", str(start)]
            how += ["--staging", chosen["mode"], "--also-save-at", ",".join(map(str, early))]
            ev = run_to_end(places, econ, system, args, "--steps", str(last), *how)
            t = step_times(ev)
            if system in REPLACED:
                start = steady_start(
                    copies(ev, system), ev, start, interval, last - interval * saves, args.keep_last
                )
            end = start + interval * saves
            overhead = (t[end] - t[start]) / (end - start) / none_step(places, econ, args) - 1
            tries.append({"interval": interval, "steps": [start, end], "overhead": overhead})
            print(f"[{econ.name}] verify {system} every {interval}: {overhead:.1%}", flush=True)
            interval = next_interval(tries, args.overhead)
        passed = [t["interval"] for t in tries if t["overhead"] <= args.overhead]
        chosen["estimated_interval"] = chosen["interval"]
        chosen["verified"] = tries
        if not tries:  # --verify-tries 0: the estimate, not measured
            chosen["measured_overhead"] = None
        elif passed:
            chosen["interval"] = min(passed)
            chosen["measured_overhead"] = next(
                t["overhead"] for t in tries if t["interval"] == min(passed)
            )
        else:  # not measured at the last raise: said in the report
            chosen["interval"] = next_interval(tries, args.overhead, searching=False)
            chosen["measured_overhead"] = None


def _well_under(tries: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    """Whether to go on measuring after a first check that came in under half the limit (the
    estimate was high): down, and once more between, three checks at most."""
    return args.verify_tries > 0 and len(tries) < 3 and tries[0]["overhead"] < args.overhead / 2


def none_step(places: Places, econ: Economy, args: argparse.Namespace) -> float:
    """Seconds per step of the run that never checkpoints, over ``--verify-steps`` steps after
    ``--calibrate-every`` of warm-up; measured at the first check of an economy and again at
    every third, so that the checks take turns with it. The median of those measured."""
    calls, measured = NONE_STEPS.setdefault(econ.name, [0, []])
    NONE_STEPS[econ.name][0] += 1
    if calls % 3 == 0:
        places.clear()
        wait_quiet(args)
        first, last = args.calibrate_every, args.calibrate_every + args.verify_steps
        t = step_times(run_to_end(places, econ, "none", args, "--steps", str(last), "--every", "0"))
        measured.append((t[last] - t[first]) / (last - first))
    return statistics.median(measured)


def next_interval(tries: list[dict[str, Any]], limit: float, searching: bool = True) -> int | None:
    """The next interval to measure, or None when the search is done: the last interval
    scaled by its overhead over the limit (overhead per save is roughly fixed, so the share
    of training it takes falls as 1/interval), kept strictly between the largest interval
    that failed and the smallest that passed. Done when no interval is left between them, or
    the candidate is within 10% of a passing interval (closer than the measurement's noise).
    Down, it moves by half the interval at most.
    ``searching=False``: the raise after the last failure, whatever the bracket."""
    passed = min((t["interval"] for t in tries if t["overhead"] <= limit), default=None)
    failed = max((t["interval"] for t in tries if t["overhead"] > limit), default=0)
    last = tries[-1]
    guess = last["interval"] * max(last["overhead"], 0.0) / limit
    if last["overhead"] > limit:
        candidate = max(last["interval"] + 1, math.ceil(guess))
    else:  # down by half at most: an overhead near zero is as much noise as measure
        candidate = min(last["interval"] - 1, max(math.floor(guess), -(-last["interval"] // 2)))
    candidate = max(candidate, failed + 1, 1)
    if not searching:
        return candidate
    if passed is not None:
        candidate = min(candidate, passed - 1)
        if candidate <= failed or candidate >= 0.9 * passed:
            return None
    return candidate


def first_steps(places: Places, econ: Economy, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds from process start to the end of the first training step."""
    places.clear()
    run_to_end(places, econ, "tiers", args, "--steps", "2", "--every", "2")  # one to restore
    local = places.shm / "local"
    kept = places.shm / "local-kept"  # the node-local copy, for the start whose node survived
    if args.search:
        sparse_copy(local, kept)
    cases = {
        FRESH: ("none", ["--steps", "1", "--every", "0"]),
        PREFETCH: ("tiers", ["--steps", "3", "--every", "0"]),
        NO_PREFETCH: ("tiers", ["--steps", "3", "--every", "0", "--no-prefetch"]),
    }
    if args.search:  # for context: the best a prefetch can leave, and one that always copies
        cases[SURVIVED] = ("lmdb", ["--steps", "3", "--every", "0"])
        cases[FORCED] = ("tiers", ["--steps", "3", "--every", "0", "--force-prefetch"])
    out: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.repeats):
        names = list(cases)
        turn = rnd % len(names)
        for name in names[turn:] + names[:turn]:
            system, extra = cases[name]
            shutil.rmtree(local, ignore_errors=True)  # a new node
            if name == SURVIVED:
                sparse_copy(kept, local)  # ... or the same node, its store intact
            wait_quiet(args)
            ev = run_to_end(places, econ, system, args, *extra)
            start = next(e["process_start"] for e in ev if e["event"] == "start")
            first = min(e["t"] for e in ev if e["event"] == "loss")
            out[name].append(first - start)
            print(f"[{econ.name}] first step, {name}: {out[name][-1]:.2f} s", flush=True)
    shutil.rmtree(kept, ignore_errors=True)
    return out


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy a store directory keeping its data file sparse: LMDB's file is as long as its map
    (several times the data), and a plain copy would allocate all of it."""
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)


def run_economy(places: Places, econ: Economy, args: argparse.Namespace) -> dict[str, Any]:
    """The phases of ``--phases`` in one economy; those left out come from ``--resume``."""
    earlier = json.loads(Path(args.resume).read_text()) if args.resume else {}
    if "label" in earlier:  # one economy's partial results
        earlier = {econ.name: earlier}
    earlier = earlier.get("economies", earlier)
    results: dict[str, Any] = {"label": econ.label, **earlier.get(econ.name, {})}
    started = time.time()
    took = results.setdefault("phase_minutes", {})
    if "intervals" in args.phases:
        results["calibration"] = calibrate(places, econ, args)
        took["calibrate"] = (time.time() - started) / 60
        verify(places, econ, args, results["calibration"])
        took["verify"] = (time.time() - started) / 60 - took["calibrate"]
        print(interval_table(results["calibration"], args.systems), flush=True)
    if "first-step" in args.phases:
        begun = time.time()
        results["first_step"] = first_steps(places, econ, args)
        took["first-step"] = (time.time() - begun) / 60
    if "failures" in args.phases:
        begun = time.time()
        failures(places, econ, args, results)
        took["failures"] = (time.time() - begun) / 60
    results["minutes"] = results.get("minutes", 0) + (time.time() - started) / 60
    return results


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--economy", default="accel,cpu", help="accel, cpu and/or cuda")
    ap.add_argument("--accel-state-gib", type=float, default=1.0, help="state per rank")
    ap.add_argument("--accel-step-seconds", type=float, default=1.0)
    ap.add_argument("--accel-modes", default="background", help="saving modes measured")
    ap.add_argument("--cpu-width", type=int, default=1024)
    ap.add_argument("--cpu-layers", type=int, default=6)
    ap.add_argument("--cpu-batch", type=int, default=8)
    ap.add_argument("--cpu-modes", default="background,sync", help="saving modes measured")
    ap.add_argument("--cuda-width", type=int, default=1024)
    ap.add_argument("--cuda-layers", type=int, default=8)
    ap.add_argument("--cuda-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="steps of each failure run (at least)")
    ap.add_argument(
        "--kills",
        default="auto",
        help="seconds after launch at which a rank is killed (comma-separated), or auto: three "
        "kills spaced so that every system recovers before the next, --steps raised to match",
    )
    ap.add_argument("--keep-last", type=int, default=1)
    ap.add_argument("--overhead", type=float, default=0.05)
    ap.add_argument("--calibrate-every", type=int, default=3)
    ap.add_argument(
        "--calibrate-warmup",
        type=int,
        default=4,
        help="saves before the window: fresh memory for the keep_last saves a store holds, the "
        "one being written and (Tiers) the one being copied",
    )
    ap.add_argument("--calibrate-saves", type=int, default=3, help="saves in the window")
    ap.add_argument("--calibrate-rounds", type=int, default=1)
    ap.add_argument(
        "--verify-steps", type=int, default=16, help="steps each interval is checked over"
    )
    ap.add_argument(
        "--verify-saves",
        type=int,
        default=2,
        help="saves each interval is checked over at least (a long interval's check is this "
        "many intervals long; --search: 3)",
    )
    ap.add_argument(
        "--verify-tries", type=int, default=1, help="intervals measured per system (--search: 4)"
    )
    ap.add_argument(
        "--search",
        action="store_true",
        help="search each interval by measuring (up to --verify-tries 4 intervals) instead of "
        "measuring the estimate once; two warm-up saves 6 steps apart, 24 steps per check",
    )
    ap.add_argument(
        "--blocking",
        action="store_true",
        help="also measure DCP's default async_save (its blocking copy) on disk",
    )
    ap.add_argument("--repeats", type=int, default=3, help="of each time-to-first-step case")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument(
        "--peers-shared-every",
        type=int,
        default=10,
        help="tiers-peers: Tiers(shared_every=N), every N-th save also to Redis",
    )
    ap.add_argument("--max-busy", type=float, default=0.15)
    ap.add_argument("--disk-dir", default=None, help="a directory on disk (default: /tmp)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--from-json", help="only re-render the report of an earlier run's JSON")
    ap.add_argument(
        "--phases",
        default="intervals,first-step,failures",
        help="the phases to run; a run split in two takes the others from --resume",
    )
    ap.add_argument(
        "--resume",
        help="an earlier run's goodput.json (or one economy's goodput-ECONOMY-partial.json): "
        "the phases not in --phases come from it, and a cut failure phase goes on with the "
        "--systems it has not measured",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        machine = data.pop("machine")
        write_report(args.out, "goodput", report(data["economies"]), machine, data)
        chart(data["economies"], Path(args.out) / "goodput.png")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the clean-up below runs
    if args.search:
        args.verify_tries = max(args.verify_tries, 4)
        args.verify_steps = max(args.verify_steps, 24)
        args.verify_saves = max(args.verify_saves, 3)
        args.calibrate_every, args.calibrate_warmup = 6, 2
    if args.kills != "auto":
        args.kills = [float(k) for k in args.kills.split(",")]
    args.systems = args.systems.split(",")
    args.phases = args.phases.split(",")
    chosen = [economies(args)[e] for e in args.economy.split(",")]

    work = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-"))
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-", dir=args.disk_dir))
    places = Places(work, shm, disk, RedisServer(work / "redis"), 0, args.peers_shared_every)
    started = time.time()
    results: dict[str, Any] = {}
    try:
        for econ in chosen:
            results[econ.name] = run_economy(places, econ, args)
    finally:
        places.server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        print(f"logs in {work}", flush=True)
    if "failures" not in args.phases and not args.resume:  # the first half of a split run
        Path(args.out).mkdir(parents=True, exist_ok=True)
        data = {"args": vars(args), "economies": results}
        (Path(args.out) / "goodput.json").write_text(json.dumps(data, indent=1))
        return
    minutes = (time.time() - started) / 60
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")
        + f"; medians; {minutes:.0f} min in all; "
        f"`python benchmarks/goodput.py {' '.join(sys.argv[1:])}`"
    )
    data = {"args": vars(args), "economies": results}
    write_report(args.out, "goodput", report(results), machine, data)
    chart(results, Path(args.out) / "goodput.png")


if __name__ == "__main__":
    main()
