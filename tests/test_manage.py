"""list / latest / delete / gc / keep_last / ttl on real LMDB and Redis."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import kvckpt
from kvckpt import (
    CheckpointNotFoundError,
    KVStorageReader,
    KVStorageWriter,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import index_key, mark_pending, read_index
from kvckpt.keys import data_prefix, spare_prefix
from kvckpt.testing import RedisServer
from kvckpt.verify import verify

from ._cli import run


def save(url: str, cid: str, value: float = 1.0, **kw) -> None:
    dcp.save(
        {"w": torch.full((256,), value), "step": int(value)},
        storage_writer=KVStorageWriter(url, **kw),
        checkpoint_id=cid,
    )


def data_keys(url: str) -> list[str]:
    engine = open_store(url)
    return list(engine.scan(data_prefix(engine.prefix)))


def test_list_and_latest(store_url: str) -> None:
    open_store(store_url).get("-")  # a store that exists and is empty (an engine that may write)
    assert list_checkpoints(store_url) == []
    assert latest_checkpoint(store_url) is None
    for i in range(3):
        save(store_url, f"step-{i}", float(i))
    infos = list_checkpoints(store_url)
    assert [i.checkpoint_id for i in infos] == ["step-2", "step-1", "step-0"]
    info = infos[0]
    assert info.complete and info.world_size == 1 and info.num_items == 2
    assert info.total_bytes > 1024 and info.created.year >= 2024
    assert latest_checkpoint(store_url) == "step-2"
    # A re-save makes an older id the newest.
    save(store_url, "step-0", 9.0)
    assert latest_checkpoint(store_url) == "step-0"
    assert len(list_checkpoints(store_url)) == 3


def test_listing_reads_only_the_index(store_url: str) -> None:
    """Listing must not scan data keys: it works even when the scan is made to fail."""
    for i in range(5):
        save(store_url, f"c{i}")
    engine = open_store(store_url)

    def no_scan(prefix: str):
        raise AssertionError(f"listing scanned {prefix!r}")

    engine.scan = no_scan  # type: ignore[method-assign]
    assert len(list_checkpoints(engine)) == 5
    assert latest_checkpoint(engine) == "c4"


def test_pending_save_is_incomplete_not_latest(store_url: str) -> None:
    save(store_url, "good")
    engine = open_store(store_url)
    mark_pending(engine, "crashed", "f" * 32, None)
    engine.put_many([(f"{data_prefix(engine.prefix, 'crashed', 'f' * 32)}0/0/0", b"x" * 100)])
    assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["good"]
    everything = list_checkpoints(store_url, include_incomplete=True)
    assert {(i.checkpoint_id, i.complete) for i in everything} == {
        ("good", True),
        ("crashed", False),
    }
    assert latest_checkpoint(store_url) == "good"
    # A young pending save is left alone (it may still be writing) ...
    report = gc(store_url)
    assert report.deleted_keys == 0
    # ... an old one is removed with its data.
    report = gc(store_url, incomplete_older_than=0)
    assert report.deleted_keys == 1 and report.removed_incomplete
    assert list_checkpoints(store_url, include_incomplete=True)[0].checkpoint_id == "good"
    assert all("crashed" not in k for k in data_keys(store_url))


def test_gc_removes_orphans_without_pending_entry(store_url: str) -> None:
    save(store_url, "good")
    engine = open_store(store_url)
    orphan = f"{data_prefix(engine.prefix, 'lost', 'e' * 32)}0/0/0"
    engine.put_many([(orphan, b"y")])
    before = set(data_keys(store_url))
    report = gc(store_url)
    assert report.deleted_keys == 1
    assert set(data_keys(store_url)) == before - {orphan}
    out = {"w": torch.zeros(256), "step": 0}
    dcp.load(out, storage_reader=KVStorageReader(store_url), checkpoint_id="good")
    assert out["step"] == 1


def test_gc_counts_and_reports_the_spares_it_deletes(
    redis_server: RedisServer, redis_url: str
) -> None:
    """Retention on Redis keeps a dropped checkpoint's values as spares ({prefix}/spare/...):
    gc deletes them, and says so, in a dry run (deleting nothing) and in a real one."""
    state = {"big": torch.rand(int(5.5 * (1 << 20)) // 4), "small": torch.arange(100.0)}
    for cid in ("s0", "s1"):
        dcp.save(state, storage_writer=KVStorageWriter(redis_url, keep_last=1), checkpoint_id=cid)
    client = redis_server.client()
    spares = list(client.scan_iter(match=f"{spare_prefix('kvckpt')}*"))
    assert len(spares) >= 2
    before = sorted(client.scan_iter())

    planned = json.loads(run("gc", redis_url, "--dry-run", "--json").stdout)
    assert planned["dry_run"] is True
    assert planned["spare_keys"] == len(spares) and planned["deleted_keys"] == len(spares)
    text = run("gc", redis_url, "--dry-run").stdout
    assert f"would delete {len(spares)} spare keys" in text, text
    assert f"0 data keys and {len(spares)} spare keys would be deleted" in text, text
    assert sorted(client.scan_iter()) == before  # the dry runs deleted nothing

    done = json.loads(run("gc", redis_url, "--json").stdout)
    assert done["spare_keys"] == len(spares) and done["deleted_keys"] == len(spares)
    assert list(client.scan_iter(match=f"{spare_prefix('kvckpt')}*")) == []
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["s1"]
    assert verify(redis_url, "s1").ok
    again = run("gc", redis_url)
    assert again.returncode == 0 and "0 data keys deleted" in again.stdout, again.stdout
    assert "spare" not in again.stdout


def test_delete(store_url: str) -> None:
    save(store_url, "a")
    save(store_url, "b")
    n_before = len(data_keys(store_url))
    assert delete_checkpoint(store_url, "a") == n_before // 2
    assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["b"]
    with pytest.raises(CheckpointNotFoundError, match="'a' not found"):
        KVStorageReader(store_url, checkpoint_id="a").read_record()
    with pytest.raises(CheckpointNotFoundError):
        delete_checkpoint(store_url, "a")
    assert len(data_keys(store_url)) == n_before // 2


def test_gc_keep_last(store_url: str) -> None:
    for i in range(5):
        save(store_url, f"s{i}", float(i))
    report = gc(store_url, keep_last=2)
    assert sorted(report.deleted_checkpoints) == ["s0", "s1", "s2"]
    assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["s4", "s3"]
    assert len(data_keys(store_url)) == 4


def test_writer_keep_last_never_deletes_the_new_checkpoint(store_url: str) -> None:
    for i in range(4):
        save(store_url, f"k{i}", float(i), keep_last=2)
    assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["k3", "k2"]
    # Even if clocks make an older checkpoint look newer, the one just written stays.
    save(store_url, "k1", 7.0, keep_last=1)
    assert "k1" in [i.checkpoint_id for i in list_checkpoints(store_url)]


def test_corrupt_index_is_reported_and_rebuilt_by_gc(store_url: str) -> None:
    save(store_url, "x")
    engine = open_store(store_url)
    engine.put_many([(index_key(engine.prefix), b"\x00garbage")])
    with pytest.raises(kvckpt.MetadataError, match="kvckpt gc"):
        list_checkpoints(store_url)
    gc(store_url)
    assert [i.checkpoint_id for i in list_checkpoints(store_url)] == ["x"]


def test_rank_local_checkpoints_are_listed_when_every_rank_committed(store_url: str) -> None:
    from tests import _dist
    from tests._spawn import spawn

    spawn(_dist.rank_local_worker, 2, store_url)
    (info,) = list_checkpoints(store_url)
    assert info.checkpoint_id == "local" and info.complete and info.rank_local
    assert info.world_size == 2
    assert delete_checkpoint(store_url, "local") > 0
    assert list_checkpoints(store_url, include_incomplete=True) == []


def test_ttl_expires_the_whole_checkpoint(redis_url: str) -> None:
    save(redis_url, "short", ttl=1.5)
    save(redis_url, "long")
    assert {i.checkpoint_id for i in list_checkpoints(redis_url)} == {"short", "long"}
    client = open_store(redis_url)._client
    meta_ttl = client.pttl("{kvckpt}/meta/short")
    assert 0 < meta_ttl <= 1500
    data_ttls = [client.pttl(k) for k in data_keys(redis_url) if "/short/" in k]
    assert data_ttls and all(t > meta_ttl for t in data_ttls)
    time.sleep(1.6)
    assert [i.checkpoint_id for i in list_checkpoints(redis_url)] == ["long"]
    assert latest_checkpoint(redis_url) == "long"
    gc(redis_url)
    assert len(read_index(open_store(redis_url)).checkpoints) == 1


def test_ttl_on_lmdb_is_refused(lmdb_url: str) -> None:
    with pytest.raises(ValueError, match="Redis"):
        KVStorageWriter(lmdb_url, ttl=10)


def test_keep_last_reaches_the_other_nodes_lmdb_stores(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Two "nodes", each with its own LMDB store: rank 0's holds the metadata; rank 1's only
    # its data. Retention on the coordinator reaches rank 1's store one save later, and gc run
    # on that store (which holds no metadata) leaves the data it still needs alone.

    from kvckpt.catalog import read_index
    from kvckpt.keys import data_prefix
    from tests import _dist
    from tests._spawn import spawn

    spawn(_dist.two_node_lmdb_worker, 2, str(tmp_path))
    coordinator, other = (open_store(f"lmdb://{tmp_path}/node{r}") for r in range(2))

    def saves(engine) -> set[str]:  # type: ignore[no-untyped-def]
        return {k.split("/")[2] for k in engine.scan(data_prefix(engine.prefix))}

    assert [i.checkpoint_id for i in list_checkpoints(coordinator)] == ["step-3"]
    assert saves(coordinator) == {"step-3"}
    assert saves(other) == {"step-2", "step-3"}  # the previous one goes at the next save
    assert {e["checkpoint_id"] for e in read_index(other).remote.values()} == {"step-2", "step-3"}
    assert list_checkpoints(other) == []
    assert gc(other).deleted_keys == 0
    assert saves(other) == {"step-2", "step-3"}


def test_read_only_operations_never_create_an_lmdb_store(tmp_path) -> None:
    """Reading a store that is not there (`kvckpt ls lmdb:///some/typo`) is an error naming
    the path, and creates nothing."""
    from kvckpt import StoreNotFoundError
    from kvckpt.copying import copy_checkpoint
    from kvckpt.dcp_files import export_checkpoint, torch_save_checkpoint
    from kvckpt.verify import verify

    missing = tmp_path / "typo"
    empty = tmp_path / "empty"  # a directory, but no store in it
    empty.mkdir()
    for path in (missing, empty):
        url = f"lmdb://{path}"
        # the queries answer "none" (a job's first run resumes from nothing) ...
        assert list_checkpoints(url) == [] and latest_checkpoint(url) is None
        # ... and everything else says there is no store
        reads = [
            (delete_checkpoint, url, "x"),
            (gc, url),
            (KVStorageReader(url, checkpoint_id="x").read_record,),
            (verify, url, "x"),
            (export_checkpoint, url, "x", tmp_path / "out"),
            (copy_checkpoint, url, "x", f"lmdb://{tmp_path / 'dst'}"),
            (torch_save_checkpoint, url, "x", tmp_path / "out.pt"),
        ]
        for read, *args in reads:
            with pytest.raises(StoreNotFoundError, match=f"no LMDB store at {path}"):
                read(*args)
        with pytest.raises(BaseException, match=f"no LMDB store at {path}"):  # wrapped by DCP
            dcp.load({"w": torch.zeros(2)}, storage_reader=KVStorageReader(url, checkpoint_id="x"))
        # a missing store is a checkpoint not found (the CLI's exit code 3)
        assert issubclass(StoreNotFoundError, CheckpointNotFoundError)
    assert not missing.exists() and list(empty.iterdir()) == []
    assert not (tmp_path / "dst").exists()
    # Writers create the store, as before; then readers find it.
    save(f"lmdb://{missing}", "step-1")
    assert latest_checkpoint(f"lmdb://{missing}") == "step-1"


def test_a_wiped_lmdb_directory_is_not_read_from_the_old_mapping(tmp_path) -> None:
    """Once the node-local directory is removed, a new reader in the same process fails with
    StoreNotFoundError: it never reads the old environment, still mapped (environments are
    shared per process and path)."""
    import shutil

    from kvckpt import StoreNotFoundError

    path = tmp_path / "node"
    url = f"lmdb://{path}"
    save(url, "old", 1.0)
    held = open_store(url)  # an engine still using the environment when it is wiped
    assert held.get(index_key(held.prefix)) is not None
    assert latest_checkpoint(url) == "old"  # the environment is cached in this process
    shutil.rmtree(path)
    assert list_checkpoints(url) == []  # a store that is gone has no checkpoints
    with pytest.raises(StoreNotFoundError, match=f"no LMDB store at {path}"):
        delete_checkpoint(url, "old")
    with pytest.raises(BaseException, match="no LMDB store"):
        dcp.load({"w": torch.zeros(256)}, storage_reader=KVStorageReader(url), checkpoint_id="old")
    # A new store at the same path is what new writers and readers see, not the old one.
    save(url, "new", 2.0)
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["new"]
    out = {"w": torch.zeros(256), "step": 0}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="new")
    assert torch.equal(out["w"], torch.full((256,), 2.0)) and out["step"] == 2
    held.close()  # the replaced environment closes with its last user
    # Replaced (not just removed) under a cached environment: noticed as well.
    shutil.rmtree(path)
    save(url, "newer", 3.0)
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["newer"]
