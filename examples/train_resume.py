"""Fault-tolerant training with kvckpt: a rank dies, the job restarts, training goes on.

The pattern to copy, in the order it appears below:

1. ``tiers = kvckpt.Tiers([...]); tiers.prefetch()`` at the top of the script: the newest
   checkpoint starts coming from the shared tier into node-local memory while the process group,
   the model and the optimizer are set up;
2. ``tiers.latest()`` / ``dcp.load`` then read local memory, and ``tiers.get_ready(state)``
   makes the node-local store's memory ready for the saves to come while the first steps run;
3. every ``--every`` steps, ``dcp.async_save(..., async_stager=stager)`` with one
   ``kvckpt.background_stager()`` for the whole run: the copy of the state runs on a thread during
   the next forward and backward, and the loop waits for it (``staging_completion``) only before
   ``optimizer.step()``, the first thing that changes the state;
4. ``Tiers`` writes the save into the node-local store and copies it to the shared one in the
   background; a restart on the same node restores from local memory, on a new node from the
   shared store.

What trains depends on ``--economy``, the machine the job is meant to stand for:

- ``cpu`` (the default): a small MLP (with dropout, so the RNG state matters) trained with DDP
  and AdamW on the host's cores, on synthetic data. Every core trains, so any work a checkpoint
  does in the background takes training time.
- ``accel``: an accelerator node, simulated on the host. Each rank holds ``--state-gib`` of
  state of its own (weights and two AdamW moments, as a shard under FSDP holds), and a step
  waits ``--step-seconds`` (the compute runs off the host's cores), runs one all-reduce per
  25 MiB gradient bucket as DDP does (of one element: the gradients' bytes travel on the
  accelerators' interconnect), then adds to one of the first four elements of every tensor, a
  pure function of the step. Left out: the device-to-host copy of a save and a restore's copy
  back (PCIe), the gradients' bytes and NCCL's start-up.
- ``cuda``: a small transformer trained with DDP (NCCL) and AdamW on the GPU, one rank per GPU;
  the saves stage the state into pinned host memory.

In each, the model, the optimizer, the step (which is also the data position: the batch of step
s is a pure function of s and the rank) and each rank's RNG state are checkpointed.

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
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import warnings  # noqa: E402
from functools import partial  # noqa: E402
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
import kvckpt.events  # noqa: E402

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


class HostTraining:
    """``--economy cpu``: DDP and AdamW on the host's cores."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank
        torch.manual_seed(0)  # the same initial weights on every rank: DDP need not broadcast
        self.model = DistributedDataParallel(
            model_for(args.width, args.layers), gradient_as_bucket_view=True, init_sync=False
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        torch.manual_seed(1 + rank)  # each rank's own dropout stream

    def state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def loaded(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )

    def compute(self, step: int) -> torch.Tensor:
        """Forward and backward: everything before the state changes."""
        x, y = batch(step, self.rank, self.args.width, self.args.batch)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optim.zero_grad()
        loss.backward()
        return loss

    def update(self, step: int) -> None:
        self.optim.step()


class CudaTraining(HostTraining):
    """``--economy cuda``: a small transformer, DDP over NCCL and AdamW on this rank's GPU."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(self.device)
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(
            args.width, max(1, args.width // 64), 4 * args.width, batch_first=True
        )
        net = nn.Sequential(
            nn.Embedding(VOCAB, args.width),
            nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
            nn.Linear(args.width, VOCAB),
        ).to(self.device)
        self.model = DistributedDataParallel(net, gradient_as_bucket_view=True, init_sync=False)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        torch.manual_seed(1 + rank)

    def compute(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * step + self.rank)
        tokens = torch.randint(VOCAB, (self.args.batch, 257), generator=g).to(self.device)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.optim.zero_grad()
        loss.backward()
        return loss


VOCAB = 8192


class SimulatedAccelerator:
    """``--economy accel``: the state of an accelerator node's rank, trained by an accelerator
    that this host only waits for. The host's cores stay free during a step, as on a GPU node;
    the state changes at every step (one element per tensor, a pure function of the step), so
    a checkpoint of the wrong step restores a different state."""

    TENSOR_BYTES = 64 << 20

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank
        per_kind = int(args.state_gib * 2**30) // 3  # weights, exp_avg, exp_avg_sq
        count = max(1, round(per_kind / self.TENSOR_BYTES))
        numel = per_kind // count // 4
        self.tensors: dict[str, torch.Tensor] = {}
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            for i in range(count):
                t = torch.empty(numel, dtype=torch.float32)
                t.fill_(0.01 * (i + 1) + (kind == "weight"))  # real pages, as a model's init
                self.tensors[f"rank{rank}.layer{i}.{kind}"] = t
        self.buckets = max(1, math.ceil(per_kind / (25 << 20)))
        self.grad = torch.zeros(1)
        torch.manual_seed(1 + rank)

    def state(self) -> dict[str, Any]:
        return {"shard": self.tensors}

    def loaded(self, sd: dict[str, Any]) -> None:
        pass  # dcp.load filled the tensors in place

    def compute(self, step: int) -> torch.Tensor:
        started = time.perf_counter()
        for _ in range(self.buckets):  # DDP's all-reduce of each gradient bucket
            self.grad.fill_(step)
            dist.all_reduce(self.grad)
        time.sleep(max(0.0, self.args.step_seconds - (time.perf_counter() - started)))
        return torch.stack([t[:4].sum() for t in self.tensors.values()]).sum()

    def update(self, step: int) -> None:
        """The first four elements of each tensor sum every step so far: a checkpoint of
        another step, or a restore that lost an update, shows in the next loss."""
        for i, t in enumerate(self.tensors.values()):
            t[step % 4] += (step % 7) * 1e-3 + i * 1e-6


class DirectoryStore:
    """DCP's FileSystemWriter/Reader on a directory: the baseline, same call shape, keeping the
    newest ``keep_last`` checkpoints as kvckpt's retention does."""

    def __init__(self, path: str, keep_last: int) -> None:
        self.path = Path(path)
        self.keep_last = keep_last

    def prefetch(self, force: bool = False) -> None:
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

    def get_ready(self, state: dict[str, Any]) -> None:
        pass  # DCP's writers have nothing of the kind

    def wait(self) -> None:
        pass


class KVStore:
    """kvckpt through ``Tiers`` (one store, or several with background copies)."""

    def __init__(
        self,
        urls: list[str],
        durable: str | None,
        every: int,
        keep: int,
        peers: int = 0,
        shared_every: int = 1,
    ) -> None:
        # copy="newest": a training loop that saves faster than the copies to the shared tier
        # go never queues them up
        self.tiers = kvckpt.Tiers(
            urls,
            durable=durable,
            durable_every=every,
            keep_last=keep,
            copy="newest",
            peers=peers,
            shared_every=shared_every,
        )

    def prefetch(self, force: bool = False) -> None:
        # local rank 0 of each node, where a core is spare; a no-op for a single store
        self.tiers.prefetch(force=force)

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

    def get_ready(self, state: dict[str, Any]) -> None:
        self.tiers.get_ready(state)

    def wait(self) -> None:
        self.tiers.wait()


def init_distributed(backend: str) -> None:
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
        backend, store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=world
    )


