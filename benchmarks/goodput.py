"""Training time lost per failure, and goodput, for each checkpointing system in one run.

Runs ``examples/train_resume.py`` under ``torchrun`` (2 ranks, DDP, gloo on CPU; model plus
AdamW, over 2 GiB of checkpointed state at the defaults) for each system:

- DCP ``FileSystemWriter`` on disk, the page cache dropped after each kill (a replaced node
  starts cold);
- DCP ``FileSystemWriter`` on /dev/shm;
- kvckpt LMDB on /dev/shm; kvckpt Redis (a local redis-server);
- kvckpt ``Tiers`` (LMDB, then Redis) with the node-local store wiped at each restart (a
  replaced node), restoring through ``Tiers.prefetch()``.

Every system stages its saves with ``kvckpt.background_stager()`` (DCP's own ``DefaultStager``
set up for this host), so the systems differ only in where the bytes go. Three phases:

1. **Interval.** Failure-free runs, the systems taking turns with a run that never checkpoints,
   save every ``--calibrate-every`` steps, in each saving mode (``--modes``: ``async_save``
   with ``kvckpt.background_stager()``, or a plain ``dcp.save``). After ``--calibrate-warmup``
   saves (fresh memory, paid once), the overhead of one save is the extra time of the steps
   the next ``--calibrate-saves`` saves span, less any wait for the previous save's upload
   (which a longer interval would not have). Each system then uses its cheaper mode, at the
   smallest interval whose overhead is at most ``--overhead`` (5%) of failure-free training
   time. DCP's default ``async_save`` (its blocking copy) is measured too, for the blocking
   comparison. That estimate is then checked by training at it (``verify``): a run saving at
   the interval against a run that never saves, over the same steps; the interval moves in
   proportion to the measured overhead (up while above 5%, down while well under) until the
   smallest interval that passes is within 10% of the largest that fails.
2. **Time to first step.** A fresh start that never checkpoints, against a start that restores
   ``Tiers``' newest checkpoint on a new node, with and without ``prefetch()``; taking turns.
3. **Failures.** Each system trains ``--steps`` steps at its interval while the same SIGKILL
   schedule (``--kills``, seconds after launch) kills a rank; torchrun restarts the job. Per
   failure: *lost time* = kill -> the job is back at the step it had reached, split into
   relaunch (kill -> the restore starts), restore, and recompute. *Goodput* = failure-free time
   (the never-checkpointing run) / this run's time.

    python benchmarks/goodput.py --out docs/benchmark

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import figure, markdown_table, write_report  # noqa: E402

from examples.train_resume import model_for  # noqa: E402
from kvckpt.testing import RedisServer, torchrun_command  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_resume.py"
SYSTEMS = ["dcp-disk", "dcp-shm", "lmdb", "redis", "tiers"]
NAMES = {
    "none": "no checkpoints",
    "dcp-disk": "DCP FileSystemWriter, disk (cold cache after a kill)",
    "dcp-shm": "DCP FileSystemWriter, /dev/shm",
    "lmdb": "kvckpt LMDB, /dev/shm",
    "redis": "kvckpt Redis",
    "tiers": "kvckpt Tiers, local store wiped (node replaced)",
}
MODES = {
    "background": "async_save, kvckpt.background_stager()",
    "sync": "dcp.save",
    "blocking": "async_save, DCP's default staging",
}


@dataclass
class Places:
    """Where each system keeps its checkpoints; ``clear()`` empties them all."""

    work: Path
    shm: Path
    disk: Path
    server: RedisServer
    runs: int = 0

    def store_args(self, system: str) -> list[str]:
        local = self.shm / "local"
        return {
            "none": ["--store", f"dcp:{self.shm / 'unused'}"],
            "dcp-disk": ["--store", f"dcp:{self.disk / 'dcp'}"],
            "dcp-shm": ["--store", f"dcp:{self.shm / 'dcp'}"],
            "lmdb": ["--store", f"lmdb://{local}"],
            "redis": ["--store", self.server.url()],
            "tiers": ["--store", f"lmdb://{local}", "--store", self.server.url()],
        }[system]

    def clear(self) -> None:
        self.server.client().flushall()
        for path in (self.shm, self.disk):
            for child in path.iterdir():
                shutil.rmtree(child, ignore_errors=True)


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def launch(places: Places, system: str, args: argparse.Namespace, *extra: str) -> tuple:
    places.runs += 1
    events = places.work / f"events-{places.runs}.jsonl"
    cmd = torchrun_command(
        EXAMPLE,
        *places.store_args(system),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--keep-last",
        str(args.keep_last),
        "--events",
        str(events),
        *extra,
        max_restarts=3 if args.kills == "auto" else len(args.kills),
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    log = open(places.work / f"run-{places.runs}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, events, log


def finish(proc: subprocess.Popen, log: Any, what: str) -> None:
    rc = proc.wait()
    log.close()
    if rc != 0:
        tail = Path(log.name).read_text()[-4000:]
        raise SystemExit(f"{what} failed (rc {rc}); see {log.name}\n{tail}")


def run_to_end(places: Places, system: str, args: argparse.Namespace, *extra: str) -> list[dict]:
    proc, events, log = launch(places, system, args, *extra)
    finish(proc, log, f"{system} {' '.join(extra)}")
    return events_of(events)


def step_times(events: list[dict]) -> dict[int, float]:
    """The wall time each step was (last) completed."""
    return {e["step"]: e["t"] for e in events if e["event"] == "loss"}


# -- phase 1: the interval -------------------------------------------------------------------


def calibrate(places: Places, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each system's overhead per save in each saving mode (``--modes``), and the interval and
    mode that it then checkpoints at: the mode with the least overhead (each at its best)."""
    every, saves, warm = args.calibrate_every, args.calibrate_saves, args.calibrate_warmup
    # The first saves are the warm-up: their staging copy and store pages are fresh memory,
    # paid once per process (staging) or once per store (LMDB's pages, which a restarted job
    # on the same node keeps). The window spans the next ``saves`` saves and the steps their
    # background work overlaps: the steady state a long job is in.
    steps = every * (warm + saves + 1)
    window = (every * (warm + 1), steps)
    cases = [
        "none",
        *(f"{system}/{mode}" for system in args.systems for mode in args.modes),
        "dcp-disk/blocking",  # DCP's default async_save: the blocking comparison
    ]
    cases = list(dict.fromkeys(cases))
    spans: dict[str, list[float]] = {c: [] for c in cases}
    blocking: dict[str, list[float]] = {c: [] for c in cases}
    waiting: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.calibrate_rounds):
        for case in cases[rnd % len(cases) :] + cases[: rnd % len(cases)]:  # taking turns
            system, _, mode = case.partition("/")
            places.clear()
            wait_quiet(args)
            how = ["--every", "0"] if case == "none" else ["--every", str(every), "--staging", mode]
            ev = run_to_end(places, system, args, "--steps", str(steps), *how)
            t = step_times(ev)
            spans[case].append(t[window[1]] - t[window[0]])
            measured = [
                e for e in ev if e["event"] == "save" and window[0] <= e["step"] < window[1]
            ]
            blocking[case] += [e["blocking_seconds"] for e in measured]
            waiting[case] += [e["waiting_for_previous_seconds"] for e in measured]
            print(f"calibrate {case}: {spans[case][-1]:.2f} s for steps {window}", flush=True)
    base = statistics.median(spans["none"])
    step = base / (window[1] - window[0])
    out: dict[str, dict[str, Any]] = {"none": {"step_seconds": step, "spans": spans["none"]}}
    for case in cases[1:]:
        # Time spent waiting for the previous save's upload goes away at an interval longer
        # than the upload: it is not counted (in the slower system's favour).
        measured = (statistics.median(spans[case]) - base) / saves
        per_save = max(0.0, measured - statistics.median(waiting[case]))
        out[case] = {
            "spans": spans[case],
            "measured_overhead_per_save_seconds": measured,
            "waiting_for_previous_median": statistics.median(waiting[case]),
            "overhead_per_save_seconds": per_save,
            "interval": max(1, math.ceil(per_save / (args.overhead * step))),
            "blocking_median": statistics.median(blocking[case]),
            "blocking_max": max(blocking[case]),
            "blocking": blocking[case],
        }
        print(f"{case}: {per_save:.2f} s per save", flush=True)
    for system in args.systems:
        best = min(
            (f"{system}/{m}" for m in args.modes), key=lambda c: out[c]["overhead_per_save_seconds"]
        )
        out[system] = {**out[best], "mode": best.partition("/")[2]}
    return out


