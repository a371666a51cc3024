"""Fault-tolerant training with kvckpt: a rank dies, the job restarts, training goes on.

The pattern to copy, in the order it appears below:

1. ``tiers = kvckpt.Tiers([...]); tiers.prefetch()`` at the top of the script: the newest
   checkpoint starts coming from the shared tier into node-local memory while the process group,
   the model and the optimizer are set up;
2. ``tiers.latest()`` / ``dcp.load`` then read local memory;
3. every ``--every`` steps, ``dcp.async_save(..., async_stager=stager)`` with one
   ``kvckpt.background_stager()`` for the whole run: the copy of the state runs on a thread during
   the next forward and backward, and the loop waits for it (``staging_completion``) only before
   ``optimizer.step()``, the first thing that changes the state;
4. ``Tiers`` writes the save into the node-local store and copies it to the shared one in the
   background; a restart on the same node restores from local memory, on a new node from the
   shared store.

A small MLP (with dropout, so the RNG state matters) is trained with DDP on synthetic data: the
model, the optimizer, the step (which is also the data position: the batch of step s is a pure
function of s and the rank) and each rank's RNG state are checkpointed.

    # 2 ranks, checkpoints in node-local LMDB, copied to Redis in the background;
    # torchrun restarts the job once when a rank dies
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_resume.py \\
        --store "lmdb:///dev/shm/kvckpt-demo?prefix=train-resume" \\
        --store "redis://localhost:6379/0?prefix=train-resume" \\
        --steps 40 --every 5 --kill-at-step 23 --kill-rank 1

Each store URL names a namespace of its own (``?prefix=``): another job's checkpoints in the
same Redis (``examples/demo.py``'s, say) are then never this job's to restore.

``--store`` takes kvckpt URLs (the first is written synchronously; later ones get background
copies, see ``kvckpt.Tiers``) or ``dcp:DIR`` for DCP's own ``FileSystemWriter`` (the baseline
the benchmarks compare against). ``--events`` receives one JSON line per event from rank 0, with
wall-clock times (``benchmarks/goodput.py`` reads them): each step's loss (as ``float.hex``,
for bit-exact comparison), each restore (from which checkpoint and tier, and when it started and
ended) and each save's blocking time.
"""

from __future__ import annotations

import time

PROCESS_START = time.time()  # before the imports: they are part of a restart's cost

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import kvckpt  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


PG: Any = None  # the checkpointing process group


