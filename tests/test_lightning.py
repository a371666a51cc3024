"""kvckpt.lightning with the real ``lightning`` package on CPU, real LMDB and a real redis-server:
the checkpoint dict round trip, ids from paths and pointer files, ModelCheckpoint (top-k removal,
save_last, ckpt_path="last") through KVCheckpointIO, the KVCheckpoint callback (retention, async
saves, Tiers) and auto_resume, and the errors (hostile skeleton, missing checkpoint)."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from kvckpt import (
    CheckpointNotFoundError,
    Tiers,
    UnsafeObjectError,
    list_checkpoints,
)
from kvckpt.keys import data_prefix, spare_key, spare_prefix
from kvckpt.lightning import (
    KVCheckpoint,
    KVCheckpointIO,
    auto_resume,
    checkpoint_id_for,
    read_pointer,
)
from kvckpt.testing import RedisServer
from tests._lightning_train import Net, data


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Equal values, tensors bit-exact, and the same container types."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def lightning_like_checkpoint() -> dict[str, Any]:
    """The shapes of what Lightning hands over: an OrderedDict state dict with ``_metadata``,
    optimizer state keyed by int, tuples, scalars, a 0-dim tensor, an empty one, a
    non-contiguous one, bf16, and a tensor shared by two keys."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, generator=g)
    state_dict = collections.OrderedDict(
        [("layer.weight", weight), ("layer.bias", torch.randn(4, generator=g))]
    )
    state_dict._metadata = collections.OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    return {
        "epoch": 3,
        "global_step": 40,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state_dict,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 4}}}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.5)}},
        "optimizer_states": [
            {
                "state": {
                    0: {"step": torch.tensor(40.0), "exp_avg": torch.randn(4, 3, generator=g)},
                    1: {"step": torch.tensor(40.0), "exp_avg": torch.randn(4, generator=g)},
                },
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": 40, "_last_lr": [0.005]}],
        "extra": {
            "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 7),
            "transposed": torch.randn(3, 5, generator=g).t(),
            "ints": torch.arange(6, dtype=torch.int64),
            "tied": weight,
            "pair": (torch.ones(2), "text", None, 1.5, True),
        },
    }


def test_round_trip_bit_exact(store_url: str, tmp_path: Path) -> None:
    io = KVCheckpointIO(store_url)
    checkpoint = lightning_like_checkpoint()
    path = tmp_path / "ckpts" / "epoch=3-step=40.ckpt"
    io.save_checkpoint(checkpoint, path)
    loaded = io.load_checkpoint(path)
    assert_same(loaded, checkpoint)
    assert loaded["state_dict"]._metadata == {"": {"version": 1}}
    # Optimizer state keeps its int keys: Adam would silently restart from zero moments.
    assert list(loaded["optimizer_states"][0]["state"]) == [0, 1]
    # Tensors are stored as tensors (raw bytes), not inside the pickled skeleton.
    info = next(i for i in list_checkpoints(store_url) if i.checkpoint_id == io.checkpoint_id(path))
    assert info.complete and info.world_size == 1
    assert info.num_items == 14  # 13 tensors + the skeleton


def test_ids_from_paths_and_pointer_files(lmdb_url: str, tmp_path: Path) -> None:
    a = tmp_path / "run-a" / "epoch=0-step=10.ckpt"
    b = tmp_path / "run-b" / "epoch=0-step=10.ckpt"
    ida, idb = checkpoint_id_for(a), checkpoint_id_for(b)
    assert ida.startswith("epoch=0-step=10.") and idb.startswith("epoch=0-step=10.")
    assert ida != idb  # same file name, other directory: another id
    assert checkpoint_id_for(str(a)) == ida  # deterministic, str or Path
    odd = checkpoint_id_for(tmp_path / "my model {v2}" / ".weird name!.ckpt")
    assert odd.startswith("weird_name_.")
    assert checkpoint_id_for(tmp_path / "weird name!.ckpt") != checkpoint_id_for(
        tmp_path / "weird_name_.ckpt"
    )

    io = KVCheckpointIO(lmdb_url)
    io.save_checkpoint({"w": torch.ones(2)}, a)
    io.save_checkpoint({"w": torch.zeros(2)}, b)
    assert {ida, idb} <= {i.checkpoint_id for i in list_checkpoints(lmdb_url)}
    pointer = read_pointer(a)
    assert pointer is not None and pointer["checkpoint_id"] == ida
    assert pointer["store"] == io.engine.url
    # The store is the truth: without the pointer file the id comes from the path.
    a.unlink()
    assert torch.equal(io.load_checkpoint(a)["w"], torch.ones(2))
    assert torch.equal(io.load_checkpoint(b)["w"], torch.zeros(2))
    # Remove deletes the store's checkpoint and the pointer file.
    io.remove_checkpoint(b)
    assert not b.exists()
    assert idb not in {i.checkpoint_id for i in list_checkpoints(lmdb_url)}


def test_plain_torch_checkpoint_files_still_load(lmdb_url: str, tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"w": torch.arange(3)}, path)
    io = KVCheckpointIO(lmdb_url)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(3))
    io.remove_checkpoint(path)
    assert not path.exists()


