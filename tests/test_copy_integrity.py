"""Every path that moves a checkpoint (copy, export, torch-save, import, Tiers' background copies
and prefetch) checks what it reads against the recorded checksums, carries them to the
destination, keeps the commit time, and leaves nothing behind when it fails. Real LMDB, a real
redis-server."""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import kvckpt.verify
from kvckpt import (
    IntegrityError,
    KVCheckpointError,
    KVStorageReader,
    KVStorageWriter,
    ReplicationError,
    Tiers,
    gc,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import read_index
from kvckpt.copying import copy_checkpoint
from kvckpt.dcp_files import export_checkpoint, import_checkpoint, torch_save_checkpoint
from kvckpt.keys import data_prefix
from kvckpt.verify import verify

from ._cli import run

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def state(value: float) -> dict[str, torch.Tensor]:
    return {
        "a": torch.full((256,), value),
        "b": torch.arange(2048, dtype=torch.float32).reshape(64, 32) + value,
        "c": torch.full((100,), value, dtype=torch.float64),
    }


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(0.0).items()}


def save(url: str, cid: str, value: float = 1.0, **options: object) -> None:
    dcp.save(state(value), storage_writer=KVStorageWriter(url, **options), checkpoint_id=cid)


def corrupt(url: str, cid: str) -> str:
    """Overwrite the value of the checkpoint's last item (the last one a copy reads) with
    garbage of the same length, through the engine; returns its key."""
    engine = open_store(url, create=False)
    record = KVStorageReader(engine, checkpoint_id=cid).read_record()
    loc = max(record.locations.values(), key=lambda loc: (loc.rank, loc.plan_position))
    key = loc.keys(engine.prefix, cid, record.save_id)[0]
    value = engine.get(key)
    assert value is not None
    engine.put_many([(key, b"x" * len(value))])
    return key


def assert_nothing_of(url: str, cid: str) -> None:
    """No metadata, no pending entry and no data keys of ``cid`` in the store."""
    engine = open_store(url, create=False)
    assert [
        i for i in list_checkpoints(engine, include_incomplete=True) if i.checkpoint_id == cid
    ] == []
    assert read_index(engine).pending == {}
    assert list(engine.scan(data_prefix(engine.prefix, cid))) == []


