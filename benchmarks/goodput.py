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
import contextlib
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
from collections import Counter
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
SYSTEMS = ["dcp-disk", "dcp-shm", "lmdb", "redis", "tiers", "tiers-peers"]
#: the systems whose killed node is replaced (its store deleted at the restart)
REPLACED = ("tiers", "tiers-peers")
NAMES = {
    "none": "no checkpoints",
    "dcp-disk": "DCP FileSystemWriter, disk (cold cache after a kill)",
    "dcp-shm": "DCP FileSystemWriter, /dev/shm",
    "lmdb": "kvckpt LMDB, /dev/shm",
    "redis": "kvckpt Redis",
    "tiers": "kvckpt Tiers, local store wiped (node replaced)",
    "tiers-peers": "kvckpt Tiers(peers=1), a host per rank, the killed host's store wiped",
}
SHORT = {
    "dcp-disk": "DCP disk, cold cache",
    "dcp-shm": "DCP /dev/shm",
    "lmdb": "kvckpt LMDB",
    "redis": "kvckpt Redis",
    "tiers": "kvckpt Tiers, node replaced",
    "tiers-peers": "kvckpt Tiers(peers=1), node replaced",
}
MODES = {
    "background": "async_save, kvckpt.background_stager()",
    "sync": "dcp.save",
    "blocking": "async_save, DCP's default staging",
}


@dataclass
class Economy:
    """What trains, as ``examples/train_resume.py`` arguments, and how it is labelled."""

    name: str
    label: str
    train_args: list[str]
    modes: list[str]
    nproc: int = 2
    state_gib: float = 0.0


def economies(args: argparse.Namespace) -> dict[str, Economy]:
    width, layers = args.cpu_width, args.cpu_layers
    params = sum(p.numel() for p in model_for(width, layers).parameters())
    cpu_gib = params * 4 * 3 / 2**30  # weights + AdamW's two moments, fp32, on every rank
    cuda_gib = args.cuda_layers * 12 * args.cuda_width**2 * 4 * 3 / 2**30  # about
    return {
        "accel": Economy(
            "accel",
            f"accel (simulated): 2 ranks, {args.accel_state_gib:g} GiB of state each, "
            f"{args.accel_step_seconds:g} s steps off the host's cores",
            [
                *("--economy", "accel", "--state-gib", str(args.accel_state_gib)),
                *("--step-seconds", str(args.accel_step_seconds)),
            ],
            args.accel_modes.split(","),
            state_gib=args.accel_state_gib,
        ),
        "cpu": Economy(
            "cpu",
            f"cpu: 2 ranks of DDP + AdamW on the host's cores, {params / 1e6:.0f}M parameters, "
            f"{cpu_gib:.2f} GiB of state on each rank (replicated)",
            ["--width", str(width), "--layers", str(layers), "--batch", str(args.cpu_batch)],
            args.cpu_modes.split(","),
            state_gib=cpu_gib,
        ),
        "cuda": Economy(
            "cuda",
            f"cuda: a transformer ({args.cuda_layers} layers, width {args.cuda_width}) trained "
            f"on one GPU, about {cuda_gib:.2f} GiB of state",
            [
                *("--economy", "cuda", "--width", str(args.cuda_width)),
                *("--layers", str(args.cuda_layers), "--batch", str(args.cuda_batch)),
            ],
            args.accel_modes.split(","),
            nproc=1,
            state_gib=cuda_gib,
        ),
    }


