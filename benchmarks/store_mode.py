"""Saves into a new LMDB store and steady saves, and the processes of their own that time them
with glibc's default memcpy and with non-temporal stores (``benchmarks/run.py``'s store-mode
section).

glibc reads its non-temporal threshold (``GLIBC_TUNABLES``) when a process starts, so each
setting needs a process: ``children`` runs this file once per setting and round, and each run
prints its timings as one JSON line.

    python benchmarks/store_mode.py SCRATCH --size-mib 64 --repeats 1 --gap 0 --part 4194240
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from baselines import memcpy_times, raw_lmdb_put_steady
from timing import settle, take_turns
from workload import MIB, make_state_dict

from kvckpt import KVStorageWriter
from kvckpt.engines.base import DEFAULT_PART_BYTES
from kvckpt.engines.lmdb import close_idle_environments


def new_store_save_times(
    sd: dict[str, torch.Tensor], path: Path, gap: float, ids: Iterator[str]
) -> list[float]:
    """Seconds of each of ten saves into a new LMDB store at ``path`` (keep_last=2, no
    ``get_ready``), ``gap`` seconds apart; the store is removed after."""
    url = f"lmdb://{path}"
    times = []
    for _ in range(10):
        writer = KVStorageWriter(url, keep_last=2)
        gc.collect()
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=writer, checkpoint_id=next(ids))
        times.append(time.perf_counter() - t0)
        time.sleep(gap)
    settle()
    del writer  # (an engine still in use keeps its environment, and the removed file, mapped)
    close_idle_environments(str(path))
    shutil.rmtree(path)
    return times


def steady_save(
    sd: dict[str, torch.Tensor], url: str, ids: Iterator[str], **options: Any
) -> Callable[[], Any]:
    """A save of a new checkpoint with keep_last=1, as a training job saves."""
    return lambda: dcp.save(
        sd, storage_writer=KVStorageWriter(url, keep_last=1, **options), checkpoint_id=next(ids)
    )


def child(scratch: Path, size_mib: int, repeats: int, gap: float, part: int) -> dict[str, Any]:
    """One process's timings: the new-store saves 2-10 (``gap`` seconds apart), LMDB's own
    steady put, steady kvckpt saves with checksums and without (taking turns, keep_last=1, as
    ``Bench.save_checksums``), and glibc's memcpy of the same parts."""
    sd = make_state_dict(size_mib * MIB)
    base = Path(tempfile.mkdtemp(prefix="store-mode-", dir=scratch))
    ids = (f"c{i}" for i in range(10**9))
    later = new_store_save_times(sd, base / "kv", gap, ids)[1:]
    raw = raw_lmdb_put_steady(sd, base / "raw", part, max(repeats, 5))
    url = f"lmdb://{base / 'steady'}"
    with_sums, without = steady_save(sd, url, ids), steady_save(sd, url, ids, checksums=False)
    for _ in range(2):  # warm up: freed pages exist to be reused
        with_sums()
    pair = take_turns({"sum": (with_sums, None), "nosum": (without, None)}, 3 * repeats)
    settle()
    close_idle_environments()
    shutil.rmtree(base, ignore_errors=True)
    memcpy = memcpy_times(sd, part, max(repeats, 5))  # last: its destination is new memory
    return {"later": later, "raw_put": raw, "memcpy": memcpy, **pair}


def settings(part: int) -> dict[str, dict[str, str]]:
    """The environments the children run with: glibc's default, non-temporal stores for a
    copy of a whole part or more (the threshold set to the part size), and kvckpt leaving every
    copy to LMDB's own put (``KVCKPT_LMDB_RESERVE=0``: no values written into reserved room)."""
    return {
        "default": {},
        "nt": {"GLIBC_TUNABLES": f"glibc.cpu.x86_non_temporal_threshold={part:#x}"},
        "put": {"KVCKPT_LMDB_RESERVE": "0"},
    }


def children(
    scratch: Path, size_mib: int, repeats: int, gap: float, part: int, runs: int
) -> dict[str, dict[str, list[float]]]:
    """``runs`` children of each setting, the two taking turns; each timing's runs of every
    child of a setting, by setting and timing (``later``, ``raw_put``, ``memcpy``, ``sum``,
    ``nosum``)."""
    cases = settings(part)
    found: dict[str, list[dict[str, list[float]]]] = {name: [] for name in cases}
    for r in range(runs):
        for name in list(cases)[r % len(cases) :] + list(cases)[: r % len(cases)]:
            settle()
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    str(scratch),
                    *("--size-mib", str(size_mib), "--repeats", str(repeats)),
                    *("--gap", str(gap), "--part", str(part)),
                ],
                env={**os.environ, **cases[name]},
                capture_output=True,
                text=True,
                check=True,
            )
            found[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        name: {key: [t for c in runs_of for t in c[key]] for key in runs_of[0]}
        for name, runs_of in found.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scratch", help="a directory for the stores (on /dev/shm)")
    parser.add_argument("--size-mib", type=int, default=1024, help="state dict size")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between new-store saves")
    parser.add_argument("--part", type=int, default=DEFAULT_PART_BYTES, help="bytes per LMDB value")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    found = child(Path(args.scratch), args.size_mib, args.repeats, args.gap, args.part)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
