"""Tiers against real stores: LMDB first, a real redis-server second, a DCP directory third."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    DirectoryReader,
    KVStorageReader,
    KVStorageWriter,
    ReplicationError,
    Restore,
    Tiers,
    UnsafeObjectError,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import read_index
from kvckpt.keys import data_prefix
from kvckpt.testing import RedisServer
from tests import _dist
from tests._spawn import spawn
from tests.conftest import free_port


def sd(value: float) -> dict[str, object]:
    return {
        "w": torch.full((1 << 18,), value),  # 1 MiB: several parts at a small part size
        "b": torch.arange(10, dtype=torch.int64) + int(value),
        "step": int(value),
    }


def same(a: dict, b: dict) -> bool:
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_save_copies_to_every_tier_and_restores_from_the_fastest(
    tmp_path: Path, redis_url: str
) -> None:
    local = f"lmdb://{tmp_path / 'node0'}"
    redis = redis_url + "?part_bytes=256KiB"
    tiers = Tiers([local, redis], durable=tmp_path / "durable", durable_every=2, keep_last=2)
    assert tiers.part_bytes == 256 << 10
    for step in range(4):
        dcp.save(sd(float(step)), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}")
        # each copy done before the next save: its keep_last may then drop the copied one
        # (one still being copied stays until the save after it is done)
        tiers.wait()

    # Both stores hold the same newest checkpoints (keep_last applies to each), under the same
    # save id and commit time; the durable directory holds every 2nd.
    for url in (local, redis):
        assert [i.checkpoint_id for i in list_checkpoints(url)] == ["step-3", "step-2"]
    assert [i.save_id for i in list_checkpoints(local)] == [
        i.save_id for i in list_checkpoints(redis)
    ]
    assert [i.created_at for i in list_checkpoints(local)] == [
        i.created_at for i in list_checkpoints(redis)
    ]
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == ["step-1", "step-3"]
    # Nothing pending or retired is left behind in the replica.
    index = read_index(open_store(redis))
    assert index.pending == {} and index.retired == {}

    # A restart on the same node: the local tier.
    out = sd(0.0)
    choice = tiers.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-3", 0)
    assert same(out, sd(3.0))

    # The node is replaced: its local store is empty, so the shared Redis serves the restore.
    fresh = Tiers([f"lmdb://{tmp_path / 'node1'}", redis], durable=tmp_path / "durable")
    out = sd(0.0)
    choice = fresh.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-3", 1)
    assert same(out, sd(3.0))

    # Redis lost everything too: the durable directory (through the restricted reader).
    open_store(redis).delete_prefix("")
    assert latest_checkpoint(redis) is None
    out = sd(0.0)
    choice = fresh.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-3", 2)
    assert same(out, sd(3.0))
    tiers.close()
    fresh.close()


def test_nothing_anywhere_is_a_fresh_start(tmp_path: Path, redis_url: str) -> None:
    tiers = Tiers([f"lmdb://{tmp_path / 'a'}", redis_url], durable=tmp_path / "d")
    assert tiers.latest() is None and tiers.restore(sd(0.0)) is None


def test_unreachable_replica_does_not_fail_the_save(tmp_path: Path) -> None:
    local = f"lmdb://{tmp_path / 'node'}"
    down = f"redis://:secret@127.0.0.1:{free_port()}/0?socket_connect_timeout=0.5"
    tiers = Tiers([local, down])
    dcp.save(sd(1.0), storage_writer=tiers.writer(), checkpoint_id="step-1")
    assert latest_checkpoint(local) == "step-1"  # the fast tier committed
    with pytest.raises(ReplicationError, match="step-1") as info:
        tiers.wait()
    assert "secret" not in str(info.value) and "cannot reach Redis" in str(info.value)
    tiers.wait()  # reported once


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own (it is restarted), stopped even if the test fails."""
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


