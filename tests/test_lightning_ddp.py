"""Lightning DDP (2 CPU ranks under torchrun, gloo) killed mid-training with SIGKILL and resumed
from the store through ``auto_resume``: the final parameters, optimizer and scheduler state are
bit-identical to a run that was never interrupted, for LMDB and Redis.

tests/_lightning_train.py says why the resume can be exact (epoch-end checkpoints, data a pure
function of the epoch)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from kvckpt import list_checkpoints
from kvckpt.testing import torchrun_command

SCRIPT = Path(__file__).resolve().parent / "_lightning_train.py"
STEPS, KILL_AT = 12, 7


def train(tmp: Path, store: str, *extra: str, ok: bool = True) -> list[dict[str, Any]]:
    cmd = torchrun_command(
        SCRIPT,
        "--store",
        store,
        "--ckpt-dir",
        str(tmp / "ckpts"),
        "--events",
        str(tmp / "events.jsonl"),
        "--out",
        str(tmp / "final.pt"),
        "--steps",
        str(STEPS),
        *extra,
    )
    done = subprocess.run(
        cmd,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if ok:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    else:
        assert done.returncode != 0, "the run was meant to be killed"
    events = tmp / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def assert_equal(a: Any, b: Any, where: str = "final") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("lightning-reference")
    events = train(tmp, f"lmdb://{tmp / 'store'}")
    assert {e["step"] for e in events if e["event"] == "start"} == {0}
    return torch.load(tmp / "final.pt", weights_only=True)


@pytest.mark.parametrize("kind", ["lmdb", "redis, async save"])
def test_ddp_killed_and_resumed_bit_exact(
    kind: str, reference: dict[str, Any], tmp_path: Path, redis_url: str
) -> None:
    store = f"lmdb://{tmp_path / 'store'}" if kind == "lmdb" else redis_url
    extra = ["--async-save"] if "async" in kind else []
    killed = train(tmp_path, store, "--kill-at", str(KILL_AT), *extra, ok=False)
    assert not any(e["event"] == "end" for e in killed)
    assert not (tmp_path / "final.pt").exists()
    (tmp_path / "events.jsonl").unlink()

    # What the crash left: the callback's checkpoints up to step 6 (step 6 possibly not
    # committed when it was written in the background), ModelCheckpoint's step 4 and last.
    ids = {i.checkpoint_id for i in list_checkpoints(store)}
    assert "step-000000004" in ids
    assert any(i.startswith("last.") for i in ids)
    assert any(i.startswith("epoch=1-step=4.") for i in ids)

    events = train(tmp_path, store, "--resume", *extra)
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2 and len({(e["step"], e["resumed_from"]) for e in starts}) == 1
    assert starts[0]["step"] in (4, 6) and starts[0]["resumed_from"]
    if kind == "lmdb":  # saved synchronously: step 6 committed before the kill
        assert starts[0]["step"] == 6
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["global_step"] == reference["global_step"] == STEPS
    assert_equal(final, reference)

    # Retention: the callback kept its newest two; ModelCheckpoint kept its newest one and last.
    ids = sorted(i.checkpoint_id for i in list_checkpoints(store))
    mine = [i for i in ids if i.startswith("step-")]
    assert mine == ["step-000000010", "step-000000012"]
    others = sorted(i.split(".")[0] for i in ids if not i.startswith("step-"))
    assert others == ["epoch=5-step=12", "last"]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "epoch=5-step=12.ckpt",
        "last.ckpt",
    ]
