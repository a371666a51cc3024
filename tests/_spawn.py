"""Run rank functions in spawned processes, and never leave one behind.

``torch.multiprocessing.spawn(join=True)`` waits for its ranks without a deadline. When a rank
hangs, pytest-timeout fails the test, but the ranks (and any process they forked) live on, and
at exit ``multiprocessing`` joins them: the whole run then hangs until CI kills it, and says
nothing about where the ranks were stuck. ``spawn`` here waits with a deadline; on a timeout,
or anything else that ends the wait (pytest-timeout's exception included), it has every
process it started write its Python stacks, kills them all, and raises with those stacks in
the message (``RanksHung`` on its own deadline).

The ranks start from a fork server that has imported torch, DCP and kvckpt once per test
process (``multiprocessing``'s forkserver with a preload): a fresh interpreter importing them
takes two seconds and more on a 2-core VM, for every rank of every job. A forked rank gets
the environment and working directory of the test at the moment it spawns, as a spawned one
would, not the fork server's.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from kvckpt.testing import free_port

#: What the fork server imports once, before it forks the ranks of every job.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "kvckpt", "kvckpt.tiered"]
mp.set_forkserver_preload(PRELOAD)

#: Below pytest-timeout's 300 s, so that the deadline, not pytest, ends a hung job.
DEADLINE_S = 240.0


class RanksHung(TimeoutError):
    """The ranks were still running at the deadline; the message holds their stacks."""


def _with_stack_dumps(
    rank: int, environ: dict[str, str], cwd: str, stacks: str, fn: Callable[..., Any], *args: Any
) -> None:
    os.environ.clear()  # the test's, not the fork server's (started by an earlier test)
    os.environ.update(environ)
    os.chdir(cwd)
    # SIGUSR1 appends every thread's stack to this rank's file; a process the rank forks
    # inherits the handler and the file.
    out = open(os.path.join(stacks, f"rank{rank}.txt"), "a")  # noqa: SIM115 (open until exit)
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    fn(rank, *args)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, from /proc: children first, then theirs."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stacks(directory: Path) -> str:
    return "\n".join(
        f"--- {path.name} (each process that wrote here: a rank, then anything it forked)\n"
        + path.read_text(errors="replace")
        for path in sorted(directory.glob("rank*.txt"))
    )


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = DEADLINE_S
) -> None:
    """``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes, ``port`` a
    free one for the process group's rendezvous; returns once all exited cleanly."""
    with tempfile.TemporaryDirectory(prefix="kvckpt-stacks-") as stacks:
        context = mp.start_processes(
            _with_stack_dumps,
            args=(dict(os.environ), os.getcwd(), stacks, fn, world_size, free_port(), *args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        ranks = [p.pid for p in context.processes]
        end = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > end:
                    raise RanksHung(
                        f"{world_size} ranks of {fn.__name__} still running after "
                        f"{deadline_s:.0f} s"
                    )
        except BaseException as e:
            # The ranks and whatever they forked; a forked child may outlive its rank.
            live = [pid for rank in ranks for pid in [rank, *_descendants(rank)]]
            for pid in live:  # one at a time, so that stacks sharing a file do not interleave
                _signal_all([pid], signal.SIGUSR1)
                time.sleep(0.5)
            _signal_all(live + [p for rank in ranks for p in _descendants(rank)], signal.SIGKILL)
            for process in context.processes:
                process.join(timeout=5.0)
            if live:
                e.add_note("stacks of the processes still running:\n" + _stacks(Path(stacks)))
            raise
