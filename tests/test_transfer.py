"""verify, copy, export to / import from DCP directories, torch-save — real stores, stock DCP."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    MetadataError,
    StoreFullError,
    UnsafeStoreError,
    UnwritablePathError,
    list_checkpoints,
    open_store,
)
from kvckpt.copying import copy_checkpoint
from kvckpt.dcp_files import (
    export_checkpoint,
    import_checkpoint,
    read_dcp_metadata,
    torch_save_checkpoint,
)
from kvckpt.verify import verify
from tests import _dist
from tests._spawn import spawn
from tests.test_dcp import assert_bit_equal, mixed_state_dict, zeros_like_sd

from ._cli import run


def test_verify_ok_then_detects_missing_and_wrong_size(store_url: str) -> None:
    dcp.save(mixed_state_dict(), storage_writer=KVStorageWriter(store_url), checkpoint_id="v")
    report = verify(store_url, "v")
    assert report.ok and report.keys > 10
    engine = open_store(store_url)
    record = KVStorageReader(engine, checkpoint_id="v").read_record()
    keys = record.data_keys(engine.prefix)
    engine.delete(keys[:1])
    engine.put_many([(keys[1], b"xx")])
    report = verify(store_url, "v")
    assert not report.ok and len(report.problems) == 2
    assert any("missing" in p for p in report.problems)
    assert any("holds 2 bytes" in p for p in report.problems)


def test_copy_lmdb_to_redis(lmdb_url: str, redis_url: str) -> None:
    sd = mixed_state_dict()
    dcp.save(sd, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="c")
    copy_checkpoint(lmdb_url, "c", redis_url + "?part_bytes=4096")
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["c"]
    assert verify(redis_url + "?part_bytes=4096", "c").ok
    out = zeros_like_sd(sd)
    dcp.load(out, storage_reader=KVStorageReader(redis_url), checkpoint_id="c")
    assert_bit_equal(sd, out)
    copy_checkpoint(redis_url, "c", redis_url, "c-copy")
    assert {i.checkpoint_id for i in list_checkpoints(redis_url)} == {"c", "c-copy"}


STOCK_LOAD = textwrap.dedent("""
    import sys, warnings, torch
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    assert "kvckpt" not in sys.modules
    directory, expected_file, out_file = sys.argv[1:4]

    def same(a, b):  # bit for bit, so NaNs compare equal
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    expected = torch.load(expected_file, weights_only=False)
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(target, checkpoint_id=directory)
    for k, v in expected.items():
        assert same(target[k], v), k
    dcp_to_torch_save(directory, out_file)
    full = torch.load(out_file, weights_only=False)
    for k, v in expected.items():
        assert same(full[k], v), k
    print("stock ok")