def verify(places: Places, args: argparse.Namespace, calibration: dict[str, Any]) -> None:
    """Find each system's smallest interval whose overhead is at most ``--overhead``, by
    training at it: a run saving at the interval against a run that never checkpoints, over
    the same number of steps (at least ``--verify-steps``, and ``--calibrate-saves`` saves),
    the two taking turns. The search starts at the estimate and moves in proportion to the
    measured overhead (``next_interval``), up while above the limit, down while well under it,
    until the smallest passing interval is within 10% of the largest failing one, or after
    ``--verify-tries`` intervals.

    The estimate times saves ``--calibrate-every`` steps apart and leaves out waits for the
    previous upload; at a shorter interval a save's background work can still be running at
    the next save, or compete with training for the cores. Only a run at the interval itself
    shows that, so the failure runs use the interval this phase ends with.

    The ``--calibrate-warmup`` saves that pay for fresh memory come first,
    ``--calibrate-every`` steps apart when they fit before the first save at the interval
    (``--also-save-at``); so a long interval is measured from its first save, not after two
    intervals of warm-up."""
    warm = args.calibrate_warmup
    for system in args.systems:
        chosen = calibration[system]
        interval: int | None = chosen["interval"]
        tries: list[dict[str, Any]] = []
        while interval is not None and len(tries) < args.verify_tries:
            saves = max(args.calibrate_saves, math.ceil(args.verify_steps / interval))
            early = [args.calibrate_every * k for k in range(1, warm + 1)]
            if early and early[-1] + args.calibrate_every <= interval:
                start, also = interval, ",".join(map(str, early))  # warm-up saves first
            else:
                start, also = interval * (warm + 1), ""
            end = start + interval * saves
            quiet = min(start, args.calibrate_every)  # the never-saving run's warm-up steps
            spans = {}
            for case in ("none", system):
                places.clear()
                wait_quiet(args)
                if case == "none":
                    first, how = quiet, ["--every", "0"]
                else:
                    first = start
                    how = ["--every", str(interval), "--staging", chosen["mode"]]
                    how += ["--also-save-at", also] if also else []
                last = first + (end - start)
                t = step_times(run_to_end(places, case, args, "--steps", str(last), *how))
                spans[case] = t[last] - t[first]
            overhead = spans[system] / spans["none"] - 1
            tries.append({"interval": interval, "steps": [start, end], "overhead": overhead})
            print(f"verify {system} every {interval}: overhead {overhead:.1%}", flush=True)
            interval = next_interval(tries, args.overhead)
        passed = [t["interval"] for t in tries if t["overhead"] <= args.overhead]
        chosen["estimated_interval"] = chosen["interval"]
        chosen["verified"] = tries
        if passed:
            chosen["interval"] = min(passed)
            chosen["measured_overhead"] = next(
                t["overhead"] for t in tries if t["interval"] == min(passed)
            )
        else:  # not measured at the last raise: said in the report
            print(f"{system}: above {args.overhead:.0%} after {len(tries)} tries", flush=True)
            chosen["interval"] = next_interval(tries, args.overhead, searching=False)
            chosen["measured_overhead"] = None


