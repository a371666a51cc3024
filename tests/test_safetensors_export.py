"""Export to Hugging Face safetensors: consolidated full tensors, shards and their index, read
back with the safetensors library itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file

from kvckpt import (
    IntegrityError,
    KVCheckpointError,
    KVStorageReader,
    KVStorageWriter,
    UnwritablePathError,
    export_safetensors,
    open_store,
)
from kvckpt.safetensors_export import INDEX_NAME
from tests import _dist
from tests._spawn import spawn

from ._cli import run


def read_back(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, found through its index as ``transformers`` finds them."""
    index = json.loads((directory / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out |= load_file(directory / name)
    assert set(out) == set(index["weight_map"])
    assert all(index["weight_map"][k] for k in out)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in out.values()
    )
    return out


def training_state() -> dict:
    g = torch.Generator().manual_seed(7)
    model = {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layers.0.attn.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(128, 32, generator=g),
        "layers.0.mlp.bias": torch.randn(128, generator=g),
        "norm.weight": torch.ones(32),
        "position_ids": torch.arange(16),
        "mask": torch.tensor([True, False, True]),
    }
    optimizer = {"state": {"exp_avg": torch.randn(64, 32, generator=g)}, "step": 3}
    return {"model": model, "optimizer": optimizer}


def test_model_weights_come_out_whole_and_bit_exact(store_url: str, tmp_path: Path) -> None:
    state = training_state()
    dcp.save(state, storage_writer=KVStorageWriter(store_url, checksums=True), checkpoint_id="s")
    out = export_safetensors(store_url, "s", tmp_path / "hf", max_shard_bytes=12_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = read_back(out)
    assert set(got) == set(state["model"])  # the optimizer's state is left out
    for name, want in state["model"].items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    with safe_open(str(out / files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_keys_and_dtype_can_be_chosen(store_url: str, tmp_path: Path) -> None:
    state = training_state()
    dcp.save(state, storage_writer=KVStorageWriter(store_url), checkpoint_id="s")
    out = export_safetensors(
        store_url, "s", tmp_path / "hf", include=r"^layers\.", dtype="bfloat16"
    )
    got = read_back(out)
    assert set(got) == {"layers.0.attn.weight", "layers.0.mlp.weight", "layers.0.mlp.bias"}
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, state["model"][name].to(torch.bfloat16)), name
    # prefix "": every tensor, under its own name; integers keep their dtype
    every = read_back(
        export_safetensors(store_url, "s", tmp_path / "all", prefix="", dtype=torch.float16)
    )
    assert "optimizer.state.exp_avg" in every and "model.embed.weight" in every
    assert every["model.position_ids"].dtype == torch.int64
    assert every["model.embed.weight"].dtype == torch.float16


def test_a_checkpoint_saved_sharded_over_2_ranks_exports_full_tensors(
    store_url: str, tmp_path: Path
) -> None:
    spawn(_dist.save_worker, 2, store_url, "fsdp")
    got = read_back(export_safetensors(store_url, "fsdp", tmp_path / "hf", prefix=""))
    want = _dist.expected()
    assert set(got) == set(want)  # the object item "obj" has no place in safetensors
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_bad_requests_and_corruption_leave_nothing(lmdb_url: str, tmp_path: Path) -> None:
    dcp.save(
        training_state(),
        storage_writer=KVStorageWriter(lmdb_url, checksums=True),
        checkpoint_id="s",
    )
    with pytest.raises(KVCheckpointError, match=r"no tensor under 'weights\.'.*prefix=''"):
        export_safetensors(lmdb_url, "s", tmp_path / "a", prefix="weights.")
    with pytest.raises(ValueError, match="not a floating-point torch dtype"):
        export_safetensors(lmdb_url, "s", tmp_path / "a", dtype="int8")
    assert not (tmp_path / "a").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UnwritablePathError, match="the directory is not empty; choose a new"):
        export_safetensors(lmdb_url, "s", tmp_path / "full")
    engine = open_store(lmdb_url)
    record = KVStorageReader(engine, checkpoint_id="s").read_record()
    (loc,) = [loc for i, loc in record.locations.items() if i.fqn == "model.layers.0.mlp.bias"]
    (key,) = loc.keys(engine.prefix, "s", record.save_id)
    engine.put_many([(key, b"x" * loc.nbytes)])
    with pytest.raises(IntegrityError, match="does not match the checksum"):
        export_safetensors(lmdb_url, "s", tmp_path / "b", max_shard_bytes=12_000)
    assert not (tmp_path / "b").exists(), key


def test_cli_export_safetensors(lmdb_url: str, tmp_path: Path) -> None:
    state = training_state()
    dcp.save(state, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="s")
    out = tmp_path / "hf"
    result = run(
        "export",
        lmdb_url,
        "s",
        str(out),
        "--format",
        "safetensors",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "10KB",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "checkpoint_id": "s",
        "directory": str(out),
        "format": "safetensors",
    }
    got = read_back(out)
    assert torch.equal(got["embed.weight"], state["model"]["embed.weight"].to(torch.bfloat16))
    bad = run(
        "export",
        lmdb_url,
        "s",
        str(tmp_path / "x"),
        "--format",
        "safetensors",
        "--max-shard-size",
        "lots",
    )
    assert bad.returncode != 0 and "not a size" in bad.stderr


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) << 10
    return 0


def test_peak_memory_stays_near_the_largest_tensor(tmp_path: Path) -> None:
    """A 384 MiB model whose largest tensor is 16 MiB, written in bfloat16: the export holds at
    most one largest tensor's bytes of it at a time (sampled as anonymous RSS, which the
    store's mapped pages are not), not the model."""
    import gc
    import threading
    import time

    url = f"lmdb://{tmp_path / 'store'}"
    model = {f"w{i}": torch.full((2 << 20,), float(i)) for i in range(44)}  # 8 MiB each
    model["big"] = torch.ones(4 << 20)  # 16 MiB
    dcp.save({"model": model}, storage_writer=KVStorageWriter(url), checkpoint_id="big")
    del model
    gc.collect()
    base = peak = _rss_anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = export_safetensors(url, "big", tmp_path / "hf", dtype="bfloat16")
    finally:
        done.set()
        sampler.join()
    largest = 16 << 20
    assert peak - base <= 1.1 * largest, f"{(peak - base) / (1 << 20):.1f} MiB above the start"
    got = read_back(out)
    assert torch.equal(got["w43"], torch.full((2 << 20,), 43.0, dtype=torch.bfloat16))
    assert got["big"].dtype == torch.bfloat16