def parser() -> argparse.ArgumentParser:
    """The example's flags (``benchmarks/goodput.py`` launches it with them)."""
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
    ap.add_argument(
        "--every-from",
        type=int,
        default=0,
        help="the first step --every's saves may fall on (after --also-save-at's warm-up saves)",
    )
    ap.add_argument(
        "--economy",
        choices=["cpu", "accel", "cuda"],
        default="cpu",
        help="what trains: DDP on the host's cores, a simulated accelerator, or CUDA",
    )
    ap.add_argument("--state-gib", type=float, default=1.0, help="accel: state per rank")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="accel: one step's compute")
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
    ap.add_argument(
        "--force-prefetch",
        action="store_true",
        help="Tiers.prefetch(force=True): prefetch even where no core is spare",
    )
    ap.add_argument(
        "--kill-at-step",
        type=int,
        help="SIGKILL --kill-rank at this step (1st run), once the saves before it are copied",
    )
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument(
        "--wipe-on-restart",
        help="a directory to delete before restoring after a "
        "restart: the node-local store of a replaced node",
    )
    ap.add_argument("--events", help="a file for JSON lines from rank 0")
    ap.add_argument("--peers", type=int, default=0, help="Tiers(peers=K)")
    ap.add_argument("--shared-every", type=int, default=1, help="Tiers(shared_every=N)")
    ap.add_argument(
        "--host-per-rank",
        action="store_true",
        help="simulate a host per rank: KVCKPT_NODE=host<rank>, and {rank} in --store "
        "replaced by the rank (each host its own store)",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.host_per_rank:
        rank_text = os.environ["RANK"]
        os.environ["KVCKPT_NODE"] = f"host{rank_text}"
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # the ranks sharing this host's store: itself
        args.store = [s.replace("{rank}", rank_text) for s in args.store]

    init_distributed("nccl" if args.economy == "cuda" else "gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    wiped = time.time()
    if attempt > 0 and args.wipe_on_restart:  # a replaced node: its local store is gone
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(args.wipe_on_restart, ignore_errors=True)
        dist.barrier()
    # a new node has nothing to delete: the benchmark takes this time out of the relaunch
    wipe_seconds = time.time() - wiped

    # As early as possible: the newest checkpoint comes into node-local memory meanwhile.
    if args.store[0].startswith("dcp:"):
        store: DirectoryStore | KVStore = DirectoryStore(args.store[0][4:], args.keep_last)
    else:
        store = KVStore(
            args.store,
            args.durable,
            args.durable_every,
            args.keep_last,
            args.peers,
            args.shared_every,
        )
    if not args.no_prefetch:
        store.prefetch(force=args.force_prefetch)

    # The saves' collectives run in a background thread while training's all-reduces run in
    # this one: they need a process group of their own, or the two interleave and hang.
    global PG
    PG = dist.new_group(backend="gloo")
    # One write() per event on an O_APPEND descriptor: a reader polling the file sees whole
    # lines, and a SIGKILL lands between events, not inside one.
    log_fd = (
        os.open(args.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if args.events and rank == 0
        else None
    )

    log_lock = threading.Lock()  # uploads end on DCP's threads

    def log(**event: Any) -> None:
        if log_fd is not None:
            line = json.dumps({"attempt": attempt, **event}) + "\n"
            with log_lock:
                os.write(log_fd, line.encode())

    def uploaded(step: int, begun: float, _: Any) -> None:
        log(event="uploaded", step=step, seconds=time.perf_counter() - begun)

    def copied(event: kvckpt.events.Event) -> None:
        """A checkpoint reached a further tier, or the peers: how fresh a replaced node's
        restore can be."""
        if (event.operation, event.phase) in (("copy", "commit"), ("peer", "copy")):
            step = int(event.checkpoint_id.rpartition("-")[2])
            tier = "peers" if event.operation == "peer" else event.tier
            log(event="copied", step=step, tier=tier, t=event.ended_at)

    kvckpt.events.subscribe(copied)

    log(event="start", process_start=PROCESS_START, pid=os.getpid(), wipe_seconds=wipe_seconds)
    if rank == 0:
        store.recover()
    dist.barrier()

    trainer: HostTraining | SimulatedAccelerator = {
        "cpu": HostTraining,
        "accel": SimulatedAccelerator,
        "cuda": CudaTraining,
    }[args.economy](args, rank)

    def state() -> dict[str, Any]:
        return {
            **trainer.state(),
            "step": torch.tensor(step),
            "rng": {f"rank{rank}": rng_state()},
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
        trainer.loaded(sd)
        set_rng_state(sd["rng"][f"rank{rank}"])
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
    if args.every or args.also_save_at:
        # the stores' memory for the saves to come is made ready while the first steps run
        store.get_ready(state())

    also_save_at = {int(s) for s in args.also_save_at.split(",") if s}
    stager = kvckpt.background_stager() if args.staging == "background" else None
    saving: Any = None  # the save in flight: a Future, or an AsyncSaveResponse
    staged = True  # whether the save in flight has its copy of the state
    save_event: dict[str, Any] = {}
    while step < args.steps:
        if attempt == 0 and step == args.kill_at_step:
            store.wait()  # the saves so far have reached every store: the restart can find them
            if rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
        loss = trainer.compute(step)
        if not staged:  # the optimizer step changes the state: the copy must be taken
            started = time.perf_counter()
            saving.staging_completion.result()
            save_event["blocking_seconds"] += time.perf_counter() - started
            log(**save_event)
            staged = True
        trainer.update(step)
        step += 1
        log(event="loss", step=step, loss=loss.item().hex(), t=time.time())
        periodic = args.every and step % args.every == 0 and step >= args.every_from
        if periodic or step in also_save_at:
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
                # how long the save is in flight: the next one waits for it
                done = saving.upload_completion if staged_async(saving) else saving
                done.add_done_callback(partial(uploaded, step, started + waited))
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


def rng_state() -> torch.Tensor:
    """This process's RNG state: the CPU generator's, and the GPU's after it where one is used."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cat([torch.get_rng_state(), torch.cuda.get_rng_state()])
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if state.numel() > cpu:
        torch.cuda.set_rng_state(state[cpu:].clone())


def staged_async(saving: Any) -> bool:
    """Whether ``dcp.async_save`` returned DCP's staging/upload pair (an async stager)."""
    return isinstance(saving, AsyncSaveResponse)


if __name__ == "__main__":
    main()
