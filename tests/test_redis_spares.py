"""Redis retention keeps the dropped checkpoint's values as spares, and the next save writes
into their memory (RENAME, PERSIST, SETRANGE) instead of making the server allocate fresh
pages. Real redis-server; correctness only (the speed is benchmarks/job.py's)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, Tiers, gc, list_checkpoints, open_store
from kvckpt.engines._redis_spares import make_ahead, stop_ahead, wait_ahead
from kvckpt.errors import StoreFullError
from kvckpt.keys import data_prefix, spare_prefix
from kvckpt.ready import first_save_values
from kvckpt.testing import RedisServer, free_port
from tests import _dist
from tests._spawn import spawn

MIB = 1 << 20


def state(mib: float, value: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int(value * 1000))
    return {
        "big": torch.rand(int(mib * MIB) // 4, generator=gen),
        "small": torch.arange(100.0) + value,
    }


def load(url: str, checkpoint_id: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id=checkpoint_id))
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def spares(server: RedisServer) -> list[bytes]:
    return sorted(server.client().scan_iter(match=spare_prefix("kvckpt") + "*"))


def commands(server: RedisServer, name: str) -> int:
    return int(server.client().info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


def save(url: str, sd: dict[str, torch.Tensor], checkpoint_id: str, keep: int = 1) -> None:
    writer = KVStorageWriter(url, keep_last=keep)
    dcp.save(sd, storage_writer=writer, checkpoint_id=checkpoint_id)


def test_retention_keeps_spares_and_the_next_save_writes_over_them(
    redis_server: RedisServer, redis_url: str
) -> None:
    client = redis_server.client()
    save(redis_url, state(10, 0.0), "s0")
    wait_ahead()
    # Retention has nothing to delete yet (keep_last=1), so spares were made ahead: one per
    # value of 64 KiB or more, of its size (10 MiB in 4 MiB parts; the small tensor is SET).
    ahead = spares(redis_server)
    assert sorted(client.strlen(k) for k in ahead) == [2 * MIB + 128, 4 * MIB - 64, 4 * MIB - 64]
    assert all(0 < client.ttl(k) <= 900 for k in ahead)
    client.config_resetstat()
    save(redis_url, state(10, 1.0), "s1")  # writes over them, drops s0: s0's values are spares
    assert commands(redis_server, "setrange") == 3
    assert commands(redis_server, "rename") == 3 + 4  # three taken over, s0's four retired
    kept = spares(redis_server)
    assert len(kept) == 3 + 1
    assert all(0 < client.ttl(k) <= 900 for k in kept)
    save(redis_url, state(10, 2.0), "s2")  # writes over s0's spares, drops s1
    assert commands(redis_server, "setrange") == 3 + 3
    assert commands(redis_server, "rename") == 7 + 3 + 4
    assert [c.checkpoint_id for c in list_checkpoints(redis_url)] == ["s2"]
    assert_equal(load(redis_url, "s2", state(10, 2.0)), state(10, 2.0))
    # The new checkpoint's values took the spares over without their expiry.
    data = list(client.scan_iter(match="kvckpt/data/s2/*"))
    assert data and all(client.ttl(k) == -1 for k in data)
    assert len(spares(redis_server)) == 4  # s1's values now


def test_the_saves_before_retention_deletes_anything_write_into_spares_made_ahead(
    redis_server: RedisServer, redis_url: str
) -> None:
    """keep_last=2: the second and third saves find spares that were made after the save
    before them; from the third on, retention's spares take over."""
    client = redis_server.client()
    client.config_resetstat()
    for i in range(4):
        save(redis_url, state(10, float(i)), f"k{i}", keep=2)
        wait_ahead()
    # k1 and k2 wrote over spares made ahead, k3 over k0's values, retired by k2's retention
    assert commands(redis_server, "setrange") == 3 * (2 + 1) + 3 * 2  # made ahead, taken over
    assert [c.checkpoint_id for c in list_checkpoints(redis_url)] == ["k3", "k2"]
    for i in (2, 3):
        assert_equal(load(redis_url, f"k{i}", state(10, float(i))), state(10, float(i)))
    assert len(spares(redis_server)) == 4  # k1's values, retired by k3's retention


def test_no_spares_are_made_ahead_without_room_for_twice_their_bytes(tmp_path) -> None:
    server = RedisServer(tmp_path / "r", "--maxmemory", str(64 * MIB))
    try:
        url = server.url()
        save(url, state(24, 0.0), "m0")  # 24 MiB in, about 39 MiB free: less than 48
        wait_ahead()
        assert spares(server) == []
        assert_equal(load(url, "m0", state(24, 0.0)), state(24, 0.0))
    finally:
        server.stop()


