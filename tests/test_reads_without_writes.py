"""A committed checkpoint stays restorable where the store refuses writes.

Every case runs against the real thing: a redis-server at ``maxmemory`` (and far past it), a
Redis ACL user limited to reads, a replica (``REPLICAOF``), and an LMDB directory that the
reading process cannot write (permissions without ``CAP_DAC_OVERRIDE``, and a read-only bind
mount). Loads, ``verify``, export and a replaced node's ``Tiers.restore()`` read without a
read lease there; writes fail with an error that names the store and the fix.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    ReadOnlyStoreError,
    StoreFullError,
    Tiers,
    UnsafeStoreError,
    WritePermissionError,
    delete_checkpoint,
    gc,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import mark_pending, read_index, readers_key
from kvckpt.keys import data_prefix
from kvckpt.manage import discard_save
from kvckpt.testing import RedisServer
from tests._cli import ROOT, run


def state(value: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 15,), value + i) for i in range(6)}


def zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state(0.0).items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save(url: str, cid: str, value: float, **kw: object) -> None:
    dcp.save(state(value), storage_writer=KVStorageWriter(url, **kw), checkpoint_id=cid)


def load(url: str, cid: str, **kw: object) -> dict[str, torch.Tensor]:
    out = zeros()
    dcp.load(out, storage_reader=KVStorageReader(url, **kw), checkpoint_id=cid)
    return out


def reads_as_a_user_would(url: str, cid: str, value: float, tmp: Path) -> None:
    """Load bit-exact, ``verify``, export (DCP and safetensors), ``ls`` and ``info``."""
    assert same(load(url, cid), state(value))
    verified = run("verify", url, cid)
    assert verified.returncode == 0, verified.stderr
    out = tmp / f"export-{time.monotonic_ns()}"
    exported = run("export", url, cid, str(out))
    assert exported.returncode == 0, exported.stderr
    back = zeros()
    dcp.load(back, checkpoint_id=str(out))
    assert same(back, state(value))
    listed = run("ls", url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert cid in listed.stdout
    info = run("info", url, cid)
    assert info.returncode == 0 and "t0" in info.stdout, info.stderr


def replaced_node_restores(shared: str, tmp: Path, value: float) -> None:
    """A node whose local store is gone restores the newest checkpoint from ``shared``."""
    tiers = Tiers([f"lmdb://{tmp / f'new-node-{time.monotonic_ns()}'}", shared])
    try:
        out = zeros()
        choice = tiers.restore(out)
        assert choice is not None and choice.tier == 1
        assert same(out, state(value))
    finally:
        tiers.close()


# -- a full Redis ------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [1.0, 0.5], ids=["at-maxmemory", "at-half-of-used"])
def test_a_full_redis_serves_every_read(
    server: Callable[..., RedisServer], tmp_path: Path, fraction: float, caplog
) -> None:
    srv = server()
    url = srv.url()
    save(url, "good", 1.0)
    client = srv.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(int(used * fraction)))
    with pytest.raises(redis.exceptions.OutOfMemoryError):  # it refuses writes, for real
        client.set("probe", b"x" * 100_000)

    with caplog.at_level(logging.WARNING, logger="kvckpt"):
        reads_as_a_user_would(url, "good", 1.0, tmp_path)
        replaced_node_restores(url, tmp_path, 1.0)
    if fraction < 1.0:  # past its limit, even the lease's small write is refused: said once
        said = [r for r in caplog.records if "without a read lease" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
    assert not list(client.scan_iter(f"{readers_key('kvckpt', 'good')}*"))


class FillsTheServerMidSave(DefaultSavePlanner):
    """Another job fills the server after this save has written a few values."""

    def __init__(self, client: redis.Redis, after: int) -> None:
        super().__init__()
        self.client, self.after, self.resolved = client, after, 0

    def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
        self.resolved += 1
        if self.resolved == self.after:
            n = 0
            while True:
                try:
                    self.client.set(f"other-job/{n}", b"x" * (1 << 20))
                except redis.exceptions.OutOfMemoryError:
                    break
                n += 1
        return super().resolve_data(write_item)


def test_a_save_that_runs_out_of_memory_halfway_leaves_nothing_behind(
    server: Callable[..., RedisServer],
) -> None:
    srv = server()
    url = srv.url(pipeline_bytes="64KiB", spare_ttl=0)
    client = srv.client()
    save(url, "good", 1.0)
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + (32 << 20)))

    big = {f"b{i}": torch.full((1 << 17,), float(i)) for i in range(8)}
    with pytest.raises(BaseException, match="ran out of memory"):
        dcp.save(
            big,
            storage_writer=KVStorageWriter(url),
            planner=FillsTheServerMidSave(client, after=4),
            checkpoint_id="big",
        )
    engine = open_store(url)
    assert list(engine.scan(data_prefix("kvckpt", "big"))) == []
    assert read_index(engine).pending == {}
    assert same(load(url, "good"), state(1.0))


def test_a_failed_saves_clean_up_succeeds_on_a_server_past_its_limit(
    server: Callable[..., RedisServer],
) -> None:
    """The bookkeeping after the data's deletion shrinks the index: it runs even where the
    deletion did not bring the server below ``maxmemory`` (others' keys fill it)."""
    srv = server()
    engine = open_store(srv.url())
    client = srv.client()
    mark_pending(engine, "x", "s1", None, 60)
    client.set("kvckpt/data/x/s1/0/t@0/0", b"y" * 100_000)
    client.set("other-job", b"z" * (4 << 20))
    client.config_set("maxmemory", str(1 << 20))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", b"1")

    assert discard_save(engine, "x", "s1") == 1
    assert read_index(engine).pending == {}
    assert sorted(client.scan_iter("*")) == [b"other-job", b"{kvckpt}/index"]


def test_a_full_store_names_what_keep_last_would_free(
    server: Callable[..., RedisServer],
) -> None:
    srv = server()
    url = srv.url(spare_ttl=0)
    client = srv.client()
    save(url, "step-1", 1.0, keep_last=2)
    save(url, "step-2", 2.0, keep_last=2)
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) + (64 << 10)))
    with pytest.raises(BaseException, match=r"keep_last=2 deletes 'step-1'") as failed:
        save(url, "step-3", 3.0, keep_last=2)
    assert "kvckpt rm" in str(failed.value)
    assert [c.checkpoint_id for c in list_checkpoints(url)] == ["step-2", "step-1"]


