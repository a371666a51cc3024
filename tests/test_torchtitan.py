"""torchtitan 0.3 checkpointing through kvckpt: ``KVCheckpointManager`` built the way
torchtitan's ``Trainer`` builds its checkpointer (``config.checkpoint.build(...)``), driven
through the trainer's own loop order, with torchtitan's containers (``ModelWrapper``,
``OptimizersContainer``, ``LRSchedulersContainer``, ``ParallelAwareDataloader``), a tiny model,
real LMDB stores and a real redis-server.

torchtitan's ``Trainer`` itself cannot run here: it selects ``cuda`` when no accelerator is
present (``torchtitan.tools.utils.get_device_info``) and calls ``torch.cuda.set_device``, which
a CPU-only torch refuses; ``test_trainer_needs_an_accelerator`` pins that down. Importing
``torchtitan.trainer`` (and so torchtitan's ``ConfigManager`` with a config registry) also needs
``triton``, which a CPU-only torch does not install: the one test that does skips without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import kvckpt
from kvckpt.errors import CheckpointNotFoundError
from kvckpt.testing import RedisServer, free_port
from kvckpt.torchtitan import KVCheckpointManager, describe
from tests._spawn import spawn
from tests._torchtitan_job import (
    TOTAL_STEPS,
    Job,
    assert_same,
    config,
    make_job,
    rank_main,
    snapshot,
)


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    """One gloo process of world size 1, as ``torchrun --nproc_per_node=1`` gives the trainer
    (the async modes open a gloo group of their own, which needs it)."""
    if dist.is_initialized():  # pragma: no cover - another module left one
        yield
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def ids(url: str) -> set[str]:
    try:
        return {i.checkpoint_id for i in kvckpt.list_checkpoints(url) if i.complete}
    except kvckpt.StoreNotFoundError:  # no save yet
        return set()


def trained(url: str, tmp_path: Path, until: int = 6, **kw: Any) -> Job:
    """A job that saved steps 3 and 6 (interval 3) and stopped."""
    job = make_job(config(url, **kw), tmp_path)
    job.checkpointer.load()
    job.train(until, snapshot_at=(until,))
    job.stop()
    return job


# -- selection by torchtitan's configuration ------------------------------------------------


def import_trainer() -> Any:
    """``torchtitan.trainer``, or a skip: torchtitan 0.3 imports triton on the way (its MoE
    kernels), which a CUDA torch brings and a CPU-only torch does not (``pip install triton``)."""
    try:
        import torchtitan.trainer
    except ImportError as e:
        pytest.skip(f"torchtitan.trainer cannot be imported here: {e}")
    return torchtitan.trainer


def test_config_checks_its_fields(lmdb_url: str, tmp_path: Path) -> None:
    cfg = KVCheckpointManager.Config(enable=True, store_url=f" {lmdb_url} ")
    assert cfg.store_url == lmdb_url and cfg.weights_only
    assert cfg.to_dict()["store_url"] == lmdb_url
    # The trainer prints, saves and logs (WandB, TensorBoard) its config: no passwords in it.
    secret = KVCheckpointManager.Config(
        enable=True, store_url="redis://:hunter2@h:6379/0", replica_urls=["redis://u:pw2@r/0"]
    ).to_dict()
    assert secret["store_url"] == "redis://:***@h:6379/0"
    assert secret["replica_urls"] == ["redis://u:***@r/0"]
    with pytest.raises(ValueError, match="store_url is required"):
        KVCheckpointManager.Config(enable=True)
    with pytest.raises(ValueError, match="not a kvckpt store URL"):
        KVCheckpointManager.Config(enable=True, store_url="/tmp/ckpt")
    with pytest.raises(ValueError, match=r"replica_urls 'gs://:\*\*\*@bucket/x'"):
        KVCheckpointManager.Config(
            enable=True, store_url=lmdb_url, replica_urls=["gs://:hunter2@bucket/x"]
        )
    with pytest.raises(ValueError, match="at least 2"):  # torchtitan's own checks still run
        KVCheckpointManager.Config(enable=True, store_url=lmdb_url, keep_latest_k=1)
    # disabled: builds, does nothing, creates nothing
    off = KVCheckpointManager.Config(store_url=lmdb_url)
    job = make_job(off, tmp_path)
    assert job.checkpointer.save(3) is False and job.checkpointer.load() is False
    assert not Path(lmdb_url.removeprefix("lmdb://")).exists()


def test_config_registry_and_cli_select_it(lmdb_url: str, redis_url: str, tmp_path: Path):
    """torchtitan's ConfigManager (``--module/--config`` and CLI overrides) builds the config,
    and the config builds the manager as the trainer does."""
    trainer = import_trainer()
    from torchtitan.config import ConfigManager

    # The trainer's config takes it where CheckpointManager.Config goes.
    field_type = trainer.Trainer.Config.__dataclass_fields__["checkpoint"].type
    assert "BaseCheckpointManager.Config" in str(field_type)

    config = ConfigManager().parse_args(
        [
            "--module",
            "tests._torchtitan_config",
            "--config",
            "kv_debugmodel",
            "--checkpoint.store_url",
            lmdb_url,
            "--checkpoint.interval",
            "7",
            "--checkpoint.replica_urls",
            redis_url,
        ]
    )
    assert type(config.checkpoint) is KVCheckpointManager.Config
    assert config.checkpoint.store_url == lmdb_url
    assert config.checkpoint.interval == 7
    assert config.checkpoint.keep_latest_k == 3  # from the config function
    assert config.checkpoint.replica_urls == [redis_url]
    job = make_job(config.checkpoint, tmp_path)  # asserts the manager's type
    job.train(7)
    job.stop()
    assert ids(lmdb_url) == ids(redis_url) == {"step-7"}


# -- save policy ----------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["lmdb", "redis"])
def test_interval_and_keep_latest_k(store: str, request: pytest.FixtureRequest, tmp_path: Path):
    url = request.getfixturevalue(f"{store}_url")
    job = make_job(config(url, interval=2, keep_latest_k=2), tmp_path)
    assert job.checkpointer.load() is False  # a fresh start
    seen: list[set[str]] = []
    for step in range(1, TOTAL_STEPS + 1):
        job.train(step)
        seen.append(ids(url))
    job.stop()
    # saved at steps 2, 4, 6, 8 and the last step 10; never more than 2 kept
    assert seen[1] == {"step-2"}
    assert seen[3] == {"step-2", "step-4"}
    assert seen[5] == {"step-4", "step-6"}
    assert seen[9] == {"step-8", "step-10"}
    assert all(len(s) <= 2 for s in seen)
    assert not (tmp_path / "dump").exists()  # nothing went to torchtitan's folder
    # the last step is torchtitan's model-only export (last_save_model_only=True)
    model_only = kvckpt.KVStorageReader(url, checkpoint_id="step-10").read_metadata()
    assert set(model_only.state_dict_metadata) == set(job.model.state_dict())


def test_keep_latest_k_zero_keeps_all_and_first_step(lmdb_url: str, tmp_path: Path) -> None:
    job = make_job(config(lmdb_url, enable_first_step_checkpoint=True), tmp_path)
    job.train(7)
    job.stop()
    assert ids(lmdb_url) == {"step-1", "step-3", "step-6"}


# -- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("store", "async_mode"),
    [
        ("lmdb", "disabled"),
        ("lmdb", "async"),
        ("lmdb", "async_with_pinned_mem"),
        ("redis", "disabled"),
        ("redis", "async_with_pinned_mem"),
    ],
)
def test_resume_is_bit_exact(
    store: str, async_mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A job saves at steps 3 and 6 and goes on to step 8; a restarted job (other seed) resumes
    from step 6 and reaches step 8 with the very same model and optimizer."""
    url = request.getfixturevalue(f"{store}_url")
    first = make_job(config(url, async_mode=async_mode), tmp_path)
    assert first.checkpointer.load() is False
    first.train(8, snapshot_at=(6, 8))
    first.stop()
    assert ids(url) == {"step-3", "step-6"}

    second = make_job(config(url, async_mode=async_mode), tmp_path, seed=1)
    assert second.checkpointer.load() is True
    assert second.train_state.step == 6
    assert_same(first.snapshots[6], snapshot(second), "restored")
    second.train(8, snapshot_at=(8,))  # the dataloader and lr schedule continue as well
    second.stop()
    assert_same(first.snapshots[8], second.snapshots[8], "continued")


