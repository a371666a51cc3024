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
from kvckpt.keys import data_prefix

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
    assert_recovered_from_killed_save(url, good)


def assert_recovered_from_killed_save(url: str, good: dict) -> None:
    """After a save of 'victim' was killed mid-write, with 'good' committed before it."""
    engine = open_store(url)
    victim_data = data_prefix(engine.prefix, "victim")
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
    # The next save of that id works (gc released the dead writer's lease).
    dcp.save({"w": torch.ones(3)}, storage_writer=KVStorageWriter(url), checkpoint_id="victim")
    assert latest_checkpoint(url) == "victim"


def test_sigkill_one_rank_of_a_two_rank_save(store_url: str) -> None:
    """Rank 1 of 2 dies mid-save (the job then goes down, as torchrun takes it down)."""
    from kvckpt.testing import free_port

    url = store_url + ("?txn_bytes=8MiB" if store_url.startswith("lmdb") else "?part_bytes=4MiB")
    good = {"w": torch.randn(1000), "step": 1}
    dcp.save(good, storage_writer=KVStorageWriter(url), checkpoint_id="good")
    engine = open_store(url)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._rank_writer", str(r), "2", port, url, "victim"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    victim_data = data_prefix(engine.prefix, "victim")
    deadline = time.monotonic() + 120
    try:
        while True:
            assert all(p.poll() is None for p in ranks), "the job ended before the kill"
            assert time.monotonic() < deadline, "rank 1 never started writing"
            if any(key.split("/")[4] == "1" for key in engine.scan(victim_data)):
                break
            time.sleep(0.005)
        os.kill(ranks[1].pid, signal.SIGKILL)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert_recovered_from_killed_save(url, good)