# -- leases skipped on purpose -----------------------------------------------------------


class SeesReaders(DefaultLoadPlanner):
    """Records, between the metadata read and the data reads, whether a read lease exists."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        self.client, self.leased = client, None

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        self.leased = bool(self.client.exists(readers_key("kvckpt", "good")))
        return super().create_local_plan()


@pytest.mark.parametrize("how", ["default", "lease=False", "read_lease=0"])
def test_lease_can_be_skipped_on_purpose(redis_server: RedisServer, how: str) -> None:
    url = redis_server.url(prefix="kvckpt")
    client = redis_server.client()
    client.delete(*client.scan_iter("*kvckpt*")) if list(client.scan_iter("*kvckpt*")) else None
    save(url, "good", 2.0)
    planner = SeesReaders(client)
    out = zeros()
    reader = (
        KVStorageReader(url, lease=False)
        if how == "lease=False"
        else KVStorageReader(url + ("&read_lease=0" if how == "read_lease=0" else ""))
    )
    dcp.load(out, storage_reader=reader, planner=planner, checkpoint_id="good")
    assert same(out, state(2.0))
    assert planner.leased is (how == "default")


# -- a read-only ACL user ----------------------------------------------------------------


def test_a_read_only_user_reads_and_is_refused_writes_clearly(
    server: Callable[..., RedisServer], tmp_path: Path
) -> None:
    srv = server()
    save(srv.url(), "old", 2.0)
    save(srv.url(), "good", 3.0)
    client = srv.client()
    client.execute_command(
        "ACL", "SETUSER", "evaluator", "on", ">s3cret", "~*", "&*", "resetchannels", "+@read"
    )
    url = f"redis://evaluator:s3cret@127.0.0.1:{srv.port}/0"
    reads_as_a_user_would(url, "good", 3.0, tmp_path)
    replaced_node_restores(url, tmp_path, 3.0)

    with pytest.raises(BaseException, match="evaluator") as refused:
        save(url, "mine", 4.0)
    assert "s3cret" not in str(refused.value)
    assert isinstance(_root_cause(refused.value), WritePermissionError)
    with pytest.raises(WritePermissionError, match="evaluator"):
        gc(url, keep_last=1)
    for args in (("rm", url, "good"), ("gc", url, "--keep-last", "1")):
        done = run(*args)
        assert done.returncode == 6, done.stderr
        assert "evaluator" in done.stderr and "127.0.0.1" in done.stderr
        assert "s3cret" not in done.stderr and "+@write" in done.stderr
    assert [c.checkpoint_id for c in list_checkpoints(srv.url())] == ["good", "old"]


def _root_cause(error: BaseException) -> BaseException:
    """The first rank's error of DCP's ``CheckpointException``, or the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


# -- a replica ---------------------------------------------------------------------------


def test_a_replica_serves_every_read(server: Callable[..., RedisServer], tmp_path: Path) -> None:
    primary = server()
    save(primary.url(), "good", 5.0)
    replica = server("--replicaof", "127.0.0.1", str(primary.port))
    deadline = time.monotonic() + 20
    while replica.client().info("replication").get("master_link_status") != "up" or not (
        replica.client().exists("{kvckpt}/index")
    ):
        assert time.monotonic() < deadline, "the replica never synced"
        time.sleep(0.05)
    reads_as_a_user_would(replica.url(), "good", 5.0, tmp_path)
    replaced_node_restores(replica.url(), tmp_path, 5.0)
    save(primary.url(), "newer", 6.0)
    with pytest.raises(ReadOnlyStoreError):
        gc(replica.url(), keep_last=1)


# -- an LMDB directory this process cannot write -----------------------------------------