def test_seed_checkpoint_is_model_only(lmdb_url: str, tmp_path: Path) -> None:
    """``--checkpoint.create_seed_checkpoint``: torchtitan saves step 0 as a model-only last
    step; a job resumes the model from it and starts at step 0 with a fresh optimizer."""
    seed = make_job(config(lmdb_url), tmp_path)
    assert seed.checkpointer.save(curr_step=0, last_step=True) is True
    seed.stop()
    assert ids(lmdb_url) == {"step-0"}
    job = make_job(config(lmdb_url), tmp_path, seed=1)
    untouched = snapshot(job)
    assert job.checkpointer.load() is True
    now = snapshot(job)
    assert_same(snapshot(seed)["model"], now["model"], "model")
    assert_same(untouched["optimizer"], now["optimizer"], "optimizer")
    assert job.train_state.step == 0
    job.train(3)
    job.stop()
    assert ids(lmdb_url) == {"step-0", "step-3"}


def test_replicas_resume_after_the_node_is_lost(
    lmdb_url: str, redis_url: str, tmp_path: Path
) -> None:
    """``replica_urls``: each checkpoint commits in node-local LMDB and is copied to Redis in
    the background (``kvckpt.Tiers``); a job on a new node (no LMDB store) resumes from Redis."""
    cfg = config(
        lmdb_url,
        replica_urls=[redis_url],
        keep_latest_k=2,
        async_mode="async_with_pinned_mem",
    )
    first = make_job(cfg, tmp_path)
    assert first.checkpointer.load() is False
    first.train(9, snapshot_at=(9,))
    first.stop()  # waits for the copies
    assert ids(redis_url) == {"step-6", "step-9"}
    assert ids(lmdb_url) >= {"step-6", "step-9"}
    shutil.rmtree(lmdb_url.removeprefix("lmdb://"))  # the node is replaced

    second = make_job(cfg, tmp_path, seed=1)
    assert second.checkpointer.stored_steps() == {6: redis_url, 9: redis_url}
    assert second.checkpointer.load() is True
    assert_same(first.snapshots[9], snapshot(second), "restored from the replica")
    second.train(10)  # the last step: a save into the new node's store, copied to Redis
    second.stop()
    assert "step-10" in ids(lmdb_url) and "step-10" in ids(redis_url)
    # with both stores holding a step, it is read from the fast one
    third = make_job(cfg, tmp_path, seed=2)
    assert third.checkpointer.stored_steps()[10] == lmdb_url
    third.stop()


