"""Two writers of one checkpoint id, and readers during an overwrite, as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    gc,
    latest_checkpoint,
    open_store,
)
from kvckpt.catalog import _lease_value, lease_key, read_index
from kvckpt.keys import data_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_second_writer_of_the_same_id_fails_fast(store_url: str) -> None:
    url = store_url + ("?txn_bytes=8MiB" if store_url.startswith("lmdb") else "")
    engine = open_store(url)
    first = subprocess.Popen(
        [sys.executable, "-m", "tests._writer", url, "shared", "64", "8"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(p["checkpoint_id"] == "shared" for p in read_index(engine).pending.values()):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        started = time.monotonic()
        with pytest.raises(BaseException) as info:
            dcp.save(
                {"w": torch.ones(4)}, storage_writer=KVStorageWriter(url), checkpoint_id="shared"
            )
        assert time.monotonic() - started < 5, "the second writer must fail fast"
        assert "CheckpointLockedError" in str(info.value) and "another writer" in str(info.value)
    finally:
        assert first.wait(120) == 0
    # The first save committed whole; the id is free again.
    assert latest_checkpoint(url) == "shared"
    out = {f"t{i}": torch.zeros(8 << 18) for i in range(64)}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="shared")
    assert all(torch.equal(out[f"t{i}"], torch.full((8 << 18,), float(i))) for i in range(64))
    dcp.save({"w": torch.ones(4)}, storage_writer=KVStorageWriter(url), checkpoint_id="shared")


def test_a_crashed_writers_lease_expires(store_url: str) -> None:
    engine = open_store(store_url)
    key = lease_key(engine.prefix, "c")
    engine.transact([key], lambda _: {key: _lease_value("d" * 32, time.time() + 30)})
    with pytest.raises(BaseException, match="being saved by another writer"):
        dcp.save({"w": torch.ones(2)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="c")
    engine.transact([key], lambda _: {key: _lease_value("d" * 32, time.time() - 1)})
    dcp.save({"w": torch.ones(2)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="c")
    assert engine.get(key) is None  # the commit released the new save's lease


def test_failed_save_releases_its_lease(lmdb_url: str) -> None:
    class Boom:
        def __reduce__(self):
            raise RuntimeError("cannot serialize")

    with pytest.raises(BaseException, match="cannot serialize"):
        dcp.save(
            {"w": torch.ones(2), "bad": Boom()},
            storage_writer=KVStorageWriter(lmdb_url),
            checkpoint_id="c",
        )
    dcp.save({"w": torch.ones(2)}, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="c")


READER = """
import sys, warnings, torch
warnings.filterwarnings("ignore")
import torch.distributed.checkpoint as dcp
from kvckpt import KVStorageReader
url, n = sys.argv[1], int(sys.argv[2])
seen = set()
for _ in range(n):
    sd = {f"t{i}": torch.zeros(4096) for i in range(16)}
    # The reader's lease keeps the save it found whole until it is done: no errors at all.
    dcp.load(sd, storage_reader=KVStorageReader(url), checkpoint_id="hot")
    values = {float(t[0]) for t in sd.values()}
    assert len(values) == 1, f"a mix of saves: {sorted(values)}"
    assert all(torch.equal(t, torch.full((4096,), t[0].item())) for t in sd.values())
    seen.add(values.pop())
print(len(seen))
"""


def test_readers_during_overwrites_see_one_whole_save(store_url: str) -> None:
    def save(version: float) -> None:
        dcp.save(
            {f"t{i}": torch.full((4096,), version) for i in range(16)},
            storage_writer=KVStorageWriter(store_url),
            checkpoint_id="hot",
        )

    save(0.0)
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, store_url, "150"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    version = 1.0
    while reader.poll() is None:
        save(version)
        version += 1
    out, err = reader.communicate()
    assert reader.returncode == 0, err[-3000:]
    versions_seen = int(out.split()[0])
    assert versions_seen >= 1


def test_a_save_gc_took_for_crashed_fails_and_the_old_checkpoint_stays(store_url: str) -> None:
    """``gc(incomplete_older_than=0)`` while a save writes (a restart's cleanup racing this
    process's own background copy, say): the save must fail at commit rather than publish
    metadata whose data gc deleted, and the checkpoint it was replacing still loads."""
    dcp.save({"w": torch.ones(64)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="c")
    engine = open_store(store_url)
    old = read_index(engine).checkpoints["c"]["save_id"]

    class CleanupMidSave(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            report = gc(store_url, incomplete_older_than=0, scan_orphans=False)
            assert report.removed_incomplete, "the save in progress was pending"
            return super().resolve_data(write_item)

    with pytest.raises(BaseException, match="removed as incomplete") as info:
        dcp.save(
            {"w": torch.full((64,), 2.0)},
            storage_writer=KVStorageWriter(store_url),
            checkpoint_id="c",
            planner=CleanupMidSave(),
        )
    assert "SaveAbandonedError" in repr(info.value) or "SaveAbandonedError" in str(info.value)
    out = {"w": torch.zeros(64)}
    dcp.load(out, storage_reader=KVStorageReader(store_url), checkpoint_id="c")
    assert torch.equal(out["w"], torch.ones(64))
    index = read_index(engine)
    assert index.checkpoints["c"]["save_id"] == old and not index.pending
    # The failed save cleaned up after itself: only the old save's data is left.
    assert {k.split("/")[3] for k in engine.scan(data_prefix(engine.prefix))} == {old}
    dcp.save(
        {"w": torch.full((64,), 3.0)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="c"
    )