def model_for(width: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1)]
        blocks += [nn.Linear(4 * width, width), nn.LayerNorm(width)]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def batch(step: int, rank: int, width: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step: a pure function of (step, rank), so the step is the data position."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, width, generator=g)
    y = torch.sin(x[:, :1] * 3) + x[:, 1:2] * x[:, 2:3]
    return x, y


class DirectoryStore:
    """DCP's FileSystemWriter/Reader on a directory: the baseline, same call shape, keeping the
    newest ``keep_last`` checkpoints as kvckpt's retention does."""

    def __init__(self, path: str, keep_last: int) -> None:
        self.path = Path(path)
        self.keep_last = keep_last

    def prefetch(self) -> None:
        pass

    def recover(self) -> None:
        pass

    def writer(self, checkpoint_id: str) -> tuple[Any, Any]:
        path = self.path / checkpoint_id
        return dcp.FileSystemWriter(path), path

    def saved(self) -> None:
        """The previous save is complete: drop the checkpoints beyond the newest keep_last."""
        if dist.get_rank() != 0:
            return
        done = sorted(
            (p for p in self.path.glob("step-*") if (p / ".metadata").exists()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> tuple[str, str] | None:
        done = [p for p in self.path.glob("step-*") if (p / ".metadata").exists()]
        if not done:
            return None
        newest = max(done, key=lambda p: int(p.name.split("-")[1]))
        return newest.name, str(newest)

    def load(self, state: dict[str, Any], found: tuple[str, str]) -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(found[1]))

    def wait(self) -> None:
        pass


class KVStore:
    """kvckpt through ``Tiers`` (one store, or several with background copies)."""

    def __init__(self, urls: list[str], durable: str | None, every: int, keep: int) -> None:
        self.tiers = kvckpt.Tiers(urls, durable=durable, durable_every=every, keep_last=keep)

    def prefetch(self) -> None:
        self.tiers.prefetch()  # local rank 0 of each node; a no-op for a single store

    def recover(self) -> None:
        # Saves that a killed writer left half-done: drop them and free their write leases,
        # so this run can save the same step ids again. Only saves begun before this process
        # started: prefetch() may be copying into the local store right now.
        for engine in self.tiers.engines:
            try:
                before_start = time.time() - PROCESS_START
                kvckpt.gc(engine, incomplete_older_than=before_start, scan_orphans=False)
            except kvckpt.StoreUnavailableError as e:
                print(f"[resume] skipping cleanup of {engine.url}: {e}", flush=True)

    def writer(self, checkpoint_id: str) -> tuple[Any, Any]:
        return self.tiers.writer(), checkpoint_id

    def saved(self) -> None:
        pass  # keep_last runs inside each save

    def latest(self) -> kvckpt.Restore | None:
        return self.tiers.latest()

    def load(self, state: dict[str, Any], found: kvckpt.Restore) -> None:
        dcp.load(state, storage_reader=self.tiers.reader(found))

    def wait(self) -> None:
        self.tiers.wait()


def init_distributed() -> None:
    """``init_process_group`` under a store prefix of its own per restart: torchrun keeps one
    rendezvous store across restarts, and gloo would otherwise read the addresses the killed
    attempt's ranks published there and fail to connect."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", action="append", required=True, help="URL, repeatable; or dcp:DIR")
    ap.add_argument("--durable", help="directory for every --durable-every-th checkpoint")
    ap.add_argument("--durable-every", type=int, default=4)
    ap.add_argument("--keep-last", type=int, default=2, help="checkpoints kept in each store")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps (0: never)")
    ap.add_argument(
        "--also-save-at",
        default="",
        help="comma-separated steps to checkpoint at as well (warm-up saves before --every's)",
    )
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument(
        "--staging",
        choices=["background", "blocking", "sync"],
        default="background",
        help="background: async_save with kvckpt.background_stager(); blocking: async_save "
        "with DCP's default staging copy; sync: dcp.save",
    )
    ap.add_argument("--no-prefetch", action="store_true", help="restore without Tiers.prefetch")
    ap.add_argument("--kill-at-step", type=int, help="SIGKILL --kill-rank at this step (1st run)")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument(
        "--wipe-on-restart",
        help="a directory to delete before restoring after a "
        "restart: the node-local store of a replaced node",
    )
    ap.add_argument("--events", help="a file for JSON lines from rank 0")
    args = ap.parse_args()

    init_distributed()
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt > 0 and args.wipe_on_restart:  # a replaced node: its local store is gone
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(args.wipe_on_restart, ignore_errors=True)
        dist.barrier()

    # As early as possible: the newest checkpoint comes into node-local memory meanwhile.
    if args.store[0].startswith("dcp:"):
        store: DirectoryStore | KVStore = DirectoryStore(args.store[0][4:], args.keep_last)
    else:
        store = KVStore(args.store, args.durable, args.durable_every, args.keep_last)
    if not args.no_prefetch:
        store.prefetch()

    # The saves' collectives run in a background thread while training's all-reduces run in
    # this one: they need a process group of their own, or the two interleave and hang.
    global PG
    PG = dist.new_group(backend="gloo")
    log_file = open(args.events, "a") if args.events and rank == 0 else None  # noqa: SIM115

    def log(**event: Any) -> None:
        if log_file is not None:
            log_file.write(json.dumps({"attempt": attempt, **event}) + "\n")
            log_file.flush()

    log(event="start", process_start=PROCESS_START, pid=os.getpid())
    if rank == 0:
        store.recover()
    dist.barrier()

    torch.manual_seed(0)  # the same initial weights on every rank: DDP need not broadcast them
    model = DistributedDataParallel(
        model_for(args.width, args.layers), gradient_as_bucket_view=True, init_sync=False
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    torch.manual_seed(1 + rank)  # each rank's own dropout stream

    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "step": torch.tensor(step),
            "rng": {f"rank{rank}": torch.get_rng_state()},
        }

    step = 0
    restore_start = time.time()
    found = store.latest()  # waits for this node's prefetch
    if found is not None:
        chosen = time.time()
        sd = state()
        load_start = time.time()
        store.load(sd, found)
        load_seconds = time.time() - load_start
        loaded = time.time()
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        torch.set_rng_state(sd["rng"][f"rank{rank}"])
        step = int(sd["step"])
        del sd
        name = found[0] if isinstance(found, tuple) else found.checkpoint_id
        source = found[1] if isinstance(found, tuple) else found.source
        log(
            event="resume",
            checkpoint=name,
            step=step,
            source=source,
            tier=getattr(found, "tier", None),
            restore_start=restore_start,
            restore_end=time.time(),
            load_seconds=load_seconds,
            # where the rest of the restore went: choosing (latest(), with any prefetch wait),
            # the state dict's set-up (get_state_dict), and set_state_dict
            latest_seconds=chosen - restore_start,
            setup_seconds=load_start - chosen,
            set_seconds=time.time() - loaded,
        )
        print(f"[rank {rank}] resumed from {name} ({source})", flush=True)
    log(event="ready", step=step, restore_start=restore_start, restore_end=time.time())

    also_save_at = {int(s) for s in args.also_save_at.split(",") if s}
    stager = kvckpt.background_stager() if args.staging == "background" else None
    saving: Any = None  # the save in flight: a Future, or an AsyncSaveResponse
    staged = True  # whether the save in flight has its copy of the state
    save_event: dict[str, Any] = {}
    while step < args.steps:
        if attempt == 0 and step == args.kill_at_step and rank == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank, args.width, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        if not staged:  # the optimizer step changes the state: the copy must be taken
            started = time.perf_counter()
            saving.staging_completion.result()
            save_event["blocking_seconds"] += time.perf_counter() - started
            log(**save_event)
            staged = True
        optim.step()
        step += 1
        log(event="loss", step=step, loss=loss.item().hex(), t=time.time())
        if (args.every and step % args.every == 0) or step in also_save_at:
            started = time.perf_counter()
            if saving is not None:  # one save in flight at a time
                (saving.upload_completion if staged_async(saving) else saving).result()
                store.saved()
            waited = time.perf_counter() - started
            writer, checkpoint_id = store.writer(f"step-{step}")
            if args.staging == "sync":
                dcp.save(
                    state(), storage_writer=writer, checkpoint_id=checkpoint_id, process_group=PG
                )
                store.saved()
            else:
                saving = dcp.async_save(
                    state(),
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                    process_group=PG,
                    async_stager=stager,
                )
            save_event = {
                "event": "save",
                "step": step,
                "blocking_seconds": time.perf_counter() - started,
                "waiting_for_previous_seconds": waited,
            }
            staged = not staged_async(saving)
            if staged:
                log(**save_event)
    if saving is not None:
        (saving.upload_completion if staged_async(saving) else saving).result()
        store.saved()
        if not staged:
            log(**save_event)
    store.wait()  # background copies to slower tiers, before the job exits
    if stager is not None:
        stager.close()
    log(event="done", step=step, t=time.time())
    dist.barrier()
    dist.destroy_process_group()
    # Leave now, with the model still alive: freeing DDP's reducer at interpreter exit can
    # deadlock with gloo's worker thread over the GIL, and torch 2.13's gloo can abort in a
    # static destructor.
    os._exit(0)


def staged_async(saving: Any) -> bool:
    """Whether ``dcp.async_save`` returned DCP's staging/upload pair (an async stager)."""
    return isinstance(saving, AsyncSaveResponse)


if __name__ == "__main__":
    main()
