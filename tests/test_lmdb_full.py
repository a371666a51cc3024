"""LMDB on a small filesystem that fills up: a clear error, never SIGBUS, nothing lost.

The store lives on a 16 MiB tmpfs mounted by the test (it needs root, as on CI; skipped
otherwise). With ``writemap`` LMDB would store into map pages the filesystem has no room for and
the kernel would kill the process with SIGBUS; kvckpt allocates the pages first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, gc, latest_checkpoint, list_checkpoints

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def sd(mib: int, value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MIB // 4,), value)}


SAVE_TOO_BIG = """
import sys, torch, torch.distributed.checkpoint as dcp
from kvckpt import KVStorageWriter
try:
    dcp.save({"w": torch.ones(32 << 18)}, storage_writer=KVStorageWriter(sys.argv[1]),
             checkpoint_id="big")
except BaseException as e:
    print(str(e))
    sys.exit(3)
"""


@pytest.mark.parametrize("writemap", [1, 0])
def test_filesystem_full_is_a_clear_error(small_fs: Path, writemap: int) -> None:
    url = f"lmdb://{small_fs / 'store'}?writemap={writemap}"
    dcp.save(sd(4, 1.0), storage_writer=KVStorageWriter(url), checkpoint_id="ok")

    # In a child process: SIGBUS would kill it (rc -7) instead of it printing an error.
    done = subprocess.run(
        [sys.executable, "-c", SAVE_TOO_BIG, url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "StoreFullError" in done.stdout and "no space left" in done.stdout
    assert str(small_fs / "store") in done.stdout and "keep-last" in done.stdout

    # The committed checkpoint is intact and still the latest; the failed one never appears.
    assert latest_checkpoint(url) == "ok"
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["ok"]
    out = sd(4, 0.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="ok"))
    assert torch.equal(out["w"], sd(4, 1.0)["w"])

    # After gc the store takes saves that fit again.
    gc(url, incomplete_older_than=0)
    dcp.save(sd(2, 3.0), storage_writer=KVStorageWriter(url), checkpoint_id="next")
    assert latest_checkpoint(url) == "next"