def test_one_failed_copy_is_counted_once(tmp_path: Path, server: RedisServer) -> None:
    """A copy that fails (the replica has no room) fails its commit job too; wait() counts
    the one checkpoint's failure once."""
    client = server.client()
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (256 << 10))
    client.close()
    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, server.url()])
    dcp.save(sd(1.0), storage_writer=tiers.writer(), checkpoint_id="step-1")  # 1 MiB
    with pytest.raises(ReplicationError) as info:
        tiers.wait()
    assert str(info.value).startswith("1 background copy failed; the first: "), info.value
    assert "step-1" in str(info.value)
    tiers.wait()  # reported once
    tiers.close()


def test_replica_restarted_mid_copy_never_shows_a_partial_checkpoint(
    tmp_path: Path, server: RedisServer
) -> None:
    url = server.url(part_bytes="64KiB")
    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, url], replicate_timeout=3)
    big = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(32)}  # 128 MiB
    dcp.save(big, storage_writer=tiers.writer(), checkpoint_id="step-1")
    # The copy runs in the background for a few hundred ms more: restart the replica under
    # it, losing (no persistence) every key copied so far. Depending on where the copy was,
    # the batch in flight is resent and earlier ones are lost (no commit, an error), or
    # nothing was acknowledged yet and everything arrives after the restart (a whole commit),
    # or the copy's retries ran out while the server was down (no commit, an error).
    server.proc.kill()
    server.proc.wait()
    server.start()
    try:
        tiers.wait()
    except ReplicationError as e:
        # The restart took the copy's pending entry with it: its commit is refused.
        reasons = ("never reached", "cannot reach Redis", "store lost its memory")
        assert any(r in str(e) for r in reasons), e
        assert list_checkpoints(url) == []  # no commit of what did not arrive whole
        # ... and the failed copy left nothing behind: no data, no pending entry, no lease.
        replica = open_store(url)
        assert list(replica.scan(data_prefix(replica.prefix, "step-1"))) == []
        assert read_index(replica).pending == {}
        assert list(replica.scan("{kvckpt}/lease/")) == []
    else:
        out = {k: torch.zeros_like(v) for k, v in big.items()}
        dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="step-1"))
        assert all(torch.equal(out[k], v) for k, v in big.items())
    assert latest_checkpoint(local) == "step-1"  # the fast tier is unaffected


def test_two_ranks_copy_their_own_data(tmp_path: Path, redis_url: str) -> None:
    local = f"lmdb://{tmp_path / 'node'}"
    spawn(_dist.tiered_worker, 2, local, redis_url)
    # The replica's checkpoint holds both ranks' data and loads at another world size.
    assert latest_checkpoint(redis_url) == "tiered"
    _dist.load_single_process(redis_url, "tiered")
    engine = open_store(redis_url)
    ranks = {k.split("/")[-3] for k in engine.scan(data_prefix(engine.prefix, "tiered"))}
    assert ranks == {"0", "1"}


def test_directory_reader_refuses_unsafe_objects(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    dcp.save({"x": torch.ones(2), "obj": Evil()}, checkpoint_id=tmp_path / "ckpt")
    with pytest.raises(BaseException, match="weights_only") as info:
        dcp.load(
            {"x": torch.zeros(2), "obj": None},
            storage_reader=DirectoryReader(tmp_path / "ckpt"),
        )
    assert "UnsafeObjectError" in str(info.value) or isinstance(info.value, UnsafeObjectError)


def test_restore_never_takes_an_older_save_of_the_newest_id(tmp_path: Path, redis_url: str) -> None:
    # A faster tier can hold an older save under the newest checkpoint's id (its copy of the
    # newer save failed, or, as here, the newer save went to a slower tier only): restore takes
    # the newest save, from whichever tier holds that save.
    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url])
    dcp.save(sd(1.0), storage_writer=tiers.writer(), checkpoint_id="latest")
    tiers.wait()
    dcp.save(sd(2.0), storage_writer=KVStorageWriter(redis_url), checkpoint_id="latest")
    out = sd(0.0)
    choice = tiers.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("latest", 1)
    assert same(out, sd(2.0))
    tiers.close()


