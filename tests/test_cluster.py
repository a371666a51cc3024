"""Redis Cluster: a real cluster of redis-server processes made by the test
(``redis-cli --cluster create``); saves from 2 ranks, loads at 1 and 3, management across all
primaries, and a primary killed mid-save and after a commit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import index_key, lease_key
from kvckpt.keys import data_prefix, meta_key
from kvckpt.testing import RedisClusterProcesses
from kvckpt.verify import verify
from tests import _dist
from tests._spawn import spawn

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    c = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"), masters=3)
    yield c
    c.stop()


@pytest.fixture
def url(cluster: RedisClusterProcesses) -> str:
    for server in cluster.servers:
        client = server.client()
        client.flushall()
        client.close()
    return cluster.url(part_bytes="64KiB")


def keys_per_node(cluster: RedisClusterProcesses, prefix: str) -> list[int]:
    counts = []
    for server in cluster.primaries():
        client = server.client()
        counts.append(sum(1 for _ in client.scan_iter(match=prefix + "*", count=1000)))
        client.close()
    return counts


def sd(value: float, n: int = 16) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1 << 16,), value + i) for i in range(n)}  # 256 KiB each


def test_two_ranks_save_load_at_1_and_3(url: str, cluster: RedisClusterProcesses) -> None:
    spawn(_dist.save_worker, 2, url, "resharded")
    _dist.load_single_process(url, "resharded")
    spawn(_dist.load_worker, 3, url, "resharded")
    # The data keys carry no hash tag: they spread over hash slots, so over the primaries. (A
    # save this small, ten keys under a random save id, leaves one of three primaries empty
    # about one time in twenty; test_bookkeeping_keys_share_a_slot_and_data_spreads counts
    # each primary's share of a save of 256 keys.)
    keys = list(open_store(url).scan(data_prefix("kvckpt")))
    client = cluster.servers[0].client()
    assert len(keys) == 10 and len({client.cluster("keyslot", k) for k in keys}) > 1, keys


def test_bookkeeping_keys_share_a_slot_and_data_spreads(
    url: str, cluster: RedisClusterProcesses
) -> None:
    engine = open_store(url)
    client = cluster.servers[0].client()
    slots = {
        client.cluster("keyslot", k)
        for k in (index_key("kvckpt"), meta_key("kvckpt", "a"), lease_key("kvckpt", "b"))
    }
    assert len(slots) == 1
    dcp.save(sd(1.0, 64), storage_writer=KVStorageWriter(engine), checkpoint_id="a")
    counts = keys_per_node(cluster, data_prefix("kvckpt"))
    assert len(counts) == 3 and min(counts) > 0.15 * sum(counts), counts


def test_list_delete_gc_verify_across_primaries(url: str, cluster: RedisClusterProcesses) -> None:
    for step in range(3):
        dcp.save(sd(float(step)), storage_writer=KVStorageWriter(url), checkpoint_id=f"s{step}")
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["s2", "s1", "s0"]
    report = verify(url, "s1")
    assert report.ok and report.keys >= 16
    report = gc(url, keep_last=2)
    assert report.deleted_checkpoints == ["s0"]
    assert delete_checkpoint(url, "s1") > 0
    assert latest_checkpoint(url) == "s2"
    engine = open_store(url)
    # Only s2's data is left, on every primary.
    left = {k.split("/")[2] for k in engine.scan(data_prefix(engine.prefix))}
    assert left == {"s2"}
    out = sd(0.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="s2"))
    assert all(torch.equal(out[k], v) for k, v in sd(2.0).items())


def test_put_many_reports_each_checksum_by_position_across_primaries(url: str) -> None:
    """Values spread over three primaries, sent in parallel: each digest still lands at its
    value's position in the caller's order."""
    import random

    from kvckpt.format import checksum, new_checksum

    engine = open_store(url)
    assert engine.hashes_while_writing
    rng = random.Random(5)
    values = [(f"kvckpt/x/{i}", rng.randbytes(rng.choice([5, 70_000]))) for i in range(60)]
    seen: dict[int, int | None] = {}
    engine.put_many(values, on_value=seen.__setitem__, hasher=new_checksum)
    assert seen == {i: checksum(v) for i, (_, v) in enumerate(values)}
    got: dict[int, bytes] = {}
    engine.get_many([k for k, _ in values], lambda i, v: got.__setitem__(i, bytes(v)))
    assert [got[i] for i in range(len(values))] == [v for _, v in values]


def _move_all_slots(src, dst, nodes) -> None:
    """Finish a resharding begun with MIGRATING/IMPORTING: move ``src``'s keys of those slots
    to ``dst`` (MIGRATE), then give every slot to ``dst`` on every primary."""
    a, b = src.client(), dst.client()
    b_id = b.cluster("myid")
    for slot in _slots_of(a):
        while keys := a.cluster("getkeysinslot", slot, 1000):
            a.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
    slots = _slots_of(a)
    for node in nodes:
        pipe = node.client().pipeline(transaction=False)
        for slot in slots:
            pipe.cluster("setslot", slot, "node", b_id)
        pipe.execute()


def _slots_of(client) -> list[int]:
    me = client.cluster("myid")
    return [
        slot
        for start, end, *owners in client.execute_command("CLUSTER", "SLOTS")
        if owners[0][2] == me
        for slot in range(start, end + 1)
    ]


def test_slots_migrating_during_a_save_commit_whole(tmp_path: Path) -> None:
    # Resharding under a running save: every slot of one primary is MIGRATING to another when
    # the save starts (its new keys there get ASK replies), and the migration finishes a
    # moment later (MOVED). The writer follows the new slot map and commits the whole save.
    c = RedisClusterProcesses(tmp_path / "reshard", masters=3)
    try:
        src, dst = c.servers[0], c.servers[1]
        a, b = src.client(), dst.client()
        a_id, b_id = a.cluster("myid"), b.cluster("myid")
        slots = _slots_of(a)
        pb, pa = b.pipeline(transaction=False), a.pipeline(transaction=False)
        for slot in slots:
            pb.cluster("setslot", slot, "importing", a_id)
            pa.cluster("setslot", slot, "migrating", b_id)
        pb.execute()
        pa.execute()
        url = c.url(part_bytes="64KiB")
        errors: list[BaseException] = []

        def save() -> None:
            try:
                dcp.save(sd(7.0, 32), storage_writer=KVStorageWriter(url), checkpoint_id="m")
            except BaseException as e:
                errors.append(e)

        saver = threading.Thread(target=save)
        saver.start()
        time.sleep(1.0)  # the save is retrying the ASKed keys meanwhile
        assert saver.is_alive(), errors
        _move_all_slots(src, dst, c.servers)
        saver.join(timeout=60)
        assert not saver.is_alive() and not errors, errors
        assert _slots_of(a) == []
        out = sd(0.0, 32)
        dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="m"))
        assert all(torch.equal(out[k], v) for k, v in sd(7.0, 32).items())
        assert verify(url, "m").ok
        assert sum(1 for _ in a.scan_iter(count=1000)) == 0  # nothing left on the old owner
    finally:
        c.stop()


@pytest.fixture
def ha_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    c = RedisClusterProcesses(tmp_path / "ha", masters=3, replicas=1, node_timeout_ms=1000)
    yield c
    c.stop()


def kill(server) -> None:
    server.proc.kill()
    server.proc.wait()


def test_primary_killed_after_commit_loads_from_promoted_replica(
    ha_cluster: RedisClusterProcesses,
) -> None:
    url = ha_cluster.url(part_bytes="64KiB", wait_replicas=1)
    dcp.save(sd(5.0), storage_writer=KVStorageWriter(url), checkpoint_id="safe")
    victim = ha_cluster.primaries()[0]
    kill(victim)
    out = sd(0.0)
    # The load rides out the failover (topology refreshed, batch sent again).
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="safe"))
    assert all(torch.equal(out[k], v) for k, v in sd(5.0).items())
    assert latest_checkpoint(url) == "safe"


def test_primary_killed_mid_save_is_never_committed(ha_cluster: RedisClusterProcesses) -> None:
    url = ha_cluster.url(part_bytes="64KiB", wait_replicas=1)
    dcp.save(sd(1.0), storage_writer=KVStorageWriter(url), checkpoint_id="old")
    engine = open_store(url)
    plain = ha_cluster.url(part_bytes="64KiB")  # no WAIT: the commit check is what refuses
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests._writer", plain, "big", "64", "4"],  # 256 MiB
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(engine.scan(data_prefix(engine.prefix, "big"))):
        assert writer.poll() is None and time.monotonic() < deadline, writer.stderr.read()
        time.sleep(0.01)
    kill(ha_cluster.primaries()[1])
    _, err = writer.communicate(timeout=120)
    # Either way no partial checkpoint: the save fails clearly, or (if the failover happened
    # before anything reached the dead primary) it commits whole.
    if writer.returncode != 0:
        # The commit is refused across the change of primaries (or, if the failover took
        # too long, the cluster was unreachable).
        assert "failed over" in err or "cannot reach" in err, err[-3000:]
        assert [i.checkpoint_id for i in list_checkpoints(url)] == ["old"]
    else:
        back = {f"t{i}": torch.zeros(4 << 18) for i in range(64)}
        dcp.load(back, storage_reader=KVStorageReader(url, checkpoint_id="big"))
        assert all(torch.equal(back[f"t{i}"], torch.full((4 << 18,), float(i))) for i in range(64))
    old = sd(0.0)
    dcp.load(old, storage_reader=KVStorageReader(url, checkpoint_id="old"))
    assert all(torch.equal(old[k], v) for k, v in sd(1.0).items())
    # The cluster (with a promoted replica) takes the next save.
    ha_cluster.wait_ok()
    dcp.save(
        sd(3.0),
        storage_writer=KVStorageWriter(plain),
        checkpoint_id="next",
    )
    assert latest_checkpoint(url) == "next"


def test_tls_cluster_with_client_certificates(tmp_path: Path) -> None:
    from tests.test_reliability import make_tls_files

    files = make_tls_files(tmp_path)
    tls = RedisClusterProcesses(tmp_path / "tls", masters=3, tls=files)
    try:
        url = tls.url(part_bytes="64KiB")
        assert url.startswith("rediss+cluster://")
        spawn(_dist.save_worker, 2, url, "tls")
        _dist.load_single_process(url, "tls")
        assert [i.checkpoint_id for i in list_checkpoints(url)] == ["tls"]
        assert verify(url, "tls").ok
        # Without the CA the server's certificate is refused: a clear error, not a hang.
        untrusted = url.replace(f"ssl_ca_certs={files['ca.crt']}&", "")
        with pytest.raises(Exception, match="Redis Cluster"):
            list_checkpoints(untrusted)
    finally:
        tls.stop()
