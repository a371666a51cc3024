"""What a training job sees: a new store, the same state dict saved again and again.

    python benchmarks/job.py --out docs/benchmark        # 512 MiB, 12 saves, keep_last 2 and 1
    python benchmarks/job.py --size-mib 16 --saves 4 --gap 0 --out /tmp/job   # smoke run (CI)

Every system starts with a new store and saves the same state dict ``--saves`` times, keeping
the last ``keep_last`` checkpoints (kvckpt's ``keep_last=``; DCP's directories are deleted
``keep_last`` back, as a job's own retention would). The systems take turns save by save, and
after each save the process sleeps ``--gap`` seconds: the training steps between two saves,
during which a GPU job leaves the host's cores idle and a store may get ready for the next save
(kvckpt's LMDB engine faults in the next save's pages then, and Redis makes the spares the
next save writes into). A job starts as kvckpt's docs recommend: ``get_ready(state_dict)`` on
the LMDB and Redis writers and on ``Tiers``, then ``--gap`` seconds for the steps before the
first checkpoint, for every system. Systems: kvckpt LMDB on /dev/shm,
kvckpt Redis (a new redis-server), kvckpt ``Tiers`` (LMDB then Redis; the save returns when the
local commit does, the copy runs in the gap), a raw-socket pipelined SET of the same bytes into
the same kind of server (the floor for any Redis client), and DCP ``FileSystemWriter`` on
/dev/shm with one and two writer threads.

Reported per system: each save's GB/s, the first three saves, p50, p90 and the slowest (the
saves a job feels), and the steady save (the median from the fifth on). Before the jobs, the
first save into a new store is timed on its own, ``--first-rounds`` times, kvckpt LMDB (with no
notice, and after ``get_ready`` at the start of the job) taking turns with DCP t=1 and t=2 (in a
job each system's first save is a single sample, taken in a fixed order); ``--only-first`` runs
just that. A system's background work is let finish inside its own gap, so it never runs
during another system's timed save. Writes job.json and job.md to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baselines import RawRedis
from report import cpu_name, markdown_table, write_report
from timing import p90
from workload import MIB, make_state_dict, nbytes, tensor_parts

import kvckpt
from kvckpt import KVStorageWriter
from kvckpt.engines._redis_spares import wait_ahead
from kvckpt.engines.lmdb import _SharedEnv, close_idle_environments
from kvckpt.testing import RedisServer

SYSTEMS = ["kvckpt LMDB", "kvckpt Redis", "kvckpt Tiers", "raw-socket SET", "DCP t=1", "DCP t=2"]


class Job:
    """One system's job: ``save(i)`` writes save number ``i`` and applies the retention."""

    def __init__(self, name: str, keep: int, base: Path, sd: dict[str, torch.Tensor]) -> None:
        self.name, self.keep, self.base, self.sd = name, keep, base, sd
        self.server: RedisServer | None = None
        self.tiers: kvckpt.Tiers | None = None
        self.dirs: list[Path] = []
        self.raw_keys: list[list[bytes]] = []
        if "Redis" in name or "Tiers" in name or "SET" in name:
            self.server = RedisServer(Path(tempfile.mkdtemp(prefix="kvckpt-job-redis-")))
        if name == "kvckpt Tiers":
            assert self.server is not None
            self.tiers = kvckpt.Tiers([f"lmdb://{base}/tiers", self.server.url()], keep_last=keep)
        if name == "raw-socket SET":
            assert self.server is not None
            self.raw = RawRedis(self.server.port)
        # kvckpt's recommended start of a job: get the store ready for the saves to come while
        # the steps before the first checkpoint run
        if name == "kvckpt LMDB":
            KVStorageWriter(f"lmdb://{base}/lmdb", keep_last=keep).get_ready(sd)
        if name == "kvckpt Redis":
            assert self.server is not None
            KVStorageWriter(self.server.url(), keep_last=keep).get_ready(sd)
        if self.tiers is not None:
            self.tiers.get_ready(sd)

    def save(self, i: int) -> None:
        sd, keep = self.sd, self.keep
        if self.name == "kvckpt LMDB":
            url = f"lmdb://{self.base}/lmdb"
            dcp.save(sd, storage_writer=KVStorageWriter(url, keep_last=keep), checkpoint_id=f"s{i}")
        elif self.name == "kvckpt Redis":
            assert self.server is not None
            writer = KVStorageWriter(self.server.url(), keep_last=keep)
            dcp.save(sd, storage_writer=writer, checkpoint_id=f"s{i}")
        elif self.name == "kvckpt Tiers":
            assert self.tiers is not None
            dcp.save(sd, storage_writer=self.tiers.writer(), checkpoint_id=f"s{i}")
        elif self.name == "raw-socket SET":
            items = [(b"s%d/" % i + k, v) for k, v in tensor_parts(sd, 1 << 30)]
            self.raw.set_many(items)
            self.raw_keys.append([k for k, _ in items])
            for old in self.raw_keys[:-keep]:
                for k in old:
                    self.raw.sock.sendall(b"*2\r\n$3\r\nDEL\r\n$%d\r\n%s\r\n" % (len(k), k))
                for _ in old:
                    self.raw._line()
            del self.raw_keys[:-keep]
        else:
            threads = int(self.name[-1])
            self.dirs.append(self.base / f"dcp{threads}-{i}")
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(self.dirs[-1], thread_count=threads))
            for old in self.dirs[:-keep]:
                shutil.rmtree(old)
            del self.dirs[:-keep]

    def close(self) -> None:
        if self.tiers is not None:
            self.tiers.wait()
            self.tiers.close()
        if self.server is not None:
            self.server.stop()
        close_idle_environments()