@dataclass
class Places:
    """Where each system keeps its checkpoints; ``clear()`` empties them all."""

    work: Path
    shm: Path
    disk: Path
    server: RedisServer
    runs: int = 0
    peers_shared_every: int = 10

    def store_args(self, system: str) -> list[str]:
        local = self.shm / "local"
        return {
            "none": ["--store", f"dcp:{self.shm / 'unused'}"],
            "dcp-disk": ["--store", f"dcp:{self.disk / 'dcp'}"],
            "dcp-shm": ["--store", f"dcp:{self.shm / 'dcp'}"],
            "lmdb": ["--store", f"lmdb://{local}"],
            "redis": ["--store", self.server.url()],
            "tiers": ["--store", f"lmdb://{local}", "--store", self.server.url()],
            # two simulated hosts, one a rank, each its own store; every N-th save to Redis
            "tiers-peers": [
                *("--store", f"lmdb://{local}/host{{rank}}", "--store", self.server.url()),
                *("--peers", "1", "--shared-every", str(self.peers_shared_every)),
                "--host-per-rank",
            ],
        }[system]

    def clear(self) -> None:
        self.server.client().flushall()
        for path in (self.shm, self.disk):
            for child in path.iterdir():
                shutil.rmtree(child, ignore_errors=True)