""")


def test_export_is_read_by_stock_pytorch(store_url: str, tmp_path) -> None:
    sd = {k: v for k, v in mixed_state_dict().items() if isinstance(v, torch.Tensor)}
    sd = {k: v for k, v in sd.items() if not k.startswith("fp8")}  # zeros_like+equal on fp8
    dcp.save(
        {**sd, "meta": {"epoch": 3}}, storage_writer=KVStorageWriter(store_url), checkpoint_id="e"
    )
    export_checkpoint(store_url, "e", tmp_path / "exported")
    torch.save({k: v.contiguous() for k, v in sd.items()}, tmp_path / "expected.pt")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            STOCK_LOAD,
            str(tmp_path / "exported"),
            str(tmp_path / "expected.pt"),
            str(tmp_path / "full.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stock ok" in result.stdout
    assert torch.load(tmp_path / "full.pt", weights_only=True)["meta"] == {"epoch": 3}


def test_export_of_resharded_checkpoint_loads_in_stock_dcp(store_url: str, tmp_path) -> None:
    spawn(_dist.save_worker, 2, store_url, "two")
    export_checkpoint(store_url, "two", tmp_path / "two")
    expected = _dist.expected()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "two"))
    for k, v in expected.items():
        assert torch.equal(target[k], v), k


def test_export_refuses_non_empty_directory(store_url: str, tmp_path) -> None:
    dcp.save({"a": torch.ones(1)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="e")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep me")
    with pytest.raises(UnwritablePathError, match="not empty; choose a new or empty directory"):
        export_checkpoint(store_url, "e", tmp_path / "x")
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["f"]


def test_copy_and_import_into_a_redis_that_may_evict_write_nothing(
    lmdb_url: str, server, tmp_path
) -> None:
    """A Redis whose maxmemory-policy can evict keys takes no copy and no import, as it takes
    no save: refused before the first write (exit 6), unless the URL accepts the risk."""
    srv = server()
    client = srv.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    dcp.save(mixed_state_dict(), storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="c")
    exported = export_checkpoint(lmdb_url, "c", tmp_path / "dcp")
    with pytest.raises(UnsafeStoreError, match="allkeys-lru"):
        copy_checkpoint(lmdb_url, "c", srv.url())
    with pytest.raises(UnsafeStoreError, match="allkeys-lru"):
        import_checkpoint(exported, srv.url(), "i")
    assert client.dbsize() == 0
    for args in (("copy", lmdb_url, "c", srv.url()), ("import", str(exported), srv.url(), "i")):
        result = run(*args, "--json")
        assert result.returncode == 6, result.stderr
        message = json.loads(result.stdout)["error"]
        assert "maxmemory-policy 'allkeys-lru'" in message and "allow_eviction=1" in message
        assert message in result.stderr
        assert client.dbsize() == 0, sorted(client.scan_iter())  # not one key, any prefix
    accepted = srv.url(allow_eviction=1)
    assert run("copy", lmdb_url, "c", accepted).returncode == 0
    assert run("import", str(exported), accepted, "i").returncode == 0
    assert {i.checkpoint_id for i in list_checkpoints(accepted)} == {"c", "i"}
    assert verify(accepted, "c").ok and verify(accepted, "i").ok


def test_copy_and_import_into_a_redis_without_room_write_nothing(lmdb_url: str, server) -> None:
    srv = server()
    client = srv.client()
    state = {"w": torch.rand(1 << 20)}  # 4 MiB
    dcp.save(state, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="c")
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + (1 << 20)))
    try:
        with pytest.raises(StoreFullError, match="no room"):
            copy_checkpoint(lmdb_url, "c", srv.url())
        assert client.dbsize() == 0
    finally:
        client.config_set("maxmemory", "0")


def test_import_stock_dcp_saved_at_world_size_2_then_load_at_1(store_url: str, tmp_path) -> None:
    directory = str(tmp_path / "stock")
    spawn(_dist.fs_save_worker, 2, directory)
    record = import_checkpoint(directory, store_url, "imported")
    assert record.world_size == 2
    assert verify(store_url, "imported").ok
    _dist.load_single_process(store_url, "imported")
    spawn(_dist.load_worker, 3, store_url, "imported")


class Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_import_refuses_metadata_with_foreign_classes(tmp_path, capsys) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(MetadataError, match="refusing to unpickle"):
        read_dcp_metadata(tmp_path)
    assert "pwned" not in capsys.readouterr().out


def test_torch_save_consolidates(store_url: str, tmp_path) -> None:
    spawn(_dist.save_worker, 2, store_url, "full")
    torch_save_checkpoint(store_url, "full", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    for k, v in _dist.expected().items():
        assert torch.equal(full[k], v), k
    assert full["obj"] == {"step": 5, "name": "adamw"}


def test_verify_checks_checksums(redis_url: str) -> None:
    from tests.test_dcp import flip_one_byte

    dcp.save({"w": torch.randn(100)}, storage_writer=KVStorageWriter(redis_url), checkpoint_id="c")
    assert verify(redis_url, "c").ok
    flip_one_byte(redis_url, "c", "w")
    report = verify(redis_url, "c")
    assert not report.ok and report.problems[0].startswith("checksum mismatch")