def settle(job: Job | None = None) -> None:
    """Let a system's background work (Tiers' copy, LMDB's fault-in of the next save's pages,
    the spares Redis makes ahead of the next save) finish inside its own gap, so that it never
    runs during another system's timed save."""
    if job is not None and job.tiers is not None:
        job.tiers.wait()
    wait_ahead()
    for shared in list(_SharedEnv._envs.values()):
        if shared.populator is not None:
            shared.populator.join()


READY = "kvckpt LMDB, get_ready at job start"


def first_saves(sd: dict[str, torch.Tensor], rounds: int, scratch: Path) -> dict[str, list[float]]:
    """The first save into a new store, taking turns: kvckpt LMDB, with no notice and after
    ``KVStorageWriter.get_ready(state_dict)`` at the start of the job (its background work let
    finish first, as the training steps before the first checkpoint would), against DCP t=1
    and t=2."""
    cases = ["kvckpt LMDB", READY, "DCP t=1", "DCP t=2"]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in cases[r % len(cases) :] + cases[: r % len(cases)]:
            where = scratch / f"first-{r}-{name.replace(' ', '_').replace(',', '')}"
            gc.collect()
            writer = None
            if name == READY:
                writer = KVStorageWriter(f"lmdb://{where}", keep_last=2)
                writer.get_ready(sd)
                settle()
            t0 = time.perf_counter()
            if writer is not None:
                dcp.save(sd, storage_writer=writer, checkpoint_id="c")
            elif name == "kvckpt LMDB":
                dcp.save(sd, storage_writer=KVStorageWriter(f"lmdb://{where}"), checkpoint_id="c")
            else:
                writer = dcp.FileSystemWriter(where, thread_count=int(name[-1]))
                dcp.save(sd, storage_writer=writer)
            times[name].append(time.perf_counter() - t0)
            settle()
            close_idle_environments()
            shutil.rmtree(where)
    return times


def run_scenario(
    sd: dict[str, torch.Tensor], keep: int, saves: int, gap: float, scratch: Path
) -> dict[str, Any]:
    size = nbytes(sd)
    jobs = {}
    for name in SYSTEMS:
        base = scratch / f"{name.replace(' ', '_')}-keep{keep}"
        base.mkdir()
        jobs[name] = Job(name, keep, base, sd)
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    overrun: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    loads: list[float] = []
    try:
        time.sleep(gap)  # the steps before the first checkpoint
        for job in jobs.values():
            settle(job)
        for i in range(saves):
            order = SYSTEMS[i % len(SYSTEMS) :] + SYSTEMS[: i % len(SYSTEMS)]
            for name in order:
                gc.collect()
                loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
                t0 = time.perf_counter()
                jobs[name].save(i)
                times[name].append(time.perf_counter() - t0)
                time.sleep(gap)
                t1 = time.perf_counter()
                settle(jobs[name])
                # background work the gap did not hold: the idle time this system assumed
                overrun[name].append(time.perf_counter() - t1)
            print(
                f"  keep_last={keep} save {i}: "
                + "  ".join(f"{n} {size / times[n][-1] / 1e9:.2f}" for n in SYSTEMS),
                flush=True,
            )
    finally:
        for job in jobs.values():
            job.close()
    out: dict[str, Any] = {"keep_last": keep, "loadavg_max": max(loads), "systems": {}}
    for name, ts in times.items():
        out["systems"][name] = {
            "times_s": ts,
            "gbps": [size / t / 1e9 for t in ts],
            "p50_s": statistics.median(ts),
            "p90_s": p90(ts),
            "max_s": max(ts),
            "steady_gbps": size / statistics.median(ts[4:] or ts) / 1e9,
            "settle_past_gap_max_s": max(overrun[name]),
        }
    return out