def events_of(path: Path) -> list[dict[str, Any]]:
    """The job's events so far. Whatever follows the last newline is a line still being
    written, left for the next read. A line that does not parse is one a kill cut short (the
    next attempt's first event then continues it on the same line): the cut part is dropped."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().split("\n")[:-1]:
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line[max(0, line.rfind('{"attempt"')) :]))
    return events


def launch(
    places: Places, econ: Economy, system: str, args: argparse.Namespace, *extra: str
) -> tuple:
    places.runs += 1
    events = places.work / f"events-{places.runs}.jsonl"
    cmd = torchrun_command(
        EXAMPLE,
        *places.store_args(system),
        *econ.train_args,
        "--keep-last",
        str(args.keep_last),
        "--events",
        str(events),
        *extra,
        nproc=econ.nproc,
        max_restarts=len(args.kills) if args.kills != "auto" else 3,
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


def run_to_end(
    places: Places, econ: Economy, system: str, args: argparse.Namespace, *extra: str
) -> list[dict]:
    proc, events, log = launch(places, econ, system, args, *extra)
    finish(proc, log, f"{econ.name} {system} {' '.join(extra)}")
    return events_of(events)


def step_times(events: list[dict]) -> dict[int, float]:
    """The wall time each step was (last) completed."""
    return {e["step"]: e["t"] for e in events if e["event"] == "loss"}


# -- phase 1: the interval -------------------------------------------------------------------


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


def warm_up(args: argparse.Namespace) -> tuple[list[int], int]:
    """The steps of the warm-up saves that come before every measured window, and the first
    step the window's saves may fall on. The warm-up's staging copy and store pages are fresh
    memory, paid once per process (staging) or once per store (LMDB's pages, which a restarted
    job on the same node keeps; a Redis server's): ``--calibrate-warmup`` saves, one step
    apart, since what they pay for does not depend on their spacing. The window starts
    ``--calibrate-every`` steps after the last of them, as far as the window's saves are from
    each other, so that its background work is done."""
    early = list(range(1, args.calibrate_warmup + 1))
    return early, len(early) + args.calibrate_every


#: Steps a ``tiers`` check runs on, for the shared tier's first copies (``steady_start``).
SETTLE_STEPS = 10


def copies(ev: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """The copies a replaced node of ``system`` restores from: into the shared tier for
    ``tiers``, into the peers' stores for ``tiers-peers``."""
    peers = system == "tiers-peers"
    return [e for e in ev if e["event"] == "copied" and (e.get("tier") == "peers") == peers]


def steady_start(
    copied_events: list[dict[str, Any]],
    ev: list[dict[str, Any]],
    start: int,
    interval: int,
    latest: int,
    keep_last: int,
) -> int:
    """The first step at the interval, from ``start`` and at most ``latest``, after the store
    a replaced node restores from committed its ``keep_last`` + 1-th copy: the memory it holds
    for the kept copy and the one being written is then no longer fresh."""
    copied = sorted(e["t"] for e in copied_events)
    if len(copied) <= keep_last:
        return start
    t = step_times(ev)
    settled = min((s for s in t if t[s] >= copied[keep_last]), default=latest)
    at = max(start, interval * math.ceil(settled / interval))
    return at if at <= latest else max(start, interval * (latest // interval))


def _well_under(tries: list[dict[str, Any]], args: argparse.Namespace) -> bool:
    """Whether to go on measuring after a first check that came in under half the limit (the
    estimate was high): down, and once more between, three checks at most."""
    return args.verify_tries > 0 and len(tries) < 3 and tries[0]["overhead"] < args.overhead / 2


def none_step(places: Places, econ: Economy, args: argparse.Namespace) -> float:
    """Seconds per step of the run that never checkpoints, over ``--verify-steps`` steps after
    ``--calibrate-every`` of warm-up; measured at the first check of an economy and again at
    every third, so that the checks take turns with it. The median of those measured."""
    calls, measured = _NONE_STEPS.setdefault(econ.name, [0, []])
    _NONE_STEPS[econ.name][0] += 1
    if calls % 3 == 0:
        places.clear()
        wait_quiet(args)
        first, last = args.calibrate_every, args.calibrate_every + args.verify_steps
        t = step_times(run_to_end(places, econ, "none", args, "--steps", str(last), "--every", "0"))
        measured.append((t[last] - t[first]) / (last - first))
    return statistics.median(measured)


_NONE_STEPS: dict[str, list[Any]] = {}


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


# -- phase 2: time to first step -------------------------------------------------------------

FRESH = "fresh start, no checkpoint"
PREFETCH = "Tiers restore on a new node, prefetch()"
FORCED = "Tiers restore on a new node, prefetch(force=True)"
NO_PREFETCH = "Tiers restore on a new node, no prefetch"
#: What a prefetch that cost nothing would leave: the checkpoint already in local memory.
SURVIVED = "LMDB restore, the node's store survived (nothing to fetch)"


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
        kills.append(time.time())
        os.kill(starts[-1]["pid"], signal.SIGKILL)
        done = [e for e in ev if e["event"] == "loss" and e["attempt"] == attempt]
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
    busy over half a second, so a run is not disturbed by other work. The load average would
    lag behind the previous run of this benchmark by minutes."""
    deadline = time.time() + 60
    while (busy := busy_fraction(0.5)) > args.max_busy:
        if time.time() > deadline:
            print(f"machine still {busy:.0%} busy; going on", flush=True)
            return


# -- report ----------------------------------------------------------------------------------


def summary(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per system: medians of each part of a failure, the expected loss, the checkpoint-
    attributable loss and goodput (``lost``, ``expected``, ``attributable`` in seconds)."""
    cal, runs = results["calibration"], results["failures"]
    step = cal["none"]["step_seconds"]
    base = statistics.median(f["relaunch"] for f in results["relaunch_alone"]["failures"])
    out = {}
    for system, r in runs.items():
        parts = {
            part: statistics.median(f[part] for f in r["failures"])
            for part in ("relaunch", "restore", "recompute", "lost", "load")
        }
        # A replaced node restores what the shared tier holds: a save there is on average half
        # an interval old when the kill comes, plus the time its copy took to commit there.
        recompute = r["interval"] / 2 * step + (r.get("copy_lag_median") or 0.0)
        out[system] = {
            **parts,
            "lost_max": max(f["lost"] for f in r["failures"]),
            "expected": parts["relaunch"] + parts["restore"] + recompute,
            "attributable": parts["relaunch"] - base + parts["restore"] + recompute,
            "added_to_relaunch": parts["relaunch"] - base,
            "goodput": r.get("failure_free_seconds", results.get("failure_free_seconds", 0))
            / r["seconds"],
        }
    return out


def table(results: dict[str, Any]) -> str:
    cal, runs = results["calibration"], results["failures"]
    sums = summary(results)

    def versus(system: str, key: str) -> str:
        if "dcp-disk" not in sums or not sums["dcp-disk"][key]:
            return "-"
        return f"{sums[system][key] / sums['dcp-disk'][key]:.2f}"

    def measured(system: str) -> tuple[str, str]:
        c = cal[system]
        tried = ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in c.get("verified", []))
        overhead = c.get("measured_overhead")
        return (
            f"{c.get('estimated_interval', c['interval'])}; measured {tried or '-'}",
            "not measured" if overhead is None else f"{overhead:.1%}",
        )

    rows = []
    for system, r in runs.items():
        s = sums[system]
        tried, overhead = measured(system)
        rows.append(
            (
                NAMES[system],
                MODES[r["mode"]],
                f"{r['interval']} ({tried})",
                f"{cal[system]['overhead_per_save_seconds']:.2f}",
                overhead,
                f"{r['blocking_median']:.3f} / {r['blocking_max']:.3f}",
                f"{s['lost']:.1f} / {s['lost_max']:.1f}",
                f"{s['relaunch']:.1f} / {s['restore']:.2f} / {s['recompute']:.1f}",
                f"{s['expected']:.1f}",
                f"{s['attributable']:.1f}",
                f"{versus(system, 'lost')} / {versus(system, 'expected')} / "
                f"{versus(system, 'attributable')}",
                f"{s['load']:.2f}",
                f"{s['goodput']:.2f}",
            )
        )
    main = markdown_table(
        (
            "system",
            "saves with",
            "interval (steps) (estimate; measured overhead at each)",
            "overhead per save (s)",
            "overhead at the interval",
            "blocking per save, median / max (s)",
            "lost per failure, median / max (s)",
            "relaunch / restore / recompute (s)",
            "lost, expected (s)",
            "checkpoint-attributable, expected (s)",
            "/ DCP disk: lost / expected / attributable",
            "dcp.load (s)",
            "goodput",
        ),
        rows,
    )
    modes = markdown_table(
        (
            "system",
            "saves with",
            "overhead per save (s)",
            "in flight per save (s)",
            "blocking per save, median / max (s)",
        ),
        (
            (
                NAMES[case.partition("/")[0]],
                MODES[case.partition("/")[2]],
                f"{c['overhead_per_save_seconds']:.2f}",
                f"{c.get('in_flight_seconds', float('nan')):.2f}",
                f"{c['blocking_median']:.3f} / {c['blocking_max']:.3f}",
            )
            for case, c in cal.items()
            if "/" in case
        ),
    )
    base = statistics.median(f["relaunch"] for f in results["relaunch_alone"]["failures"])
    lags = [
        f"{NAMES[system]}: {r['copies']} of {r['saves']} saves reached "
        f"{'the peers' if system == 'tiers-peers' else 'the shared tier'}, "
        f"{r['copy_lag_median']:.1f} s after their step (median; max {r['copy_lag_max']:.1f} s); "
        f"a replaced node resumed "
        f"{statistics.median(f['step_reached'] - f['resumed_from_step'] for f in r['failures']):g}"
        " steps behind the step it had reached (median)."
        for system, r in runs.items()
        if r.get("copy_lag_median") is not None
    ]
    return "\n\n".join(
        [
            f"**{results['label']}**",
            main,
            *lags,
            f"Relaunch of the job that never checkpoints (the part no system can avoid): "
            f"{base:.2f} s, median of {len(results['relaunch_alone']['failures'])}. Kills, "
            "seconds after launch (each due an interval plus the slowest restart after the "
            "one before, and made once the job was back with a newer save committed and, "
            "where the store it restores from had fresh memory, steady): "
            + "; ".join(
                f"{NAMES.get(s, s)} "
                + ", ".join(f"{f['killed_at']:.0f}" for f in r.get("failures", []))
                for s, r in runs.items()
            )
            + ".",
            modes,
            first_step_table(results["first_step"]),
        ]
    )


def side_by_side(all_results: dict[str, Any]) -> str:
    """The headline: each system in each economy, expected loss and checkpoint-attributable
    loss per failure, and the ratio to DCP on disk with a cold cache."""
    names = list(all_results)
    sums = {e: summary(r) for e, r in all_results.items()}
    systems = list(dict.fromkeys(s for r in all_results.values() for s in r["failures"]))

    def cell(e: str, system: str) -> str:
        s, d = sums[e].get(system), sums[e].get("dcp-disk")
        if s is None:
            return "-"
        r = all_results[e]["failures"][system]["interval"]
        ratio = (
            f" ({s['expected'] / d['expected']:.2f}x; {s['attributable'] / d['attributable']:.2f}x)"
            if d and system != "dcp-disk" and d["attributable"] > 0
            else ""
        )
        return (
            f"every {r}; {s['expected']:.1f} s / {s['attributable']:.1f} s{ratio}; "
            f"goodput {s['goodput']:.2f}"
        )

    return markdown_table(
        ("system", *(f"{e}: interval; lost expected / checkpoint-attributable" for e in names)),
        ((SHORT[system], *(cell(e, system) for e in names)) for system in systems),
    )


def first_step_table(firsts: dict[str, list[float]]) -> str:
    fresh = statistics.median(firsts[FRESH])
    return markdown_table(
        ("start", "time to first step (s), median / max", "/ fresh start"),
        (
            (name, f"{med:.2f} / {max(v):.2f}", f"{med / fresh:.2f}")
            for name, v in firsts.items()
            for med in [statistics.median(v)]
        ),
    )


def interval_table(cal: dict[str, Any], systems: list[str]) -> str:
    """Phase 1 alone: each system's mode, estimate, and the overhead at each interval tried."""
    return markdown_table(
        (
            "system",
            "saves with",
            "overhead per save (s)",
            "in flight (s)",
            "estimated interval",
            "measured",
        ),
        (
            (
                NAMES[s],
                MODES[cal[s]["mode"]],
                f"{cal[s]['overhead_per_save_seconds']:.2f}",
                f"{cal[s].get('in_flight_seconds', float('nan')):.2f}",
                cal[s]["estimated_interval"],
                ", ".join(f"{v['interval']}: {v['overhead']:.1%}" for v in cal[s]["verified"]),
            )
            for s in systems
        ),
    )


def chart(all_results: dict[str, Any], path: Path) -> None:
    rows = len(all_results)
    shape = {"nrows": rows, "ncols": 2, "figsize": (12, 3.6 * rows), "squeeze": False}
    shape["gridspec_kw"] = {"width_ratios": [3, 1.2]}
    with figure(path, **shape) as (_, axes):
        for (ax, gx), (economy, results) in zip(axes, all_results.items(), strict=True):
            sums = summary(results)
            names = [SHORT[s] for s in sums]
            parts = ["relaunch", "restore", "recompute"]
            bottom = [0.0] * len(sums)
            for part, colour in zip(parts, ["#999999", "#4477aa", "#ee6677"], strict=True):
                values = [s[part] for s in sums.values()]
                ax.barh(names, values, left=bottom, color=colour, label=part)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.invert_yaxis()
            ax.set_title(f"{economy}: training time lost per failure, median (s)", fontsize=10)
            ax.legend(loc="lower right")
            gx.barh(names, [s["goodput"] for s in sums.values()], color="#228833")
            gx.invert_yaxis()
            gx.set_yticklabels([])
            gx.set_xlim(0, 1)
            gx.set_title("goodput", fontsize=10)


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
    per_step = statistics.median(_NONE_STEPS.get(econ.name, [0, []])[1] or [0.0]) or step

    def run(system: str, interval: int, mode: str) -> dict[str, Any]:
        args.steps = given[1]  # each system's schedule from the given minimum, not the last's
        if given[0] == "auto":
            args.kills, args.steps = schedule(args, interval, step, results["first_step"])
        else:  # enough steps that the job still trains at the last kill (at least --steps)
            args.kills = given[0]
            args.steps = max(given[1], math.ceil((max(args.kills) + 10) * 1.5 / step))
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


def main() -> None:
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
    args = ap.parse_args()
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


def report(results: dict[str, Any]) -> str:
    return "\n\n".join([side_by_side(results), *(table(r) for r in results.values())])


if __name__ == "__main__":
    main()
