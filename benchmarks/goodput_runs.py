"""How ``benchmarks/goodput.py`` runs ``examples/train_resume.py``: the systems and economies
compared, where each keeps its checkpoints, launching a run and reading the events it logs,
and waiting for a quiet machine between runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


NONE_STEPS: dict[str, list[Any]] = {}
FRESH = "fresh start, no checkpoint"
PREFETCH = "Tiers restore on a new node, prefetch()"
FORCED = "Tiers restore on a new node, prefetch(force=True)"
NO_PREFETCH = "Tiers restore on a new node, no prefetch"
#: What a prefetch that cost nothing would leave: the checkpoint already in local memory.
SURVIVED = "LMDB restore, the node's store survived (nothing to fetch)"


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
