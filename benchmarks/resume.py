"""Time to resume after a rank dies, and training time lost to checkpointing, per store.

Runs ``examples/train_resume.py`` under ``torchrun`` (2 ranks, gloo, CPU) once per store and
repeat: a rank is SIGKILLed mid-run, torchrun restarts the job, the job restores the newest
checkpoint and trains on. From the example's events it takes

- **time to resume**: from the restarted process's start (before ``import torch``) to the end
  of its first training step after the restore; and the restore (``dcp.load``) alone;
- **blocking time per save**: how long ``dcp.async_save`` (plus waiting for the previous save)
  holds up the training loop.

Stores, all in the same run: kvckpt LMDB on /dev/shm, kvckpt Redis (a local redis-server),
kvckpt tiered with the node's local store lost before the restart (so the restore comes from
Redis), and DCP's ``FileSystemWriter`` on disk and on /dev/shm. Medians of ``--repeats``.

    python benchmarks/resume.py --width 1024 --layers 4 --repeats 3 --out docs/benchmark
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import write_report  # noqa: E402

from examples.train_resume import model_for  # noqa: E402
from kvckpt.testing import RedisServer, torchrun_command  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_resume.py"


def one_run(store_args: list[str], events: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = torchrun_command(
        EXAMPLE,
        *store_args,
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--kill-at-step",
        str(args.kill_at),
        "--events",
        str(events),
        max_restarts=1,
    )
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    if done.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    log = [json.loads(line) for line in events.read_text().splitlines()]
    (resume,) = [e for e in log if e["event"] == "resume"]
    blocking = [e["blocking_seconds"] for e in log if e["event"] == "save"]
    return {
        "seconds_to_first_step": resume["seconds_to_first_step"],
        "restore_seconds": resume["restore_seconds"],
        "load_seconds": resume["load_seconds"],
        "blocking_seconds_per_save": statistics.median(blocking),
        "waiting_seconds_per_save": statistics.median(
            e["waiting_for_previous_seconds"] for e in log if e["event"] == "save"
        ),
        "resumed_from_tier": resume["tier"] if resume["tier"] is not None else -1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk-dir", default=None, help="a directory on disk (default: /tmp)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvckpt-resume-"))
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-resume-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="kvckpt-resume-", dir=args.disk_dir))
    server = RedisServer(work / "redis")
    params = sum(p.numel() for p in model_for(args.width, args.layers).parameters())
    state_mib = params * 4 * 3 / 2**20  # weights + AdamW's two moments, fp32
    results: dict[str, list[dict[str, float]]] = {}
    try:
        for rep in range(args.repeats):
            cases = {
                "DCP FileSystemWriter, disk": ["--store", f"dcp:{disk / f'dcp{rep}'}"],
                "DCP FileSystemWriter, /dev/shm": ["--store", f"dcp:{shm / f'dcp{rep}'}"],
                "kvckpt LMDB, /dev/shm": ["--store", f"lmdb://{shm / f'lmdb{rep}'}"],
                "kvckpt Redis": ["--store", server.url(prefix=f"r{rep}")],
                "kvckpt tiered, local lost -> Redis": [
                    "--store",
                    f"lmdb://{shm / f'tier{rep}'}",
                    "--store",
                    server.url(prefix=f"t{rep}"),
                    "--wipe-on-restart",
                    str(shm / f"tier{rep}"),
                ],
            }
            for name, store_args in cases.items():
                events = work / f"{list(cases).index(name)}-{rep}.jsonl"
                results.setdefault(name, []).append(one_run(store_args, events, args))
                print(f"{name} #{rep}: {results[name][-1]}", flush=True)
                server.client().flushall()
                for path in (shm, disk):  # keep /dev/shm free between cases
                    for child in path.iterdir():
                        shutil.rmtree(child, ignore_errors=True)
    finally:
        server.stop()
        for path in (work, shm, disk):
            shutil.rmtree(path, ignore_errors=True)

    summary = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for name, runs in results.items()
    }
    base = summary["DCP FileSystemWriter, /dev/shm"]
    lines = [
        "| store | time to resume (s) | restore (s) | dcp.load (s) | dcp.load / DCP shm "
        "| blocking per save (s) | of which waiting for the previous save (s) "
        "| blocking / DCP shm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['seconds_to_first_step']:.2f} | {s['restore_seconds']:.3f} | "
            f"{s['load_seconds']:.3f} | {s['load_seconds'] / base['load_seconds']:.2f} | "
            f"{s['blocking_seconds_per_save']:.3f} | {s['waiting_seconds_per_save']:.3f} | "
            f"{s['blocking_seconds_per_save'] / base['blocking_seconds_per_save']:.2f} |"
        )
    table = "\n".join(lines)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}; model: {params / 1e6:.1f}M parameters, about "
        f"{state_mib:.0f} MiB of checkpointed state; medians of {args.repeats}"
    )
    write_report(
        args.out,
        "resume",
        table,
        machine,
        {"args": vars(args), "summary": summary, "runs": results},
    )


if __name__ == "__main__":
    main()