def next_interval(tries: list[dict[str, Any]], limit: float, searching: bool = True) -> int | None:
    """The next interval to measure, or None when the search is done: the last interval
    scaled by its overhead over the limit (overhead per save is roughly fixed, so the share
    of training it takes falls as 1/interval), kept strictly between the largest interval
    that failed and the smallest that passed. Done when no interval is left between them, or
    the candidate is within 10% of a passing interval (closer than the measurement's noise).
    ``searching=False``: the raise after the last failure, whatever the bracket."""
    passed = min((t["interval"] for t in tries if t["overhead"] <= limit), default=None)
    failed = max((t["interval"] for t in tries if t["overhead"] > limit), default=0)
    last = tries[-1]
    guess = last["interval"] * max(last["overhead"], 0.0) / limit
    if last["overhead"] > limit:
        candidate = max(last["interval"] + 1, math.ceil(guess))
    else:
        candidate = min(last["interval"] - 1, math.floor(guess))
    candidate = max(candidate, failed + 1, 1)
    if not searching:
        return candidate
    if passed is not None:
        candidate = min(candidate, passed - 1)
        if candidate <= failed or candidate >= 0.9 * passed:
            return None
    return candidate


# -- phase 2: time to first step -------------------------------------------------------------


def first_steps(places: Places, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds from process start to the end of the first training step."""
    places.clear()
    run_to_end(places, "tiers", args, "--steps", "2", "--every", "2")  # a checkpoint to restore
    local = places.shm / "local"
    kept = places.shm / "local-kept"  # the node-local copy, for the start whose node survived
    sparse_copy(local, kept)
    cases = {
        "fresh start, no checkpoint": ("none", ["--steps", "1", "--every", "0"]),
        # What a prefetch that cost nothing would leave: the checkpoint already in local memory.
        "LMDB restore, the node's store survived (nothing to fetch)": (
            "lmdb",
            ["--steps", "3", "--every", "0"],
        ),
        "Tiers restore on a new node, prefetch": ("tiers", ["--steps", "3", "--every", "0"]),
        "Tiers restore on a new node, no prefetch": (
            "tiers",
            ["--steps", "3", "--every", "0", "--no-prefetch"],
        ),
    }
    out: dict[str, list[float]] = {c: [] for c in cases}
    for rnd in range(args.repeats):
        names = list(cases)
        turn = rnd % len(names)
        for name in names[turn:] + names[:turn]:
            system, extra = cases[name]
            shutil.rmtree(local, ignore_errors=True)  # a new node
            if system == "lmdb":
                sparse_copy(kept, local)  # ... or the same node, its store intact
            wait_quiet(args)
            ev = run_to_end(places, system, args, *extra)
            start = next(e["process_start"] for e in ev if e["event"] == "start")
            first = min(e["t"] for e in ev if e["event"] == "loss")
            out[name].append(first - start)
            print(f"first step, {name}: {out[name][-1]:.2f} s", flush=True)
    return out


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy a store directory keeping its data file sparse: LMDB's file is as long as its map
    (several times the data), and a plain copy would allocate all of it."""
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)