def test_spares_ahead_wait_for_the_saves_commit(redis_server: RedisServer, redis_url: str) -> None:
    """The server runs one command at a time: spares are made once the save that asked for
    them has committed, not during its commit."""
    url, client = redis_server.url(), redis_server.client()
    wanted = [(f"{spare_prefix('kvckpt')}0/x/{i}", 128 * 1024) for i in range(3)]
    make_ahead(client, url, wanted, 60_000, after="commit-record")
    time.sleep(0.3)
    assert spares(redis_server) == []
    client.set("commit-record", b"1")
    wait_ahead()
    assert [client.strlen(k) for k in spares(redis_server)] == [128 * 1024] * 3


def test_get_ready_makes_spares_for_the_first_save(
    redis_server: RedisServer, redis_url: str
) -> None:
    sd = state(10, 0.0)
    writer = KVStorageWriter(redis_url)  # no keep_last: no spares made after the save
    writer.get_ready(sd)
    wait_ahead()
    client = redis_server.client()
    made = spares(redis_server)
    assert sorted(client.strlen(k) for k in made) == [2 * MIB + 128, 4 * MIB - 64, 4 * MIB - 64]
    client.config_resetstat()
    dcp.save(sd, storage_writer=writer, checkpoint_id="f0")
    assert commands(redis_server, "setrange") == 3  # each large value wrote into its spare
    assert spares(redis_server) == []
    assert_equal(load(redis_url, "f0", sd), sd)


def test_get_ready_in_a_job_of_two_ranks_makes_spares_only_for_what_each_alone_saves(
    redis_url: str,
) -> None:
    spawn(_dist.first_save_spares_worker, 2, redis_url)


def test_first_save_values_of_plain_tensors_in_a_larger_job_are_unknown() -> None:
    """Which rank saves a replicated tensor, DCP decides from every rank's plan."""
    assert first_save_values(state(10, 0.0), 1, 2, "kvckpt", 4 * MIB) == []


def test_a_save_stops_the_spares_being_made_ahead(
    redis_server: RedisServer, redis_url: str
) -> None:
    """stop_ahead (as a save into the server calls it) returns once the thread has stopped,
    here while it waits for a commit record that never comes: nothing is made."""
    wanted = [(f"{spare_prefix('kvckpt')}0/x/{i}", 256 * 1024) for i in range(4)]
    make_ahead(redis_server.client(), "127.0.0.1:1", wanted, 60_000, after="never")
    started = time.monotonic()
    stop_ahead("127.0.0.1:1")
    assert time.monotonic() - started < 5
    assert not [t for t in threading.enumerate() if t.name == "kvckpt-redis-spares"]
    assert spares(redis_server) == []


def test_an_id_saved_again_gets_no_spares_ahead(redis_server: RedisServer, redis_url: str) -> None:
    """Its commit record exists before its commit: spares made then would hold the commit up."""
    save(redis_url, state(10, 0.0), "same", keep=3)
    wait_ahead()
    assert len(spares(redis_server)) == 3
    save(redis_url, state(10, 1.0), "same", keep=3)  # writes over them
    wait_ahead()
    assert spares(redis_server) == []
    assert_equal(load(redis_url, "same", state(10, 1.0)), state(10, 1.0))


def test_no_spares_ahead_where_the_server_may_evict(tmp_path) -> None:
    server = RedisServer(
        tmp_path / "r", "--maxmemory", str(1 << 30), "--maxmemory-policy", "allkeys-lru"
    )
    try:
        url = server.url(allow_eviction=1)
        save(url, state(10, 0.0), "e0")
        wait_ahead()
        assert spares(server) == []
    finally:
        server.stop()


def test_spares_that_cannot_be_made_are_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import redis

    client = redis.Redis(port=free_port(), socket_connect_timeout=1)  # nothing listens
    with caplog.at_level(logging.INFO, logger="kvckpt.engines._redis_spares"):
        make_ahead(client, "redis://nowhere", [("kvckpt/spare/0/x/0", MIB)], 1000)
        wait_ahead()
    assert "spares ahead of the next save to redis://nowhere not made" in caplog.text


@pytest.mark.parametrize("mib", [5.5, 14.0], ids=["spares-longer", "spares-shorter"])
def test_spares_of_another_size_still_give_exact_values(
    redis_server: RedisServer, redis_url: str, mib: float
) -> None:
    """A state dict that changed size between saves: a longer spare is replaced by a SET, a
    shorter one grows; every value ends up exactly the new bytes."""
    save(redis_url, state(10, 0.0), "a")
    save(redis_url, state(10, 1.0), "b")
    save(redis_url, state(mib, 2.0), "c")
    assert_equal(load(redis_url, "c", state(mib, 2.0)), state(mib, 2.0))
    engine = open_store(redis_url)
    assert engine.value_sizes(list(engine.scan("kvckpt/data/c/")))  # all present


