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


def mount_tmpfs(mnt: Path, size_mib: int) -> Iterator[Path]:
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "small", 16)


@pytest.fixture
def fs_256m(tmp_path: Path) -> Iterator[Path]:
    """Big enough for saves that take the multi-threaded MADV_POPULATE_WRITE path (>= 64 MiB)."""
    yield from mount_tmpfs(tmp_path / "fs256", 256)


def sd(mib: int, value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MIB // 4,), value)}


SAVE_TOO_BIG = """
import sys, torch, torch.distributed.checkpoint as dcp
from kvckpt import KVStorageWriter
try:
    dcp.save({"w": torch.ones(int(sys.argv[2]) << 18)},
             storage_writer=KVStorageWriter(sys.argv[1]), checkpoint_id="big")
except BaseException as e:
    print(str(e))
    sys.exit(3)
"""


def save_too_big_in_a_child(url: str, mib: int) -> str:
    """Save ``mib`` MiB in a child process, where SIGBUS would kill it (rc -7) instead of it
    printing an error; assert it got StoreFullError and return what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", SAVE_TOO_BIG, url, str(mib)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert "StoreFullError" in done.stdout and "no space left" in done.stdout
    return done.stdout


@pytest.mark.parametrize("writemap", [1, 0])
def test_filesystem_full_is_a_clear_error(small_fs: Path, writemap: int) -> None:
    url = f"lmdb://{small_fs / 'store'}?writemap={writemap}"
    dcp.save(sd(4, 1.0), storage_writer=KVStorageWriter(url), checkpoint_id="ok")

    printed = save_too_big_in_a_child(url, 32)
    assert str(small_fs / "store") in printed and "keep-last" in printed

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


POPULATE_PAST_THE_END = """
import mmap, os, sys
from kvckpt.engines.lmdb import _populate_write
path = os.path.join(sys.argv[1], "data.mdb")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 512 << 20)  # sparse: twice what the filesystem holds
mm = mmap.mmap(fd, 512 << 20)
print(_populate_write(path, 0, 512 << 20))
"""


def test_populating_more_than_the_filesystem_holds_fails_cleanly(fs_256m: Path) -> None:
    """MADV_POPULATE_WRITE into a tmpfs without room reports failure (EFAULT); it must not
    kill the process with SIGBUS, as a write into such a page would (in a child: rc -7)."""
    done = subprocess.run(
        [sys.executable, "-c", POPULATE_PAST_THE_END, str(fs_256m)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("reserve", [True, False])
def test_big_saves_on_tmpfs_allocate_their_pages_first_and_still_fail_cleanly(
    fs_256m: Path, monkeypatch: pytest.MonkeyPatch, reserve: bool
) -> None:
    """A save of >= 64 MiB on a tmpfs with room allocates its pages before LMDB writes: with
    ``fallocate`` where kvckpt writes the values into reserved room itself (through the file
    and the map, ``fill_new_pages``), with MADV_POPULATE_WRITE in several threads where LMDB's
    put copies them. One without room still gets StoreFullError."""
    from kvckpt.engines import _lmdb_reserve
    from kvckpt.engines import lmdb as lmdb_engine

    if reserve and not _lmdb_reserve.usable():
        pytest.skip("py-lmdb's put cannot reserve on this platform")
    if not reserve:
        monkeypatch.setattr(_lmdb_reserve, "_engines", {})  # KVCKPT_LMDB_RESERVE=0
    assert lmdb_engine._on_tmpfs(str(fs_256m / "store"))
    populated: list[bool] = []
    fallocated: list[int] = []
    written_new: list[int] = []
    populate, fallocate = lmdb_engine._populate_write, os.posix_fallocate
    fill_new = lmdb_engine.fill_new_pages

    def spy_populate(*args: object) -> bool:
        populated.append(populate(*args))  # type: ignore[arg-type]
        return populated[-1]

    def spy_fallocate(fd: int, offset: int, length: int) -> None:
        fallocated.append(length)
        fallocate(fd, offset, length)

    def spy_fill_new(sources: list[memoryview], *args: object) -> None:
        written_new.append(sum(s.nbytes for s in sources))
        fill_new(sources, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(lmdb_engine, "_populate_write", spy_populate)
    monkeypatch.setattr(os, "posix_fallocate", spy_fallocate)
    monkeypatch.setattr(lmdb_engine, "fill_new_pages", spy_fill_new)
    url = f"lmdb://{fs_256m / 'store'}"
    dcp.save(sd(80, 1.0), storage_writer=KVStorageWriter(url), checkpoint_id="a")
    if reserve:
        assert not populated and sum(written_new) > 79 * MIB  # (the last part is small)
        assert max(fallocated) >= 80 * MIB
    else:
        assert populated and all(populated) and not written_new
        assert all(n < 64 * MIB for n in fallocated)  # only the small writes (metadata)
    monkeypatch.undo()
    data = fs_256m / "store" / "data.mdb"
    assert data.stat().st_blocks * 512 >= 80 * MIB  # the pages exist in the filesystem
    out = sd(80, 0.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="a"))
    assert torch.equal(out["w"], sd(80, 1.0)["w"])

    save_too_big_in_a_child(url, 200)
    assert latest_checkpoint(url) == "a"
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="a"))
    assert torch.equal(out["w"], sd(80, 1.0)["w"])


def test_on_tmpfs() -> None:
    from kvckpt.engines.lmdb import _on_tmpfs

    assert not _on_tmpfs("/proc/self")
    if Path("/dev/shm").is_dir() and "tmpfs" in Path("/proc/mounts").read_text():
        assert _on_tmpfs("/dev/shm/kvckpt-not-created-yet/store") == any(
            line.split()[1:3] == ["/dev/shm", "tmpfs"]
            for line in Path("/proc/mounts").read_text().splitlines()
        )