def _without_write_permission(store: Path) -> list[str]:
    """A command prefix that runs as root without the capabilities that bypass file
    permissions, over a store made read-only for its owner."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    for path in [store, *store.iterdir()]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def _on_a_read_only_mount(store: Path, mount: Path) -> list[str]:
    """A command prefix that sees ``store`` at ``mount`` through a read-only bind mount, in a
    mount namespace of its own."""
    mount.mkdir()
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount --bind {store} {mount} && mount -o remount,bind,ro {mount}",
        ],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"no read-only bind mount here: {probe.stderr.decode().strip()}")
    setup = f'mount --bind {store} {mount} && mount -o remount,bind,ro {mount} && exec "$@"'
    return ["unshare", "-m", "sh", "-c", setup, "sh"]


_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
from kvckpt import KVStorageReader
out = {f"t{i}": torch.zeros(1 << 15) for i in range(6)}
dcp.load(out, storage_reader=KVStorageReader(sys.argv[1]), checkpoint_id="good")
assert all(torch.equal(out[f"t{i}"], torch.full((1 << 15,), 6.0 + i)) for i in range(6))
print("loaded bit-exact")
"""


@pytest.fixture(params=["no-write-permission", "read-only-mount"])
def read_only_lmdb(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[list[str], str]]:
    store = tmp_path / "store"
    save(f"lmdb://{store}", "good", 6.0)
    if request.param == "no-write-permission":
        prefix, seen_at = _without_write_permission(store), store
    else:
        seen_at = tmp_path / "ro"
        prefix = _on_a_read_only_mount(store, seen_at)
    yield prefix, f"lmdb://{seen_at}"
    for path in [store, *store.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def test_a_read_only_lmdb_directory_serves_every_read(
    read_only_lmdb: tuple[list[str], str], tmp_path: Path
) -> None:
    prefix, url = read_only_lmdb

    def as_reader(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*prefix, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
        )

    loaded = as_reader(sys.executable, "-c", _LOAD, url)
    assert "loaded bit-exact" in loaded.stdout, loaded.stderr
    kv = [sys.executable, "-m", "kvckpt"]
    for args in (["ls", url], ["info", url, "good"], ["verify", url, "good"]):
        done = as_reader(*kv, *args)
        assert done.returncode == 0, (args, done.stderr)
    out = tmp_path / "exported"
    exported = as_reader(*kv, "export", url, "good", str(out), "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["checkpoint_id"] == "good"
    back = zeros()
    dcp.load(back, checkpoint_id=str(out))
    assert same(back, state(6.0))

    removed = as_reader(*kv, "rm", url, "good")
    assert removed.returncode == 6, removed.stderr
    assert "read-only" in removed.stderr and "write the directory" in removed.stderr


# -- a Redis that may evict keys ---------------------------------------------------------


def test_tiers_never_copy_into_a_redis_that_may_evict(
    server: Callable[..., RedisServer], tmp_path: Path
) -> None:
    srv = server("--maxmemory", "256mb")
    srv.client().config_set("maxmemory-policy", "allkeys-lru")
    tiers = Tiers([f"lmdb://{tmp_path / 'node'}", srv.url()])
    dcp.save(state(7.0), storage_writer=tiers.writer(), checkpoint_id="step-1")
    with pytest.raises(UnsafeStoreError, match="allkeys-lru"):
        tiers.wait()
    tiers.close()
    assert list(srv.client().scan_iter("*")) == []
    with pytest.raises(BaseException) as refused:  # and a save straight to it, as before
        save(srv.url(), "step-1", 7.0)
    assert isinstance(_root_cause(refused.value), UnsafeStoreError)
    assert list(srv.client().scan_iter("*")) == []


def test_store_full_error_is_the_write_paths_error(server: Callable[..., RedisServer]) -> None:
    """A load never raises ``StoreFullError`` for its lease; a save still does."""
    srv = server()
    save(srv.url(), "good", 1.0)
    srv.client().config_set("maxmemory", "1")
    assert same(load(srv.url(), "good"), state(1.0))
    with pytest.raises(BaseException) as failed:
        save(srv.url(), "next", 2.0)
    assert isinstance(_root_cause(failed.value), StoreFullError)


class DeletesMidLoad(DefaultLoadPlanner):
    """Runs ``action`` between the reader's metadata read and its data reads."""

    def __init__(self, action: Callable[[], None]) -> None:
        super().__init__()
        self.action = action

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        self.action()
        return plan


@pytest.mark.parametrize("retention", ["deleted", "re-saved"])
def test_a_read_without_a_lease_fails_clearly_when_retention_runs_under_it(
    server: Callable[..., RedisServer], retention: str
) -> None:
    srv = server()
    url = srv.url(spare_ttl=0)
    save(url, "good", 1.0)

    def retire() -> None:
        if retention == "deleted":
            delete_checkpoint(url, "good")
        else:
            save(url, "good", 9.0)

    out = zeros()
    with pytest.raises(BaseException, match=r"checkpoint 'good' in redis://.* is damaged"):
        dcp.load(
            out,
            storage_reader=KVStorageReader(url, lease=False),
            planner=DeletesMidLoad(retire),
            checkpoint_id="good",
        )