def test_load_step_and_missing_step(lmdb_url: str, tmp_path: Path) -> None:
    first = trained(lmdb_url, tmp_path)
    job = make_job(config(lmdb_url), tmp_path, seed=1)
    assert job.checkpointer.load(step=3) is True
    assert job.train_state.step == 3
    with pytest.raises(CheckpointNotFoundError, match=r"'step-99'.*complete steps there: 3, 6"):
        job.checkpointer.load(step=99)
    job.stop()
    assert first.snapshots[6]["train"]["step"] == 6


def test_errors_mask_the_password(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        server.client().config_set("requirepass", "hunter2")
        url = f"redis://:hunter2@127.0.0.1:{server.port}/0?prefix=run7"
        job = make_job(config(url), tmp_path)
        job.train(3)
        job.stop()
        job = make_job(config(url), tmp_path, seed=1)
        with pytest.raises(CheckpointNotFoundError) as info:
            job.checkpointer.load(step=99)
        assert "***" in str(info.value) and "hunter2" not in str(info.value)
        assert "step-99" in str(info.value) and "complete steps there: 3" in str(info.value)
        assert (
            describe(f"{url}#step-3")
            == f"redis://:***@127.0.0.1:{server.port}/0?prefix=run7#step-3"
        )
    finally:
        server.stop()


@pytest.fixture
def shm_store(tmp_path: Path) -> Iterator[str]:
    """An LMDB store URL on a tmpfs, where getting a store ready maps its pages in."""
    from kvckpt.engines import lmdb as lmdb_engine

    directory = Path(tempfile.mkdtemp(prefix="kvckpt-test-titan-", dir="/dev/shm"))
    if not (lmdb_engine._populate_ok and lmdb_engine._on_tmpfs(str(directory))):
        shutil.rmtree(directory)
        pytest.skip("needs /dev/shm on a tmpfs and MADV_POPULATE_WRITE")
    try:
        yield f"lmdb://{directory / 'store'}"
    finally:
        lmdb_engine.close_idle_environments()
        shutil.rmtree(directory, ignore_errors=True)


def test_the_store_gets_ready_after_the_first_step(shm_store: str, tmp_path: Path) -> None:
    """The first step that saves nothing gets the store ready in the background (its pages
    mapped in), so the first checkpoint, at step 3, writes into ready memory. The sizes come
    from the state the first step made: training runs as it does with checkpointing off."""
    from kvckpt.engines._lmdb_env import _SharedEnv

    job = make_job(config(shm_store), tmp_path)
    assert job.checkpointer.load() is False
    job.train(1)
    path = os.path.realpath(shm_store.removeprefix("lmdb://"))
    shared = _SharedEnv._envs[(os.getpid(), path)]
    if shared.populator is not None:
        shared.populator.join(60)
    assert shared.populated > 0 and ids(shm_store) == set()
    job.train(3, snapshot_at=(3,))
    assert ids(shm_store) == {"step-3"}
    job.stop()
    unsaved = make_job(KVCheckpointManager.Config(enable=False), tmp_path / "unsaved")
    unsaved.train(3, snapshot_at=(3,))
    unsaved.stop()
    assert_same(job.snapshots[3], unsaved.snapshots[3])


def test_load_only_saves_nothing(lmdb_url: str, tmp_path: Path) -> None:
    first = trained(lmdb_url, tmp_path)
    job = make_job(config(lmdb_url, load_only=True), tmp_path, seed=1)
    assert job.checkpointer.load() is True
    assert_same(first.snapshots[6], snapshot(job))
    job.train(9)
    job.stop()
    assert ids(lmdb_url) == {"step-3", "step-6"}
    # against a store that does not exist: a fresh start, and no store is created
    missing = f"lmdb://{tmp_path / 'nothing-here'}"
    fresh = make_job(config(missing, load_only=True), tmp_path)
    assert fresh.checkpointer.load() is False
    fresh.train(3)
    fresh.stop()
    assert not (tmp_path / "nothing-here").exists()


def test_exclude_from_loading(redis_url: str, tmp_path: Path) -> None:
    first = trained(redis_url, tmp_path)
    cfg = config(redis_url, exclude_from_loading=["optimizer", "train_state", "lr_scheduler"])
    job = make_job(cfg, tmp_path, seed=1)
    untouched = snapshot(job)
    assert job.checkpointer.load() is True
    now = snapshot(job)
    assert_same(first.snapshots[6]["model"], now["model"], "model")
    assert_same(untouched["optimizer"], now["optimizer"], "optimizer")
    assert_same(untouched["lr"], now["lr"], "lr")
    assert job.train_state.step == 0
    job.stop()


# -- initial_load_path ----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["store#id", "store", "directory"])
def test_initial_load_path(source: str, lmdb_url: str, redis_url: str, tmp_path: Path) -> None:
    """A new run starts from another run's checkpoint (model only, torchtitan's default):
    ``<URL>#<id>``, ``<URL>`` (its newest), or a DCP directory (read by DirectoryReader)."""
    first = trained(redis_url, tmp_path, until=3)
    if source == "store#id":
        path = f"{redis_url}#step-3"
    elif source == "store":
        path = redis_url
    else:
        path = str(tmp_path / "dcp-dir")
        dcp.save(first.snapshots[3]["model"], checkpoint_id=path)
    job = make_job(config(lmdb_url, initial_load_path=path), tmp_path, seed=1)
    untouched = snapshot(job)
    assert job.checkpointer.load() is True
    now = snapshot(job)
    assert_same(first.snapshots[3]["model"], now["model"], "model")
    assert_same(untouched["optimizer"], now["optimizer"], "optimizer")
    assert job.train_state.step == 0
    # once the run has its own checkpoint, a restart resumes from it and ignores the path
    job.train(3, snapshot_at=(3,))
    job.stop()
    again = make_job(config(lmdb_url, initial_load_path=path), tmp_path, seed=2)
    assert again.checkpointer.load() is True
    assert_same(job.snapshots[3], snapshot(again))
    again.stop()


def test_initial_load_path_full_state_and_errors(
    lmdb_url: str, redis_url: str, tmp_path: Path
) -> None:
    first = trained(redis_url, tmp_path, until=3)
    cfg = config(lmdb_url, initial_load_path=f"{redis_url}#step-3", initial_load_model_only=False)
    job = make_job(cfg, tmp_path, seed=1)
    assert job.checkpointer.load() is True
    assert_same(first.snapshots[3], snapshot(job))
    job.stop()

    empty = redis_url + ("&" if "?" in redis_url else "?") + "prefix=empty"
    job = make_job(config(lmdb_url, initial_load_path=empty), tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="holds no complete checkpoint"):
        job.checkpointer.load()
    missing = f"lmdb://{tmp_path / 'missing'}"
    job = make_job(config(lmdb_url, initial_load_path=missing), tmp_path)
    with pytest.raises(kvckpt.StoreNotFoundError, match="only a save creates a store"):
        job.checkpointer.load()
    assert not (tmp_path / "missing").exists()
    job = make_job(config(lmdb_url, initial_load_path=str(tmp_path / "nope")), tmp_path)
    with pytest.raises(ValueError, match=r"is neither a kvckpt store URL .* nor a DCP checkpoint"):
        job.checkpointer.load()
    for typo in ("reddis://:hunter2@h:6379/0", "memory://:hunter2@h/x"):  # not stores
        job = make_job(config(lmdb_url, initial_load_path=typo), tmp_path)
        with pytest.raises(ValueError, match="is neither a kvckpt store URL") as err:
            job.checkpointer.load()
        assert "hunter2" not in str(err.value) and ":***@h" in str(err.value)


# -- safety ---------------------------------------------------------------------------------


class Custom:
    """An object that only unrestricted unpickling can load."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_weights_only_refuses_unsafe_objects(lmdb_url: str, tmp_path: Path) -> None:
    job = make_job(config(lmdb_url), tmp_path)
    job.checkpointer.states["extra"] = {"obj": Custom(5)}
    job.train(3)
    job.stop()
    job = make_job(config(lmdb_url), tmp_path, seed=1)
    job.checkpointer.states["extra"] = {"obj": Custom(0)}
    with pytest.raises(CheckpointException, match=r"Custom.*Config\(weights_only=False\)"):
        job.checkpointer.load()
    job = make_job(config(lmdb_url, weights_only=False), tmp_path, seed=1)
    job.checkpointer.states["extra"] = holder = {"obj": Custom(0)}
    assert job.checkpointer.load() is True
    assert holder["obj"].value == 5


# -- what cannot run here ---------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only case")
def test_trainer_needs_an_accelerator() -> None:
    """Why there is no end-to-end ``torchtitan.train`` test: on a host without an accelerator
    torchtitan picks ``cuda`` anyway, and its Trainer calls ``torch.cuda.set_device``."""
    from torchtitan.tools import utils

    assert utils.device_type == "cuda"
    with pytest.raises((AssertionError, AttributeError, RuntimeError), match=r"(?i)cuda"):
        utils.device_module.set_device(torch.device("cuda", 0))


def test_import_kvckpt_does_not_import_torchtitan() -> None:
    code = "import sys, kvckpt; assert 'torchtitan' not in sys.modules, 'torchtitan imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("store", ["lmdb", "redis"])
def test_two_ranks_resume_bit_exact(store: str, request: pytest.FixtureRequest, tmp_path: Path):
    """Two data-parallel ranks (spawned, gloo) save asynchronously and resume: each rank's
    model, optimizer, lr schedule and dataloader position come back bit-exact."""
    url = request.getfixturevalue(f"{store}_url")
    spawn(rank_main, 2, url, str(tmp_path), "async")
    assert ids(url) == {"step-3", "step-6"}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_same(got["first"][6], got["restored"], f"rank {rank} restored")
        assert_same(got["first"][8], got["continued"], f"rank {rank} continued")
    saved = kvckpt.KVStorageReader(url, checkpoint_id="step-6").read_metadata()
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(saved.state_dict_metadata)
