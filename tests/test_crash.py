"""A writer SIGKILLed in the middle of a save: nothing committed is lost, nothing partial shows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    gc,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import read_index
from kvckpt.format import data_prefix

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigkill_mid_save(store_url: str) -> None:
    # LMDB commits its data in small transactions here so some partial data becomes visible.
    url = store_url + ("?txn_bytes=8MiB" if store_url.startswith("lmdb") else "?part_bytes=4MiB")
    good = {"w": torch.randn(1000), "step": 1}
    dcp.save(good, storage_writer=KVStorageWriter(url), checkpoint_id="good")
    engine = open_store(url)

    writer = subprocess.Popen(
        [sys.executable, "-m", "tests._writer", url, "victim", "48", "8"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    victim_data = data_prefix(engine.prefix, "victim")
    deadline = time.monotonic() + 120
    try:
        while True:
            assert writer.poll() is None, "the writer finished before it could be killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            pending = [
                p for p in read_index(engine).pending.values() if p["checkpoint_id"] == "victim"
            ]
            if pending and next(engine.scan(victim_data), None) is not None:
                break
            time.sleep(0.005)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    left = list(engine.scan(victim_data))
    assert left, "the kill should have left partial data behind"

    # The partial save is invisible to readers and to 'latest' ...
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["good"]
    assert latest_checkpoint(url) == "good"
    incomplete = [i for i in list_checkpoints(url, include_incomplete=True) if not i.complete]
    assert [i.checkpoint_id for i in incomplete] == ["victim"]
    # ... the previous checkpoint loads bit-exact ...
    out = {"w": torch.zeros(1000), "step": 0}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="good")
    assert torch.equal(out["w"], good["w"]) and out["step"] == 1
    # ... and gc removes every key the killed save left.
    report = gc(url, incomplete_older_than=0)
    assert report.deleted_keys == len(left)
    assert list(engine.scan(victim_data)) == []
    assert list_checkpoints(url, include_incomplete=True)[0].checkpoint_id == "good"
    # The next save of that id works.
    dcp.save({"w": torch.ones(3)}, storage_writer=KVStorageWriter(url), checkpoint_id="victim")
    assert latest_checkpoint(url) == "victim"
