"""A restore's load: the first load of a checkpoint in a new process, as a job restarted after
a failure makes it.

``benchmarks/run.py`` times loads in one process, which has the store's pages mapped from the
loads before. A restarted process has not: LMDB's reader maps the store's file into the
process, and the first read of each page faults it in, where DCP's reader copies the file with
``read()``. This times, in a new process for each, the first load of the same state dict
(``make_state_dict``, 1 GiB by default) and a second load after it, checksums verified:

- kvckpt, LMDB on ``/dev/shm``;
- kvckpt, LMDB on a tmpfs of huge pages (``--huge-tmpfs DIR``, a tmpfs mounted with
  ``huge=within_size``: docs/TUTORIAL.md says how), whose pages map 2 MiB at a time;
- DCP ``FileSystemReader`` on ``/dev/shm``.

The cases take turns, each round starting one case further along. Each process allocates and
touches its destination tensors (as a restarted job builds its model) before the timed load;
the interpreter's start and imports are not timed.

    python benchmarks/first_load.py --huge-tmpfs /tmp/hugews --out DIR   # ~3 min
    python benchmarks/first_load.py --size-mib 8 --rounds 1            # smoke

A published run goes into the directory of ``benchmarks/run.py``'s run on the same VM
(``docs/benchmark/<cpu>-<date>-<time>/``).

Check ``/proc/loadavg`` first: the machine must be otherwise idle.
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
import torch.distributed.checkpoint as dcp
from report import cpu_name, markdown_table, write_report
from timing import p90
from workload import make_state_dict, nbytes

from kvckpt import KVStorageWriter
from kvckpt.engines.lmdb import close_idle_environments

#: What each new process runs: ``kind`` and ``where`` in argv; prints the two loads' seconds.
_CHILD = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[3])
from workload import make_state_dict, zeros_like
from kvckpt import KVStorageReader
kind, where, size = sys.argv[1], sys.argv[2], int(sys.argv[4])
expected = make_state_dict(size)
dest = zeros_like(expected)
def reader():
    if kind == "dcp":
        return dcp.FileSystemReader(where)
    return KVStorageReader("lmdb://" + where, checkpoint_id="c")
seconds = []
for _ in range(2):
    started = time.perf_counter()
    dcp.load(dest, storage_reader=reader())
    seconds.append(time.perf_counter() - started)
assert all(torch.equal(dest[k], expected[k]) for k in expected), "the load differs"
print(json.dumps(seconds))
"""


def child(kind: str, where: Path, size: int) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, str(where), str(Path(__file__).parent), str(size)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [float(s) for s in json.loads(out.strip().splitlines()[-1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--huge-tmpfs", default=None, help="a tmpfs mounted with huge=within_size")
    ap.add_argument("--out", default=None, help="write first_load.json and .md here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    size = args.size_mib << 20
    sd = make_state_dict(size)
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-first-load-", dir="/dev/shm"))
    places = {"kvckpt LMDB, /dev/shm": ("lmdb", shm / "lmdb")}
    huge = None
    if args.huge_tmpfs:
        huge = Path(tempfile.mkdtemp(prefix="kvckpt-first-load-", dir=args.huge_tmpfs))
        places["kvckpt LMDB, tmpfs of huge pages"] = ("lmdb", huge / "lmdb")
    places["DCP FileSystemReader, /dev/shm"] = ("dcp", shm / "dcp")
    results: dict[str, dict[str, list[float]]] = {n: {"first": [], "second": []} for n in places}
    try:
        for kind, where in places.values():
            if kind == "dcp":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(where)))
            else:
                url = f"lmdb://{where}"
                dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id="c")
                close_idle_environments(str(where))
        names = list(places)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                first, second = child(*places[name], size)
                results[name]["first"].append(first)
                results[name]["second"].append(second)
                print(f"{name}: first load {first:.3f} s, second {second:.3f} s")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if huge is not None:
            shutil.rmtree(huge, ignore_errors=True)
    base = statistics.median(results["DCP FileSystemReader, /dev/shm"]["first"])
    rows = []
    for name, cell in results.items():
        first, second = statistics.median(cell["first"]), statistics.median(cell["second"])
        rows.append(
            (
                name,
                f"{first:.3f} (p90 {p90(cell['first']):.3f}, max {max(cell['first']):.3f})",
                f"{size / first / 1e9:.2f}",
                f"{base / first:.2f}",
                f"{second:.3f}",
                f"{first / second:.2f}",
            )
        )
    table = markdown_table(
        (
            "case",
            "first load in a new process, s",
            "GB/s",
            "x DCP's first load (speed-up)",
            "second load, s",
            "first / second (time ratio)",
        ),
        rows,
    )
    machine = (
        f"{cpu_name()}; {platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch "
        f"{torch.__version__}; {nbytes(sd) >> 20} MiB, checksums verified; medians of "
        f"{args.rounds} rounds taking turns, each load in a new process; 1-minute load "
        f"average {load:.2f} at the start"
    )
    if args.out:
        data = {"args": vars(args), "results": results, "load_average": load}
        write_report(args.out, "first_load", table, machine, data)
    print(table)
    print(machine)


if __name__ == "__main__":
    main()