# -- phase 3: failures -----------------------------------------------------------------------


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
    places: Places, system: str, interval: int, mode: str, args: argparse.Namespace
) -> dict[str, Any]:
    places.clear()
    wait_quiet(args)
    extra = ["--steps", str(args.steps), "--every", str(interval), "--staging", mode]
    if system == "tiers":
        extra += ["--wipe-on-restart", str(places.shm / "local")]
    launched = time.time()
    proc, events, log = launch(places, system, args, *extra)
    kills: list[float] = []
    for attempt, at in enumerate(args.kills):
        while time.time() < launched + at:
            time.sleep(0.01)
        # rank 0 of the running attempt (its start event names its pid)
        while True:
            starts = [e for e in events_of(events) if e["event"] == "start"]
            if starts and starts[-1]["attempt"] == attempt and alive(starts[-1]["pid"]):
                break
            if proc.poll() is not None:
                raise SystemExit(f"{system}: the job ended before kill {attempt + 1}")
            time.sleep(0.01)
        kills.append(time.time())
        os.kill(starts[-1]["pid"], signal.SIGKILL)
        if system == "dcp-disk":
            drop_page_cache()
    finish(proc, log, f"{system} with failures")
    ended = time.time()
    ev = events_of(events)
    failures = []
    for attempt, killed in enumerate(kills):
        before = [e for e in ev if e["event"] == "loss" and e["attempt"] == attempt]
        reached = max((e["step"] for e in before if e["t"] < killed), default=0)
        (ready,) = [e for e in ev if e["event"] == "ready" and e["attempt"] == attempt + 1]
        back = [
            e["t"]
            for e in ev
            if e["event"] == "loss" and e["attempt"] == attempt + 1 and e["step"] >= reached
        ]
        if not back:  # killed again before it got back: a schedule too tight for this job
            raise SystemExit(
                f"{system}: kill {attempt + 2} came before the job recovered from kill "
                f"{attempt + 1}; space --kills further apart"
            )
        resumed = [e for e in ev if e["event"] == "resume" and e["attempt"] == attempt + 1]
        failures.append(
            {
                "killed_at": killed - launched,
                "step_reached": reached,
                "resumed_from_step": ready["step"],
                "tier": resumed[0]["tier"] if resumed else None,
                "relaunch": ready["restore_start"] - killed,
                "restore": ready["restore_end"] - ready["restore_start"],
                "load": resumed[0]["load_seconds"] if resumed else 0.0,
                "recompute": min(back) - ready["restore_end"],
                "lost": min(back) - killed,
            }
        )
    saves = [e["blocking_seconds"] for e in ev if e["event"] == "save"]
    return {
        "interval": interval,
        "mode": mode,
        "seconds": ended - launched,
        "failures": failures,
        "blocking_median": statistics.median(saves) if saves else 0.0,
        "blocking_max": max(saves, default=0.0),
    }