def test_keep_last_waits_for_copies_still_in_flight(tmp_path: Path, redis_url: str) -> None:
    # The background thread is held up (a slow copy) while three saves commit with keep_last=1:
    # their copies and durable exports still find every checkpoint in the first tier, and
    # retention catches up at the first save after they are done.
    import threading

    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url], durable=tmp_path / "durable", keep_last=1)
    gate = threading.Event()
    tiers._pool.submit(gate.wait)  # the copy thread is busy until the gate opens
    for step in range(3):
        dcp.save(sd(float(step)), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}")
    assert tiers.busy_ids() == {"step-0", "step-1", "step-2"}
    assert len(list_checkpoints(local)) == 3  # nothing copied yet, so nothing deleted yet
    gate.set()
    tiers.wait()  # no copy or export failed
    assert tiers.busy_ids() == set()
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == [
        "step-0",
        "step-1",
        "step-2",
    ]
    out = sd(0.0)
    dcp.load(out, storage_reader=DirectoryReader(tmp_path / "durable" / "step-0"))
    assert same(out, sd(0.0))
    dcp.save(sd(3.0), storage_writer=tiers.writer(), checkpoint_id="step-3")
    tiers.wait()
    for url in (local, redis_url):
        assert [i.checkpoint_id for i in list_checkpoints(url)] == ["step-3"]
    tiers.close()


def test_restore_is_documented() -> None:
    """Restore and its fields are documented, and the module's example uses the Restore that
    ``tiers.restore(...)`` returns."""
    import dataclasses

    import kvckpt.tiered

    readme = (Path(__file__).parent.parent / "docs" / "TIERS.md").read_text()
    assert "kvckpt.Restore" in readme
    for field in dataclasses.fields(Restore):
        assert f"{field.name}:" in (Restore.__doc__ or ""), field.name
        assert f"`{field.name}`" in readme, field.name
    assert "step = tiers.restore(" not in (kvckpt.tiered.__doc__ or "")


_QUIET_SCRIPT = """
import sys
import warnings
import torch
import torch.distributed.checkpoint as dcp
import kvckpt

# DCP's own notice that it saves in a single process (torch.distributed not initialised)
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

a, b = sys.argv[1:]
tiers = kvckpt.Tiers([f"lmdb://{a}", f"lmdb://{b}"])
state = {"w": torch.rand(1 << 19), "m": torch.rand(64, 64), "step": 3}  # 2 MiB: parallel copy
dcp.save(state, storage_writer=tiers.writer(), checkpoint_id="step-3")
tiers.wait()
for url in (f"lmdb://{a}", f"lmdb://{b}"):
    out = {"w": torch.zeros(1 << 19), "m": torch.zeros(64, 64).t(), "step": 0}  # m: staged
    reader = kvckpt.KVStorageReader(url, checkpoint_id="step-3")
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["m"], state["m"])
tiers.close()
print("done")
"""