def test_spare_ttl_0_deletes_at_once(redis_server: RedisServer, redis_url: str) -> None:
    url = redis_server.url(spare_ttl=0)
    save(url, state(5, 0.0), "x0")
    save(url, state(5, 1.0), "x1")
    assert spares(redis_server) == []
    assert_equal(load(url, "x1", state(5, 1.0)), state(5, 1.0))


def test_gc_drops_spares(redis_server: RedisServer, redis_url: str) -> None:
    save(redis_url, state(5, 0.0), "g0")
    save(redis_url, state(5, 1.0), "g1")
    assert spares(redis_server)
    gc(redis_url)
    assert spares(redis_server) == []
    assert_equal(load(redis_url, "g1", state(5, 1.0)), state(5, 1.0))


def test_an_explicit_delete_frees_the_memory(redis_server: RedisServer, redis_url: str) -> None:
    from kvckpt import delete_checkpoint

    save(redis_url, state(5, 0.0), "d0", keep=3)
    wait_ahead()
    ahead = spares(redis_server)  # made ahead of the next save, not from d0's values
    delete_checkpoint(redis_url, "d0")
    assert spares(redis_server) == ahead
    assert not list(redis_server.client().scan_iter(match=data_prefix("kvckpt", "d0") + "*"))


def test_a_tiers_replica_writes_over_its_spares(
    redis_server: RedisServer, redis_url: str, tmp_path
) -> None:
    tiers = Tiers([f"lmdb://{tmp_path}/local", redis_url], keep_last=1)
    for i in range(3):
        dcp.save(state(10, float(i)), storage_writer=tiers.writer(), checkpoint_id=f"t{i}")
        tiers.wait()
    tiers.close()
    assert len(spares(redis_server)) == 4
    assert [c.checkpoint_id for c in list_checkpoints(redis_url)] == ["t2"]
    assert_equal(load(redis_url, "t2", state(10, 2.0)), state(10, 2.0))


def test_preflight_counts_spares_as_room(
    redis_server: RedisServer, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server near maxmemory takes a save that fits into the spares it will write over."""
    from kvckpt.engines.redis import RedisEngine

    save(redis_url, state(8, 0.0), "p0")
    save(redis_url, state(8, 1.0), "p1")  # p0's 8 MiB are spares now
    asked: list[int] = []

    def preflight(self: RedisEngine, nbytes: int) -> None:
        asked.append(nbytes)
        if nbytes > 1 * MIB:
            raise StoreFullError("no room (test)")

    monkeypatch.setattr(RedisEngine, "preflight", preflight)
    save(redis_url, state(8, 2.0), "p2")
    assert len(asked) == 2 and asked[1] <= 1 * MIB < asked[0]
    monkeypatch.undo()
    assert_equal(load(redis_url, "p2", state(8, 2.0)), state(8, 2.0))


def test_only_the_values_with_a_spare_take_one_over(
    redis_server: RedisServer, redis_url: str
) -> None:
    save(redis_url, state(5, 0.0), "s0")
    save(redis_url, state(5, 1.0), "s1")  # s0's values become spares
    grown = {**state(5, 2.0), "new": torch.rand(MIB)}  # 4 MiB more, no spare of its own
    redis_server.client().config_resetstat()
    save(redis_url, grown, "s2")
    assert commands(redis_server, "setrange") == 2  # "big"'s two parts
    out = load(redis_url, "s2", grown)
    assert_equal(out, grown)


def test_a_value_of_the_default_part_size_takes_no_more_server_memory_than_its_bytes(
    redis_server: RedisServer, redis_url: str
) -> None:
    """redis-server rounds each value's allocation (its bytes and a string header) up to
    jemalloc's next size class: values of exactly 4 MiB would take 5 MiB each. The default
    part is 64 bytes under, and fills a 4 MiB allocation."""
    part = open_store(redis_url).max_value_bytes
    assert part == 4 * MIB - 64
    save(redis_url, state(10, 0.0), "s0")  # 10 MiB: two full parts and a partial one
    client = redis_server.client()
    sizes = {}
    for key in client.scan_iter(match=data_prefix("kvckpt", "s0") + "*"):
        n = client.strlen(key)
        if n == part:
            sizes[key] = client.memory_usage(key, samples=0)
    assert len(sizes) == 2
    assert all(usage <= 4 * MIB + 256 for usage in sizes.values()), sizes
    # the same value at exactly 4 MiB takes the next size class
    client.set("whole", b"\0" * (4 * MIB))
    assert client.memory_usage("whole", samples=0) > 4.5 * MIB