def schedule(args: argparse.Namespace, calibration: dict[str, dict[str, Any]]) -> None:
    """Three kills, the same for every system, spaced by the longest interval's worth of steps
    plus 45 s (relaunch and restore), so that each system is back where it was before the next
    kill; and enough steps that the job is still training at the third."""
    step = calibration["none"]["step_seconds"]
    longest = max(calibration[s]["interval"] for s in args.systems)
    spacing = math.ceil(longest * step + 45)
    args.kills = [float(spacing * i) for i in (1, 2, 3)]
    args.steps = max(args.steps, math.ceil(3.5 * spacing / step))
    print(f"kills at {args.kills} s, {args.steps} steps", flush=True)


def busy_fraction(seconds: float = 1.0) -> float:
    """The share of CPU time the whole machine spent busy over ``seconds`` (/proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(args: argparse.Namespace) -> None:
    """Before a timed run: wait (up to a minute) until the machine is at most ``--max-busy``
    busy over a second, so a run is not disturbed by other work. The load average would lag
    behind the previous run of this benchmark by minutes."""
    deadline = time.time() + 60
    while (busy := busy_fraction()) > args.max_busy:
        if time.time() > deadline:
            print(f"machine still {busy:.0%} busy; going on", flush=True)
            return


# -- report ----------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    cal, runs, firsts = results["calibration"], results["failures"], results["first_step"]
    failure_free = results["failure_free_seconds"]

    def median(system: str, part: str) -> float:
        return statistics.median(f[part] for f in runs[system]["failures"])

    def expected(system: str) -> float:
        """Lost time with the recompute a failure at a random moment costs on average: half
        an interval of steps (three kills land where they land)."""
        step = cal["none"]["step_seconds"]
        return (
            median(system, "relaunch")
            + median(system, "restore")
            + runs[system]["interval"] / 2 * step
        )

    def versus(system: str, value: Any) -> str:
        if "dcp-disk" not in runs or not value("dcp-disk"):
            return "-"
        return f"{value(system) / value('dcp-disk'):.2f}"

    lines = [
        "| system | saves with | interval (steps) (estimate; measured overhead at each) | "
        "overhead per save (s) | overhead at the interval "
        "| blocking per save, median / max (s) | lost per failure, median / max (s) "
        "| relaunch / restore / recompute (s) | lost, expected (s) | dcp.load (s) "
        "| lost / DCP disk, measured / expected | dcp.load / DCP disk | goodput |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def measured(system: str) -> tuple[str, str]:
        c = cal[system]
        tried = ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in c.get("verified", []))
        overhead = c.get("measured_overhead")
        return (
            f"{c.get('estimated_interval', c['interval'])}; measured {tried or '-'}",
            "not measured" if overhead is None else f"{overhead:.1%}",
        )

    for system, r in runs.items():
        tried, overhead = measured(system)
        lost = versus(system, lambda s: median(s, "lost"))
        lost_expected = versus(system, expected)
        lines.append(
            f"| {NAMES[system]} | {MODES[r['mode']]} | {r['interval']} ({tried}) | "
            f"{cal[system]['overhead_per_save_seconds']:.2f} | {overhead} | "
            f"{r['blocking_median']:.3f} / {r['blocking_max']:.3f} | "
            f"{median(system, 'lost'):.1f} / {max(f['lost'] for f in r['failures']):.1f} | "
            f"{median(system, 'relaunch'):.1f} / "
            f"{median(system, 'restore'):.2f} / {median(system, 'recompute'):.1f} | "
            f"{expected(system):.1f} | {median(system, 'load'):.2f} | {lost} / {lost_expected} | "
            f"{versus(system, lambda s: median(s, 'load'))} | "
            f"{failure_free / r['seconds']:.2f} |"
        )
    lines += [
        "",
        "| system | saves with | overhead per save (s) | blocking per save, median / max (s) |",
        "|---|---|---|---|",
    ]
    for case, c in cal.items():
        if "/" in case:
            system, _, mode = case.partition("/")
            lines.append(
                f"| {NAMES[system]} | {MODES[mode]} | {c['overhead_per_save_seconds']:.2f} | "
                f"{c['blocking_median']:.3f} / {c['blocking_max']:.3f} |"
            )
    return "\n".join([*lines, "", first_step_table(firsts)])


def interval_table(cal: dict[str, Any], systems: list[str]) -> str:
    """Phase 1 alone: each system's mode, estimate, and the overhead at each interval tried."""
    return markdown_table(
        ("system", "saves with", "overhead per save (s)", "estimated interval", "measured"),
        (
            (
                NAMES[s],
                MODES[cal[s]["mode"]],
                f"{cal[s]['overhead_per_save_seconds']:.2f}",
                cal[s]["estimated_interval"],
                ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in cal[s]["verified"]),
            )
            for s in systems
        ),
    )


