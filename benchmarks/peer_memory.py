"""Host memory of peer copies and of a restore's exchange, against their budget.

``Tiers(peers=1, peer_budget_bytes=B)`` on N simulated hosts on this machine (gloo ranks with
``KVCKPT_NODE=host<h>``, one rank and one node-local LMDB store per host, no shared tier).
Per kind of state (``ddp``: replicated plain tensors; ``fsdp``: DTensors sharded on dim 0) and
per budget:

1. every rank saves, and waits for its peer copy;
2. the last host's store is deleted (a replaced node);
3. every rank restores the newest checkpoint: the replaced host's share comes from its peer.

Per rank and phase, two measures of the memory it needed beyond the state:

- **exact**: the most bytes it held at once for the copy (chunks landing) or the exchange (items
  read to send, items received into buffers of its own): ``PeerCopier.peak_buffered`` and
  ``RestoreStats.peak_buffered``;
- **sampled**: the peak of the process's anonymous resident memory (``RssAnon``, read from
  ``/proc/self/status`` every millisecond by a thread) above its level as the phase started.
  The stores' memory (LMDB's map in ``/dev/shm``) is shared, not anonymous, and not counted.

The target is ``budget + one item``; a budget of ``0`` stands for none (every item at once), for
comparison. The run fails (exit 1) on a restore that is not bit-exact or an exact peak over its
target; the table's "within" column judges both measures (the sampled one also counts the
interpreter's own, which matters only at a few MiB).

    python benchmarks/peer_memory.py --out docs/benchmark            # 4 hosts, 256 MiB
    python benchmarks/peer_memory.py --hosts 2 --mib 8 --budgets-mib 1
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import cpu_name, markdown_table, write_report  # noqa: E402
from restore_scale import (  # noqa: E402
    KINDS,
    MIB,
    _finish,
    _init,
    _spawn,
    full_state,
    full_state_bytes,
    host_url,
    local_tensor,
    rank_state,
)
from timing import AnonPeak  # noqa: E402

from kvckpt import Tiers  # noqa: E402
from kvckpt.engines.lmdb import close_idle_environments  # noqa: E402

#: a budget this large stands for none: every item of a phase at once
UNLIMITED = 1 << 50


def worker(
    rank: int, world: int, port: int, root: str, kind: str, mib: float, budget: int, out: str
) -> None:
    """Save with a peer copy, lose the last host's store, restore; write this rank's peaks."""
    _init(rank, world, port, 1)
    url = host_url(root, rank, 1)
    tiers = Tiers([url], peers=1, peer_budget_bytes=budget)
    state = rank_state(kind, world, mib)
    dist.barrier()
    dcp.save(state, storage_writer=tiers.writer(), checkpoint_id="step-1")
    with AnonPeak() as copy:  # the copy runs in the background from here
        tiers.wait()
    copy_exact = tiers.peer_copies.peak_buffered
    tiers.close()
    del state
    close_idle_environments()
    dist.barrier()
    if rank == world - 1:
        shutil.rmtree(f"{root}/host{rank}")
    dist.barrier()
    state = rank_state(kind, world, mib, zeros=True)
    tiers = Tiers([url], peers=1, peer_budget_bytes=budget)
    dist.barrier()
    with AnonPeak() as restore:
        restored = tiers.restore(state)
    stats = tiers.last_restore_stats
    assert restored is not None and stats is not None
    expected = rank_state(kind, world, mib)
    exact = restored.checkpoint_id == "step-1" and all(
        torch.equal(local_tensor(state[k]), local_tensor(expected[k])) for k in expected
    )
    tiers.close()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "copy_exact": copy_exact,
                "copy_sampled": copy.above,
                "restore_exact": stats.peak_buffered,
                "restore_sampled": restore.above,
                "restore_peers": stats.peers,
                "restore_sent": stats.sent,
                "exact": bool(exact),
            }
        )
    )
    _finish()


def run_case(hosts: int, kind: str, mib: float, budget: int, tmp: Path) -> list[dict[str, Any]]:
    case = tmp / f"{kind}-{budget}"
    root, out = case / "stores", case / "out"
    root.mkdir(parents=True)
    out.mkdir()
    _spawn(worker, hosts, str(root), kind, mib, budget, str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(hosts)]
    shutil.rmtree(case)
    return ranks


def largest_item(kind: str, hosts: int, mib: float) -> int:
    """The largest stored item: a whole tensor (``ddp``) or one rank's shard of it (``fsdp``)."""
    largest = max(t.nbytes for t in full_state(mib).values())
    return largest if kind == "ddp" else -(-largest // hosts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hosts", type=int, default=4, help="simulated hosts, one rank each")
    ap.add_argument("--mib", type=float, default=256, help="state size, all ranks together")
    ap.add_argument("--kinds", default=",".join(KINDS), help="ddp, fsdp or both")
    ap.add_argument(
        "--budgets-mib", default="16,0", help="peer_budget_bytes in MiB; 0: none (default 16,0)"
    )
    ap.add_argument("--root", default=None, help="where the host stores go (default /dev/shm)")
    ap.add_argument("--out", default="docs/benchmark")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        ap.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; choose from {KINDS}")
    budgets = [int(float(b) * MIB) or UNLIMITED for b in args.budgets_mib.split(",") if b]
    base = args.root or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    tmp = Path(tempfile.mkdtemp(prefix="kvckpt-peer-memory-", dir=base))
    started = time.monotonic()
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"loadavg at the start: {load}", flush=True)
    cases: dict[str, Any] = {}
    try:
        for kind in kinds:
            for budget in budgets:
                cases[f"{kind}/{budget}"] = run_case(args.hosts, kind, args.mib, budget, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows, summaries, failed = [], {}, []
    for key, ranks in cases.items():
        kind, budget_text = key.split("/")
        budget = int(budget_text)
        item = largest_item(kind, args.hosts, args.mib)
        target = None if budget == UNLIMITED else budget + item
        summary = {
            "kind": kind,
            "budget": None if budget == UNLIMITED else budget,
            "largest_item": item,
            "target": target,
            "exact": all(r["exact"] for r in ranks),
        }
        for phase in ("copy", "restore"):
            exact = max(r[f"{phase}_exact"] for r in ranks)
            sampled = max(r[f"{phase}_sampled"] for r in ranks)
            within = target is None or max(exact, sampled) <= target
            summary[phase] = {"exact": exact, "sampled": sampled, "within": within}
            if target is not None and exact > target:
                failed.append(f"{key} {phase}")
            rows.append(
                (
                    kind,
                    "none" if target is None else f"{budget / MIB:.0f}",
                    phase,
                    f"{item / MIB:.1f}",
                    f"{exact / MIB:.1f}",
                    f"{sampled / MIB:.1f}",
                    "-" if target is None else f"{target / MIB:.1f}",
                    "-" if target is None else ("yes" if within else "NO"),
                    "yes" if summary["exact"] else "NO",
                )
            )
        summaries[key] = summary
    table = markdown_table(
        (
            "state",
            "budget MiB",
            "phase",
            "largest item MiB",
            "peak held MiB (exact)",
            "peak RssAnon above start MiB (sampled)",
            "target MiB (budget + one item)",
            "within",
            "bit-exact",
        ),
        rows,
    )
    machine = (
        f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}; {args.hosts} simulated "
        f"hosts on this machine, one rank each; {full_state_bytes(args.mib) / MIB:.0f} MiB of "
        f"state; the most over the ranks; 1-min loadavg at the start {load}; "
        f"{(time.monotonic() - started) / 60:.1f} min"
    )
    command = "python benchmarks/peer_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(
        args.out,
        "peer_memory",
        table,
        machine,
        {
            "command": command,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "args": vars(args),
            "cases": summaries,
            "raw": cases,
        },
    )
    inexact = [k for k, s in summaries.items() if not s["exact"]]
    if inexact or failed:
        print(f"NOT bit-exact: {inexact}; over the target: {failed}", file=sys.stderr)
    return 1 if inexact or failed else 0


if __name__ == "__main__":
    sys.exit(main())