def test_missing_checkpoint_names_id_and_masked_url(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        client = server.client()
        client.config_set("requirepass", "s3cret")
        client.close()
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        io = KVCheckpointIO(url)
        saved = tmp_path / "saved.ckpt"
        io.save_checkpoint({"w": torch.ones(1)}, saved)
        text = saved.read_text()
        assert "s3cret" not in text and "***" in text
        missing = tmp_path / "ckpts" / "last.ckpt"
        with pytest.raises(CheckpointNotFoundError) as e:
            io.load_checkpoint(missing)
        message = str(e.value)
        assert checkpoint_id_for(missing) in message and str(missing) in message
        assert f"redis://:***@127.0.0.1:{server.port}/0" in message
        assert "s3cret" not in message
        assert checkpoint_id_for(saved) in message  # what is there instead
    finally:
        server.stop()


def test_failed_overwrite_keeps_the_old_checkpoint(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_last re-saves one id: a save that fails half-way must leave the old one whole."""
    from kvckpt import KVStorageWriter

    io = KVCheckpointIO(store_url)
    last = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.full((1000,), 1.0)}, last)
    pointer = last.read_text()

    def fail(self: KVStorageWriter, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire (injected)")

    monkeypatch.setattr(KVStorageWriter, "write_data", fail)
    with pytest.raises(OSError, match="injected"):
        io.save_checkpoint({"global_step": 2, "w": torch.full((1000,), 2.0)}, last)
    monkeypatch.undo()
    assert last.read_text() == pointer
    loaded = io.load_checkpoint(last)
    assert loaded["global_step"] == 1 and torch.equal(loaded["w"], torch.full((1000,), 1.0))
    io.save_checkpoint({"global_step": 3, "w": torch.full((1000,), 3.0)}, last)
    assert io.load_checkpoint(last)["global_step"] == 3


def test_a_crashed_save_does_not_lock_its_id(lmdb_url: str, tmp_path: Path) -> None:
    """A job killed while saving last.ckpt leaves the id's write lease behind; the restarted
    job's next save of that id must not wait for it to lapse."""
    from kvckpt import open_store
    from kvckpt.catalog import mark_pending

    io = KVCheckpointIO(lmdb_url)
    last = tmp_path / "last.ckpt"
    mark_pending(open_store(lmdb_url), io.checkpoint_id(last), "0" * 32, None, 600.0)
    io.save_checkpoint({"global_step": 5, "w": torch.ones(3)}, last)
    assert io.load_checkpoint(last)["global_step"] == 5
    infos = list_checkpoints(lmdb_url, include_incomplete=True)
    assert [(i.checkpoint_id, i.complete) for i in infos] == [(io.checkpoint_id(last), True)]


def test_pointer_to_an_unknown_store_with_a_password(tmp_path: Path) -> None:
    """A pointer file holds the store URL with its password masked: a process that never
    opened that store cannot load it, and is told how to fix that."""
    from kvckpt import KVCheckpointError

    path = tmp_path / "last.ckpt"
    path.write_text(
        json.dumps(
            {
                "kvckpt": "lightning-pointer",
                "version": 1,
                "store": "redis://:***@10.9.8.7:6379/0",
                "checkpoint_id": "last.00000000",
            }
        )
    )
    with pytest.raises(KVCheckpointError, match=r"redis://:\*\*\*@10.9.8.7.*full URL"):
        KVCheckpointIO(f"lmdb://{tmp_path / 'store'}").load_checkpoint(path)


_UNPICKLED: list[str] = []


def _mark_unpickled(what: str) -> str:
    _UNPICKLED.append(what)
    return what


class Hostile:
    """Unpickling it calls a function: the shape of a payload that runs code."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_mark_unpickled, ("ran",))


def test_hostile_skeleton_refused(redis_url: str, tmp_path: Path) -> None:
    io = KVCheckpointIO(redis_url)
    path = tmp_path / "hostile.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "hparams": {"x": Hostile()}}, path)
    _UNPICKLED.clear()
    for weights_only in (None, True):  # Lightning's default None counts as safe
        with pytest.raises(UnsafeObjectError) as e:
            io.load_checkpoint(path, weights_only=weights_only)
        message = str(e.value)
        assert "_mark_unpickled" in message and "weights_only" in message
        assert io.checkpoint_id(path) in message and redis_url in message
    assert _UNPICKLED == []
    # The caller's explicit opt-out (trainer.fit(..., weights_only=False)) is honoured.
    loaded = io.load_checkpoint(path, weights_only=False)
    assert loaded["hparams"]["x"] == "ran" and _UNPICKLED == ["ran"]


# -- with a Trainer --------------------------------------------------------------------------


class StartStep(Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step = trainer.global_step


def trainer(tmp_path: Path, max_steps: int, callbacks: list[Callback], **kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        **kw,
    )


def fit(t: L.Trainer, ckpt_path: str | None = None, net: type[Net] = Net) -> Net:
    L.seed_everything(0, verbose=False)
    model = net()
    t.fit(model, train_dataloaders=data(samples=8, shuffle=False), ckpt_path=ckpt_path)
    return model


def test_model_checkpoint_top_k_last_and_resume(store_url: str, tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"

    def checkpointing() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=ckpts,
            every_n_train_steps=2,
            save_top_k=2,
            monitor="step",
            mode="max",
            save_last=True,
        )

    fit(trainer(tmp_path, 8, [checkpointing()], plugins=[KVCheckpointIO(store_url)]))
    files = sorted(p.name for p in ckpts.iterdir())
    assert files == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    ids = sorted(i.checkpoint_id.split(".")[0] for i in list_checkpoints(store_url))
    assert ids == ["epoch=2-step=6", "epoch=3-step=8", "last"]  # steps 2 and 4 removed
    # save_last re-saved one id four times; it holds the newest.
    io = KVCheckpointIO(store_url)
    assert io.load_checkpoint(ckpts / "last.ckpt")["global_step"] == 8

    # ckpt_path="last" finds the pointer file; training goes on from step 8.
    start = StartStep()
    resumed = trainer(tmp_path, 10, [checkpointing(), start], plugins=[io])
    fit(resumed, ckpt_path="last")
    assert start.step == 8 and resumed.global_step == 10
    files = sorted(p.name for p in ckpts.iterdir())
    assert files == ["epoch=3-step=8.ckpt", "epoch=4-step=10.ckpt", "last.ckpt"]


def test_removing_a_last_link_leaves_the_linked_checkpoint(lmdb_url: str, tmp_path: Path) -> None:
    """``save_last="link"`` makes ``last`` a symlink to a top-k pointer file (or, where links
    are not available, a copy of it), and Lightning removes the previous ``last`` when its name
    changes ("{epoch}-last"): that removal must not delete the top-k checkpoint it points to."""
    io = KVCheckpointIO(lmdb_url)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    top = ckpts / "epoch=0-step=2.ckpt"
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, top)
    link, copied = ckpts / "0-last.ckpt", ckpts / "1-last.ckpt"
    os.symlink(top.name, link)
    shutil.copy(top, copied)
    io.remove_checkpoint(link)
    io.remove_checkpoint(copied)
    assert not link.exists() and not copied.exists() and top.exists()
    assert [i.checkpoint_id for i in list_checkpoints(lmdb_url)] == [io.checkpoint_id(top)]
    assert torch.equal(io.load_checkpoint(top)["w"], torch.ones(3))
    io.remove_checkpoint(top)  # its own pointer: the store's checkpoint goes too
    assert list_checkpoints(lmdb_url) == [] and not top.exists()


@pytest.mark.parametrize("kind", ["lmdb", "tiers"])
def test_callback_retention_async_and_auto_resume(
    kind: str, tmp_path: Path, lmdb_url: str, redis_url: str
) -> None:
    if kind == "lmdb":
        store: Any = lmdb_url
        stores = [lmdb_url]
    else:
        store = Tiers([lmdb_url, redis_url])
        stores = [lmdb_url, redis_url]
    files = tmp_path / "files"
    frequent = KVCheckpoint(store, every_n_train_steps=2, keep_last=2, async_save=True)
    # The user's own file checkpoints stay as they are (TorchCheckpointIO): every 3 steps.
    own = ModelCheckpoint(dirpath=files, every_n_train_steps=3, save_top_k=-1)
    first = trainer(tmp_path, 8, [frequent, own])
    fit(first)
    for url in stores:
        ids = sorted(i.checkpoint_id for i in list_checkpoints(url))
        assert ids == ["step-000000006", "step-000000008"], url
    assert sorted(p.name for p in files.iterdir()) == ["epoch=1-step=3.ckpt", "epoch=2-step=6.ckpt"]

    # The newest is the callback's step 8 (newer than the file of step 6).
    resume = auto_resume(frequent, ckpt_dir=files, pointer_dir=tmp_path / "resume")
    assert resume is not None and read_pointer(resume)["checkpoint_id"] == "step-000000008"
    start = StartStep()
    again = trainer(tmp_path, 10, [KVCheckpoint(store, every_n_train_steps=2), start])
    model = fit(again, ckpt_path=resume)
    assert start.step == 8 and again.global_step == 10
    # The same as training 10 steps at once.
    straight = trainer(tmp_path / "straight", 10, [])
    reference = fit(straight)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name

    # A file saved later than every store checkpoint wins.
    again.save_checkpoint(files / "manual.ckpt")
    assert auto_resume(frequent, ckpt_dir=files) == str(files / "manual.ckpt")


def test_callback_closes_the_tiers_it_builds(tmp_path: Path, lmdb_url: str, redis_url: str) -> None:
    """Given a list of stores, the callback builds a ``Tiers``: its copy thread ends at
    teardown, and a second fit with the same callback builds it again and keeps saving."""
    callback = KVCheckpoint([lmdb_url, redis_url], every_n_train_steps=2, keep_last=None)
    built = callback.tiers
    assert built is not None
    fit(trainer(tmp_path, 4, [callback]))
    assert callback.tiers is None
    assert not any(t.is_alive() for t in built._pool._threads)  # its copy thread ended
    fit(trainer(tmp_path / "again", 6, [callback]))
    assert callback.tiers is None
    for url in (lmdb_url, redis_url):
        ids = sorted(i.checkpoint_id for i in list_checkpoints(url))
        assert ids == [f"step-00000000{n}" for n in (2, 4, 6)], url


def test_async_save_error_reaches_the_training_loop(
    lmdb_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvckpt import KVCheckpointError, KVStorageWriter

    def fail(self: KVStorageWriter, *args: Any, **kwargs: Any) -> Any:
        raise OSError("disk on fire (injected)")

    monkeypatch.setattr(KVStorageWriter, "write_data", fail)
    frequent = KVCheckpoint(lmdb_url, every_n_train_steps=2, async_save=True)
    with pytest.raises(KVCheckpointError, match=r"'step-000000002'.*injected"):
        fit(trainer(tmp_path, 6, [frequent]))


def test_auto_resume_fresh_start_and_foreign_checkpoints(tmp_path: Path, redis_url: str) -> None:
    assert auto_resume(f"lmdb://{tmp_path / 'never-created'}") is None
    assert auto_resume([redis_url], ckpt_dir=tmp_path / "no-such-dir") is None
    # A plain DCP checkpoint in the same store is not a Lightning checkpoint: skipped.
    import torch.distributed.checkpoint as dcp

    from kvckpt import KVStorageWriter

    io = KVCheckpointIO(redis_url)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1)}, tmp_path / "a.ckpt")
    dcp.save({"x": torch.ones(1)}, storage_writer=KVStorageWriter(redis_url), checkpoint_id="dcp-1")
    choice = auto_resume(io, pointer_dir=tmp_path)
    assert choice is not None
    assert json.loads(Path(choice).read_text())["checkpoint_id"] == io.checkpoint_id(
        tmp_path / "a.ckpt"
    )


def test_import_kvckpt_does_not_import_lightning() -> None:
    code = (
        "import sys, kvckpt; print('lightning' in sys.modules, 'lightning.pytorch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.split() == ["False", "False"]


class WideNet(Net):
    """Net with a first layer of 256 KiB: values Redis keeps spares of."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 8192), torch.nn.Tanh(), torch.nn.Linear(8192, 1)
        )


class SparesAtEachStep(Callback):
    """The spare values (``keys.spare_key``) a Redis server holds as each step starts."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.seen: dict[int, set[str]] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        client = self.server.client()
        names = client.scan_iter(match=spare_prefix("kvckpt") + "*")
        self.seen[trainer.global_step] = {n.decode() for n in names}
        client.close()


def test_callback_gets_the_store_ready_after_the_first_step(
    tmp_path: Path, redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the first step that saves nothing, the callback gets its stores ready for the
    first save (``KVStorageWriter.get_ready``) from that step's state: an LMDB store is sized
    for the one process that saves (global rank 0, however many ranks the node runs), and a
    Redis server holds, before the first save, the spares of exactly the values it writes.
    Training is the same as without the callback."""
    import tempfile

    from kvckpt.engines.lmdb import LMDBEngine, close_idle_environments

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's: rank 0 still saves alone
    steps: list[tuple[str, Any]] = []
    get_ready, put_batch = LMDBEngine.get_ready, LMDBEngine._put_batch

    def ready(self: LMDBEngine, nbytes: int, copies: int | None, node_ranks: int | None = None):
        steps.append(("ready", (nbytes, copies, node_ranks)))
        return get_ready(self, nbytes, copies, node_ranks)

    def write(self: LMDBEngine, *args: Any, **kwargs: Any) -> Any:
        steps.append(("write", None))
        return put_batch(self, *args, **kwargs)

    monkeypatch.setattr(LMDBEngine, "get_ready", ready)
    monkeypatch.setattr(LMDBEngine, "_put_batch", write)
    shm = Path(tempfile.mkdtemp(prefix="kvckpt-test-lightning-", dir="/dev/shm"))
    try:
        lmdb_store = f"lmdb://{shm / 'store'}"
        callbacks: list[Callback] = [SparesAtEachStep(redis_server)]
        callbacks += [KVCheckpoint(url, every_n_train_steps=3) for url in (lmdb_store, redis_url)]
        model = fit(trainer(tmp_path, 4, callbacks), net=WideNet)
        close_idle_environments()
    finally:
        shutil.rmtree(shm, ignore_errors=True)

    # LMDB: ready after step 1, for rank 0's whole state, then again by the first save itself
    # before it wrote (each save does), both for the one process that saves.
    first_write = steps.index(("write", None))
    assert [s for s, _ in steps[:first_write]] == ["ready", "ready"], steps
    assert all(node_ranks == 1 for s, (_, _, node_ranks) in steps[:first_write])
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert steps[0][1][0] >= 3 * params  # the weights and AdamW's two moments
    # Redis: the spares the callback made after step 1 are those of the first save's tensors.
    spares = callbacks[0].seen  # type: ignore[attr-defined]
    assert spares[0] == set()
    client = redis_server.client()
    written = client.scan_iter(match=data_prefix("kvckpt", "step-000000003") + "*")
    # (the values Redis writes over spares: those of 64 KiB and more)
    first_save = {spare_key("kvckpt", k.decode()) for k in written if client.strlen(k) >= 1 << 16}
    client.close()
    assert spares[1] == spares[2] == first_save and len(first_save) == 3  # the weight, moments

    reference = fit(trainer(tmp_path / "without", 4, []), net=WideNet)
    for (name, a), (_, b) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