def first_step_table(firsts: dict[str, list[float]]) -> str:
    fresh = statistics.median(firsts["fresh start, no checkpoint"])
    return markdown_table(
        ("start", "time to first step (s), median / max", "/ fresh start"),
        (
            (name, f"{med:.2f} / {max(v):.2f}", f"{med / fresh:.2f}")
            for name, v in firsts.items()
            for med in [statistics.median(v)]
        ),
    )


def chart(results: dict[str, Any], path: Path) -> None:
    runs = results["failures"]
    names = [
        NAMES[s].split(",")[0] + ("" if "," not in NAMES[s] else "\n" + NAMES[s].split(", ", 1)[1])
        for s in runs
    ]
    parts = ["relaunch", "restore", "recompute"]
    shape = {"ncols": 2, "figsize": (12, 4.5), "gridspec_kw": {"width_ratios": [3, 1.2]}}
    with figure(path, **shape) as (_, (ax, gx)):
        bottom = [0.0] * len(runs)
        for part, colour in zip(parts, ["#999999", "#4477aa", "#ee6677"], strict=True):
            values = [statistics.median(f[part] for f in r["failures"]) for r in runs.values()]
            ax.barh(names, values, left=bottom, color=colour, label=part)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.invert_yaxis()
        ax.set_xlabel("training time lost per failure, median (s)")
        ax.legend(loc="upper right")
        goodput = [results["failure_free_seconds"] / r["seconds"] for r in runs.values()]
        gx.barh(names, goodput, color="#228833")
        gx.invert_yaxis()
        gx.set_yticklabels([])
        gx.set_xlim(0, 1)
        gx.set_xlabel("goodput")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1984)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=45, help="steps of each failure run (at least)")
    ap.add_argument(
        "--kills",
        default="auto",
        help="seconds after launch at which a rank is killed (comma-separated), or auto: three "
        "kills spaced so that every system recovers before the next, --steps raised to match",
    )
    ap.add_argument("--keep-last", type=int, default=1)
    ap.add_argument("--overhead", type=float, default=0.05)
    ap.add_argument("--calibrate-every", type=int, default=6)
    ap.add_argument("--calibrate-warmup", type=int, default=2, help="saves before the window")
    ap.add_argument("--calibrate-saves", type=int, default=3, help="saves in the window")
    ap.add_argument("--calibrate-rounds", type=int, default=1)
    ap.add_argument(
        "--verify-steps", type=int, default=24, help="steps each interval is checked over"
    )
    ap.add_argument(
        "--verify-tries", type=int, default=4, help="intervals tried per system, at most"
    )
    ap.add_argument(
        "--modes",
        default="background,sync",
        help="saving modes each system is measured in (examples/train_resume.py --staging); "
        "the failure runs use each system's cheapest",
    )
    ap.add_argument("--repeats", type=int, default=3, help="of each time-to-first-step case")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--max-busy", type=float, default=0.15)
    ap.add_argument("--disk-dir", default=None, help="a directory on disk (default: /tmp)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--from-json", help="only re-render the report of an earlier run's JSON")
    ap.add_argument(
        "--only-intervals",
        action="store_true",
        help="run phase 1 alone (each system's interval, estimated then measured at it) and "
        "print its table",
    )
    ap.add_argument(
        "--only-first-step",
        action="store_true",
        help="run phase 2 alone (time to first step) and print its table",
    )
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        machine = data.pop("machine")
        write_report(args.out, "goodput", table(data), machine, data)
        chart(data, Path(args.out) / "goodput.png")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the clean-up below runs
    if args.kills != "auto":
        args.kills = [float(k) for k in args.kills.split(",")]
    args.systems = args.systems.split(",")
    args.modes = args.modes.split(",")

    work = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-"))
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kvckpt-goodput-", dir=args.disk_dir))
    places = Places(work, shm, disk, RedisServer(work / "redis"))
    params = sum(p.numel() for p in model_for(args.width, args.layers).parameters())
    state_gib = params * 4 * 3 / 2**30  # weights + AdamW's two moments, fp32
    results: dict[str, Any] = {}
    try:
        if args.only_first_step:
            results["first_step"] = first_steps(places, args)
            print(first_step_table(results["first_step"]))
            return
        results["calibration"] = calibrate(places, args)
        verify(places, args, results["calibration"])
        if args.only_intervals:
            print(interval_table(results["calibration"], args.systems))
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "intervals.json").write_text(json.dumps(results, indent=1))
            return
        if args.kills == "auto":
            schedule(args, results["calibration"])
        results["first_step"] = first_steps(places, args)
        places.clear()
        wait_quiet(args)
        free = run_to_end(places, "none", args, "--steps", str(args.steps), "--every", "0")
        start = next(e["process_start"] for e in free if e["event"] == "start")
        done = next(e["t"] for e in free if e["event"] == "done")
        results["failure_free_seconds"] = done - start
        results["failures"] = {}
        for system in args.systems:
            chosen = results["calibration"][system]
            results["failures"][system] = with_failures(
                places, system, chosen["interval"], chosen["mode"], args
            )
            print(f"{system}: {results['failures'][system]}", flush=True)
    finally:
        places.server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        print(f"logs in {work}", flush=True)

    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; 2 ranks, DDP, gloo; {params / 1e6:.0f}M parameters, "
        f"{state_gib:.2f} GiB of checkpointed state (weights + AdamW); {args.steps} steps, "
        f"kills at {', '.join(f'{k:g}' for k in args.kills)} s; failure-free time "
        f"{results['failure_free_seconds']:.1f} s; medians"
    )
    text = table(results)
    write_report(args.out, "goodput", text, machine, {"args": vars(args), **results})
    chart(results, Path(args.out) / "goodput.png")


if __name__ == "__main__":
    main()