def ratios(scenario: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(measure, ratio, target) for the job's targets, as times: baseline / kvckpt."""
    s = scenario["systems"]
    return [
        ("LMDB p90 vs DCP t=2 p90", s["DCP t=2"]["p90_s"] / s["kvckpt LMDB"]["p90_s"], 1.2),
        ("LMDB slowest vs DCP t=1 slowest", s["DCP t=1"]["max_s"] / s["kvckpt LMDB"]["max_s"], 1.5),
        ("Redis p90 vs DCP t=1 p90", s["DCP t=1"]["p90_s"] / s["kvckpt Redis"]["p90_s"], 1.0),
        (
            "Redis p90 vs raw-socket SET p90",
            s["raw-socket SET"]["p90_s"] / s["kvckpt Redis"]["p90_s"],
            0.8,
        ),
    ]


def table(results: dict[str, Any], size: int) -> str:
    lines = [
        "| keep_last | system | saves 1-3 (GB/s) | p50 (GB/s) | p90 (GB/s) | slowest (GB/s) "
        "| steady (GB/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for sc in results["scenarios"]:
        for name, r in sc["systems"].items():
            first = " / ".join(f"{g:.2f}" for g in r["gbps"][:3])
            lines.append(
                f"| {sc['keep_last']} | {name} | {first} | {size / r['p50_s'] / 1e9:.2f} "
                f"| {size / r['p90_s'] / 1e9:.2f} | {size / r['max_s'] / 1e9:.2f} "
                f"| {r['steady_gbps']:.2f} |"
            )
    lines += ["", first_table(results["first_saves_s"], size)]
    lines += [
        "",
        "| keep_last | measure | speed-up (higher is better) | target |",
        "|---|---|---|---|",
    ]
    for sc in results["scenarios"]:
        for measure, ratio, target in ratios(sc):
            mark = "met" if ratio >= target else "missed"
            lines.append(f"| {sc['keep_last']} | {measure} | {ratio:.2f}x | >= {target}x, {mark} |")
    lines += first_ratios(results["first_saves_s"])
    for sc in results["scenarios"]:
        steady = sc["systems"]["kvckpt LMDB"]["steady_gbps"]
        lines.append(
            f"| {sc['keep_last']} | LMDB steady save | {steady:.2f} GB/s | >= 10 GB/s, "
            f"{'met' if steady >= 10 else 'missed'} |"
        )
    return "\n".join(lines)


def first_table(first: dict[str, list[float]], size: int) -> str:
    return markdown_table(
        ("first save into a new store", "each (GB/s)", "median (GB/s)"),
        (
            (
                name,
                " / ".join(f"{size / t / 1e9:.2f}" for t in ts),
                f"{size / statistics.median(ts) / 1e9:.2f}",
            )
            for name, ts in first.items()
        ),
    )


def first_ratios(first: dict[str, list[float]]) -> list[str]:
    """Rows of the ratios table: each LMDB first save against DCP's (medians)."""
    rows = []
    for case in ("kvckpt LMDB", READY):
        if case not in first:
            continue
        lmdb_first = statistics.median(first[case])
        how = "" if case == "kvckpt LMDB" else ", get_ready at job start"
        for base in ("DCP t=2", "DCP t=1"):
            ratio = statistics.median(first[base]) / lmdb_first
            target = 1.1 if base == "DCP t=2" else 1.0
            rows.append(
                f"| new store | LMDB first save{how} vs {base} first (median of "
                f"{len(first[base])}) | {ratio:.2f}x | >= {target}x, "
                f"{'met' if ratio >= target else 'missed'} |"
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=512, help="state dict size")
    parser.add_argument("--saves", type=int, default=12, help="saves per system and retention")
    parser.add_argument("--keep", type=int, nargs="+", default=[2, 1], help="keep_last values")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds of idle between saves")
    parser.add_argument(
        "--first-rounds", type=int, default=6, help="rounds of first saves into a new store"
    )
    parser.add_argument("--out", default="benchmarks/results", help="where results go")
    parser.add_argument(
        "--only-first", action="store_true", help="time the first saves alone and print them"
    )
    args = parser.parse_args(argv)
    sd = make_state_dict(args.size_mib * MIB)
    size = nbytes(sd)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    scratch = Path(tempfile.mkdtemp(prefix="kvckpt-job-", dir=shm))
    print(f"state dict: {len(sd)} tensors, {size / MIB:.0f} MiB; {args.saves} saves", flush=True)
    try:
        first = first_saves(sd, args.first_rounds, scratch)
        if args.only_first:
            print(first_table(first, size))
            print("\n| keep_last | measure | speed-up (higher is better) | target |")
            print("|---|---|---|---|")
            print("\n".join(first_ratios(first)))
            return 0
        scenarios = [run_scenario(sd, k, args.saves, args.gap, scratch) for k in args.keep]
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(scratch)
    results = {
        "size_bytes": size,
        "saves": args.saves,
        "gap_s": args.gap,
        "first_saves_s": first,
        "scenarios": scenarios,
    }
    machine = (
        f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}; {len(sd)} tensors, "
        f"{size / MIB:.0f} MiB; {args.saves} "
        f"saves per system, {args.gap:g} s idle after each; highest 1-min loadavg at a save: "
        + ", ".join(f"{sc['loadavg_max']:.2f}" for sc in scenarios)
    )
    write_report(args.out, "job", table(results, size), machine, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