def test_background_copies_and_loads_print_no_warnings(tmp_path: Path) -> None:
    """Background copies and loads print no UserWarning (torch's "The given buffer is not
    writable" comes once per process, so this runs in a process of its own)."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _QUIET_SCRIPT, str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    assert "Warning" not in done.stderr, done.stderr


def test_a_new_tiers_does_not_restore_from_a_wiped_node_store(
    tmp_path: Path, redis_url: str
) -> None:
    """Once the node-local directory is removed, a new Tiers in the same process never
    restores from the old LMDB environment, still mapped."""
    import shutil

    node = tmp_path / "node"
    first = Tiers([f"lmdb://{node}", redis_url])
    dcp.save(sd(1.0), storage_writer=first.writer(), checkpoint_id="step-1")
    first.wait()
    shutil.rmtree(node)  # the node is wiped; the first Tiers still holds its engine
    second = Tiers([f"lmdb://{node}", redis_url])
    out = sd(0.0)
    choice = second.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-1", 1)
    assert same(out, sd(1.0))
    first.close()
    second.close()


def test_copy_newest_skips_saves_made_while_a_copy_runs(tmp_path: Path, redis_url: str) -> None:
    """``copy="newest"``: saves that come while the copy of an earlier one is still running
    stay in the first tier only, so copies never queue up behind a loop that saves faster than
    they go; the next save after the copy is done is copied again."""
    import threading

    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url], copy="newest")
    gate = threading.Event()
    tiers._pool.submit(gate.wait)  # the copy of step-0 waits until the gate opens
    for step in range(3):
        dcp.save(sd(float(step)), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}")
    assert tiers.busy_ids() == {"step-0"}
    gate.set()
    tiers.wait()
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["step-0"]
    assert [i.checkpoint_id for i in list_checkpoints(local)] == ["step-2", "step-1", "step-0"]
    assert read_index(open_store(redis_url)).pending == {}
    dcp.save(sd(3.0), storage_writer=tiers.writer(), checkpoint_id="step-3")
    tiers.wait()
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["step-3", "step-0"]
    out = sd(0.0)
    fresh = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    choice = fresh.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-3", 1)
    assert same(out, sd(3.0))
    with pytest.raises(ValueError, match="copy must be"):
        Tiers([local, redis_url], copy="some")
    tiers.close()
    fresh.close()


def test_a_loops_last_save_reaches_every_store_under_copy_newest(
    tmp_path: Path, redis_url: str
) -> None:
    """``tiers.writer(copy="every")`` for a loop's last save: copied although the copy of an
    earlier save is still running, so the job ends with its newest checkpoint in Redis."""
    import threading

    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url], copy="newest")
    gate = threading.Event()
    tiers._pool.submit(gate.wait)  # the copy of step-0 waits until the gate opens
    dcp.save(sd(0.0), storage_writer=tiers.writer(), checkpoint_id="step-0")
    dcp.save(sd(1.0), storage_writer=tiers.writer(), checkpoint_id="step-1")  # skipped
    last = tiers.writer(copy="every")
    dcp.save(sd(2.0), storage_writer=last, checkpoint_id="step-2")
    gate.set()
    tiers.close()
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["step-2", "step-0"]
    out = sd(0.0)
    fresh = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    choice = fresh.restore(out)
    assert choice is not None and (choice.checkpoint_id, choice.tier) == ("step-2", 1)
    assert same(out, sd(2.0))
    fresh.close()
    with pytest.raises(ValueError, match="copy must be"):
        Tiers([local, redis_url]).writer(copy="last")


def test_first_tier_gets_ready_for_the_save_being_copied(tmp_path: Path, redis_url: str) -> None:
    """The first tier holds ``keep_last`` saves, the one being written and the one whose copy
    is still running (``keep_last`` leaves it in place): ``get_ready`` sizes it for all of
    them, so a save made while a copy runs writes into memory made ready for it, not fresh."""
    calls: list[tuple[int, int | None]] = []
    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url], keep_last=2)
    tiers.engines[0].get_ready = lambda nbytes, copies, node_ranks=None: calls.append(
        (nbytes, copies)
    )  # type: ignore[method-assign]
    dcp.save(sd(1.0), storage_writer=tiers.writer(), checkpoint_id="step-1")
    tiers.get_ready(sd(1.0))
    assert [copies for _, copies in calls] == [4, 4, 4]  # before the save writes, after, and here
    alone = Tiers([local], keep_last=2)
    assert alone.writer()._saves_held() == 3
    tiers.close()
    alone.close()


class _Unlisted:
    """An object no ``weights_only`` load may rebuild."""

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (print, ("pwned",))


def test_a_refused_object_is_reported_as_such_not_as_a_damaged_copy(tmp_path: Path) -> None:
    """A load that refuses an object (weights_only) fails with that error at once: it is not
    the store's fault, so it is never set aside as a damaged copy, sent to another tier, or
    answered with an older save."""
    tiers = Tiers([f"lmdb://{tmp_path / 'local'}"])
    dcp.save({"x": torch.ones(2)}, storage_writer=tiers.writer(), checkpoint_id="older")
    dcp.save(
        {"x": torch.ones(2), "obj": _Unlisted()},
        storage_writer=tiers.writer(),
        checkpoint_id="newest",
    )
    with pytest.raises(BaseException, match="weights_only") as info:
        tiers.restore({"x": torch.zeros(2), "obj": None})
    assert "DamagedCopyError" not in str(info.value) and "NotHeldError" not in str(info.value)
    tiers.close()