# -- copy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["redis", "lmdb"])
def test_copy_of_a_corrupted_checkpoint_fails_and_leaves_nothing(
    source: str, lmdb_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Redis records checksums by default; LMDB when asked.
    src, dst = (redis_url, lmdb_url) if source == "redis" else (lmdb_url, redis_url)
    save(src, "step-1", checksums=True)
    key = corrupt(src, "step-1")
    monkeypatch.setattr(kvckpt.verify, "_BATCH_BYTES", 1024)  # earlier items are written first
    with pytest.raises(IntegrityError) as info:
        copy_checkpoint(src, "step-1", dst)
    message = str(info.value)
    assert "'step-1'" in message and key in message and open_store(src).url in message
    assert_nothing_of(dst, "step-1")
    # Under a new id in the same store: the same.
    with pytest.raises(IntegrityError):
        copy_checkpoint(src, "step-1", src, "step-1-copy")
    assert_nothing_of(src, "step-1-copy")


def test_copy_keeps_the_commit_time_and_the_checksums(lmdb_url: str, redis_url: str) -> None:
    save(lmdb_url, "step-10", 10.0, checksums=True)
    save(redis_url, "step-20", 20.0)
    copied = copy_checkpoint(lmdb_url, "step-10", redis_url)
    original = KVStorageReader(lmdb_url, checkpoint_id="step-10").read_record()
    assert copied.created_at == original.created_at
    # The genuinely newer checkpoint stays the newest, and retention keeps it.
    assert latest_checkpoint(redis_url) == "step-20"
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["step-20", "step-10"]
    by_fqn = {i.fqn: loc.checksums for i, loc in original.locations.items()}
    assert all(by_fqn[i.fqn] is not None for i in copied.locations)
    assert {i.fqn: loc.checksums for i, loc in copied.locations.items()} == by_fqn
    # The destination detects later corruption of the copy: verify and a default load.
    assert verify(redis_url, "step-10").ok
    corrupt(redis_url, "step-10")
    report = verify(redis_url, "step-10")
    assert not report.ok and report.problems[0].startswith("checksum mismatch")
    with pytest.raises(BaseException, match="does not match the checksum"):
        dcp.load(zeros(), storage_reader=KVStorageReader(redis_url), checkpoint_id="step-10")
    gc(redis_url, keep_last=1)
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["step-20"]


def test_copy_into_other_part_sizes_records_checksums_of_the_checked_bytes(
    lmdb_url: str, redis_url: str
) -> None:
    small = redis_url + "?part_bytes=512"  # "b" (8 KiB) is 16 parts here, 1 in LMDB
    save(lmdb_url, "s", checksums=True)
    copy_checkpoint(lmdb_url, "s", small)
    record = KVStorageReader(small, checkpoint_id="s").read_record()
    assert max(len(loc.checksums or ()) for loc in record.locations.values()) == 16
    assert verify(small, "s").ok
    out = zeros()
    dcp.load(out, storage_reader=KVStorageReader(small), checkpoint_id="s")
    assert all(torch.equal(out[k], v) for k, v in state(1.0).items())
    # Back into a store that takes bigger values, the parts go as they are, with the
    # checksums recorded above: nothing is split or hashed anew.
    copy_checkpoint(small, "s", lmdb_url, "s-back")
    back = KVStorageReader(lmdb_url, checkpoint_id="s-back").read_record()
    assert {i.fqn: (loc.part_bytes, loc.checksums) for i, loc in back.locations.items()} == {
        i.fqn: (loc.part_bytes, loc.checksums) for i, loc in record.locations.items()
    }
    assert verify(lmdb_url, "s-back").ok
    out = zeros()
    dcp.load(out, storage_reader=KVStorageReader(lmdb_url), checkpoint_id="s-back")
    assert all(torch.equal(out[k], v) for k, v in state(1.0).items())


def test_copy_between_engines_at_their_defaults_moves_parts_as_they_are(
    lmdb_url: str, redis_url: str
) -> None:
    """LMDB and Redis split items at the same size by default, so a copy either way keeps
    each multi-part item's parts and the checksums its save recorded."""
    big = {"w": torch.arange(3 * (1 << 20), dtype=torch.float32)}  # 12 MiB: 4 parts
    dcp.save(big, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="big")
    copy_checkpoint(lmdb_url, "big", redis_url)
    copy_checkpoint(redis_url, "big", lmdb_url, "big-back")
    records = [
        KVStorageReader(url, checkpoint_id=cid).read_record()
        for url, cid in ((lmdb_url, "big"), (redis_url, "big"), (lmdb_url, "big-back"))
    ]
    parts = [[(loc.part_bytes, loc.checksums) for loc in r.locations.values()] for r in records]
    assert parts[0] == parts[1] == parts[2] and len(parts[0][0][1] or ()) == 4
    out = {"w": torch.zeros_like(big["w"])}
    dcp.load(out, storage_reader=KVStorageReader(lmdb_url), checkpoint_id="big-back")
    assert torch.equal(out["w"], big["w"])


def test_copy_of_a_checkpoint_without_checksums(lmdb_url: str, redis_url: str, tmp_path) -> None:
    """Nothing to check: copied as read. The copy records checksums where the destination
    records them by default (every built-in engine), as a save there would."""
    save(lmdb_url, "plain", checksums=False)
    assert all(
        loc.checksums is None
        for loc in KVStorageReader(lmdb_url, checkpoint_id="plain").read_record().locations.values()
    )
    other = f"lmdb://{tmp_path / 'other'}"
    for dst in (redis_url, other):
        copy_checkpoint(lmdb_url, "plain", dst)
        record = KVStorageReader(dst, checkpoint_id="plain").read_record()
        assert all(loc.checksums is not None for loc in record.locations.values())
        assert verify(dst, "plain").ok


def test_copy_refuses_an_existing_id_unless_told_to_overwrite(
    lmdb_url: str, redis_url: str
) -> None:
    save(lmdb_url, "step-1", 1.0)
    copy_checkpoint(lmdb_url, "step-1", redis_url)
    before = KVStorageReader(redis_url, checkpoint_id="step-1").read_record()
    save(lmdb_url, "step-1", 2.0)  # a new save of the id in the source
    with pytest.raises(KVCheckpointError) as info:
        copy_checkpoint(lmdb_url, "step-1", redis_url)
    message = str(info.value)
    assert "'step-1' already exists in" in message and open_store(redis_url).url in message
    assert "overwrite=True" in message and "--force" in message
    after = KVStorageReader(redis_url, checkpoint_id="step-1").read_record()
    assert after.save_id == before.save_id and read_index(open_store(redis_url)).pending == {}
    copy_checkpoint(lmdb_url, "step-1", redis_url, overwrite=True)
    out = zeros()
    dcp.load(out, storage_reader=KVStorageReader(redis_url), checkpoint_id="step-1")
    assert torch.equal(out["a"], state(2.0)["a"])
    # Only the new save's data is left.
    engine = open_store(redis_url)
    assert list(engine.scan(data_prefix(engine.prefix, "step-1", before.save_id))) == []


def test_cli_copy_refuses_an_existing_id_without_force(lmdb_url: str, redis_url: str) -> None:
    save(lmdb_url, "step-1")
    assert run("copy", lmdb_url, "step-1", redis_url).returncode == 0
    refused = run("copy", lmdb_url, "step-1", redis_url)
    assert refused.returncode != 0 and "already exists" in refused.stderr
    assert "--force" in refused.stderr
    forced = run("copy", "--force", lmdb_url, "step-1", redis_url)
    assert forced.returncode == 0, forced.stderr


# -- export, torch-save, import -------------------------------------------------------------


def test_export_of_a_corrupted_checkpoint_fails_and_leaves_no_directory(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(redis_url, "step-1")
    good = open_store(redis_url)
    record = KVStorageReader(good, checkpoint_id="step-1").read_record()
    loc = max(record.locations.values(), key=lambda loc: (loc.rank, loc.plan_position))
    key = loc.keys(good.prefix, "step-1", record.save_id)[0]
    original = good.get(key)
    assert corrupt(redis_url, "step-1") == key
    monkeypatch.setattr(kvckpt.verify, "_BATCH_BYTES", 1024)  # earlier items are written first
    out = tmp_path / "new" / "step-1"
    with pytest.raises(IntegrityError, match=f"'step-1' in .* {re.escape(repr(key))}"):
        export_checkpoint(redis_url, "step-1", out)
    assert not (tmp_path / "new").exists()
    given = tmp_path / "given"  # an empty directory that was there stays, empty
    given.mkdir()
    with pytest.raises(IntegrityError):
        export_checkpoint(redis_url, "step-1", given)
    assert given.is_dir() and list(given.iterdir()) == []
    # Once the value is repaired, the retry into the same directory succeeds.
    assert original is not None
    good.put_many([(key, original)])
    export_checkpoint(redis_url, "step-1", out)
    loaded = zeros()
    dcp.load(loaded, checkpoint_id=str(out))
    assert all(torch.equal(loaded[k], v) for k, v in state(1.0).items())


def test_cli_export_of_a_corrupted_checkpoint_fails(redis_url: str, tmp_path: Path) -> None:
    save(redis_url, "step-1")
    corrupt(redis_url, "step-1")
    result = run("export", redis_url, "step-1", str(tmp_path / "out"))
    assert result.returncode == 5, result.stderr
    assert "does not match the checksum" in result.stderr
    assert not (tmp_path / "out").exists()


def test_torch_save_of_a_corrupted_checkpoint_fails_and_writes_no_file(
    redis_url: str, tmp_path: Path
) -> None:
    save(redis_url, "step-1")
    key = corrupt(redis_url, "step-1")
    with pytest.raises(IntegrityError, match=re.escape(key)):
        torch_save_checkpoint(redis_url, "step-1", tmp_path / "full.pt")
    assert list(tmp_path.iterdir()) == []


def unwritable(tmp_path: Path) -> list[Path]:
    """Directories nothing can be written under: one below a regular file, and (not as root,
    who writes anywhere) a read-only one."""
    (tmp_path / "file").write_text("")
    paths = [tmp_path / "file" / "sub"]
    if not AS_ROOT:
        (tmp_path / "ro").mkdir(mode=0o500)
        paths.append(tmp_path / "ro")  # empty and given: its files cannot be created
        paths.append(tmp_path / "ro" / "sub")
    return paths


def test_export_into_an_unwritable_directory_names_the_path(lmdb_url: str, tmp_path: Path) -> None:
    save(lmdb_url, "step-1")
    for path in unwritable(tmp_path):
        with pytest.raises(
            KVCheckpointError, match=re.escape(f"cannot write checkpoint 'step-1' to {path}")
        ):
            export_checkpoint(lmdb_url, "step-1", path)
    assert (tmp_path / "file").read_text() == ""
    result = run("export", lmdb_url, "step-1", str(tmp_path / "file" / "sub"))
    assert result.returncode == 6 and str(tmp_path / "file" / "sub") in result.stderr


def test_torch_save_into_an_unwritable_directory_names_the_path(
    lmdb_url: str, tmp_path: Path
) -> None:
    save(lmdb_url, "step-1")
    for directory in unwritable(tmp_path):
        path = directory / "full.pt"
        with pytest.raises(
            KVCheckpointError, match=re.escape(f"cannot write checkpoint 'step-1' to {path}")
        ):
            torch_save_checkpoint(lmdb_url, "step-1", path)
    result = run("torch-save", lmdb_url, "step-1", str(tmp_path / "file" / "full.pt"))
    assert result.returncode == 6 and str(tmp_path / "file" / "full.pt") in result.stderr
    assert "enforce fail" not in result.stderr


def test_a_failed_import_leaves_nothing(lmdb_url: str, redis_url: str, tmp_path: Path) -> None:
    save(lmdb_url, "step-1")
    directory = export_checkpoint(lmdb_url, "step-1", tmp_path / "dcp")
    (data,) = directory.glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(KVCheckpointError, match="truncated"):
        import_checkpoint(directory, redis_url, "imported")
    assert_nothing_of(redis_url, "imported")


# -- verify on load ---------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_lmdb_checkpoint_with_checksums_is_verified_on_a_default_load(
    lmdb_url: str, direct: bool
) -> None:
    save(lmdb_url, "summed")  # checksums by default
    save(lmdb_url, "plain", checksums=False)
    key = corrupt(lmdb_url, "summed")
    corrupt(lmdb_url, "plain")

    def target() -> dict[str, torch.Tensor]:
        out = zeros()
        if not direct:  # a non-contiguous destination: the value is staged, then copied
            out["c"] = torch.zeros(100, 2, dtype=torch.float64)[:, 0]
        return out

    with pytest.raises(BaseException, match=f"'summed' in .*corrupted: key {re.escape(repr(key))}"):
        dcp.load(target(), storage_reader=KVStorageReader(lmdb_url), checkpoint_id="summed")
    # The opt-out loads what is there; a checkpoint without checksums cannot be checked.
    dcp.load(
        target(), storage_reader=KVStorageReader(lmdb_url, verify=False), checkpoint_id="summed"
    )
    dcp.load(target(), storage_reader=KVStorageReader(lmdb_url), checkpoint_id="plain")


# -- Tiers ------------------------------------------------------------------------------------


def test_prefetch_of_a_corrupted_value_fails_and_the_restore_raises(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    first = Tiers([f"lmdb://{tmp_path / 'node0'}", redis_url])
    dcp.save(state(1.0), storage_writer=first.writer(), checkpoint_id="step-1")
    first.close()
    key = corrupt(redis_url, "step-1")
    node = f"lmdb://{tmp_path / 'new-node'}"  # a replaced node: its local store is empty
    tiers = Tiers([node, redis_url])
    with caplog.at_level(logging.WARNING, logger="kvckpt.tiered"):
        future = tiers.prefetch()
        assert future is not None
        with pytest.raises(IntegrityError, match=re.escape(key)):
            future.result()
        with pytest.raises(
            BaseException, match=f"'step-1' in .*corrupted: key {re.escape(repr(key))}"
        ):
            tiers.restore(zeros())  # from the shared tier, which the load checks
    assert "prefetch failed" in caplog.text and "does not match the checksum" in caplog.text
    assert_nothing_of(node, "step-1")
    tiers.close()


def test_a_background_copy_of_a_corrupted_local_value_commits_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    local = f"lmdb://{tmp_path / 'node'}"
    tiers = Tiers([local, redis_url])  # checksums on: Redis records them by default
    gate = threading.Event()
    tiers._pool.submit(gate.wait)  # the copy queues behind this until the value is corrupted
    try:
        dcp.save(state(1.0), storage_writer=tiers.writer(), checkpoint_id="step-1")
        key = corrupt(local, "step-1")
    finally:
        gate.set()
    with pytest.raises(ReplicationError, match=f"corrupted: key {re.escape(repr(key))}"):
        tiers.wait()
    assert_nothing_of(redis_url, "step-1")
    assert latest_checkpoint(local) == "step-1"  # the first tier's commit stands
    tiers.close()
