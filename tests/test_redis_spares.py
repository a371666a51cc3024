"""Redis retention keeps the dropped checkpoint's values as spares, and the next save writes
into their memory (RENAME, PERSIST, SETRANGE) instead of making the server allocate fresh
pages. Real redis-server; correctness only (the speed is benchmarks/job.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, Tiers, gc, list_checkpoints, open_store
from kvckpt.errors import StoreFullError
from kvckpt.keys import data_prefix, spare_prefix
from kvckpt.testing import RedisServer

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
    redis_server.client().config_resetstat()
    save(redis_url, state(10, 0.0), "s0")
    assert spares(redis_server) == []
    save(redis_url, state(10, 1.0), "s1")  # drops s0: its values become spares
    # With no spare to take over, plain SETs (SETRANGE into a new key allocates and zeroes);
    # the RENAMEs are the retirement of s0's four values.
    assert commands(redis_server, "setrange") == 0
    assert commands(redis_server, "rename") == 4
    kept = spares(redis_server)
    assert len(kept) == 3 + 1  # 10 MiB in 4 MiB parts, and the small tensor
    client = redis_server.client()
    assert all(0 < client.ttl(k) <= 900 for k in kept)
    save(redis_url, state(10, 2.0), "s2")  # writes over s0's spares, drops s1
    assert commands(redis_server, "setrange") == 3  # the three large parts
    assert commands(redis_server, "rename") == 4 + 3 + 4  # s0 retired, 3 taken over, s1 retired
    assert [c.checkpoint_id for c in list_checkpoints(redis_url)] == ["s2"]
    assert_equal(load(redis_url, "s2", state(10, 2.0)), state(10, 2.0))
    # The new checkpoint's values took the spares over without their expiry.
    data = list(client.scan_iter(match="kvckpt/data/s2/*"))
    assert data and all(client.ttl(k) == -1 for k in data)
    assert len(spares(redis_server)) == 4  # s1's values now


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
    delete_checkpoint(redis_url, "d0")
    assert spares(redis_server) == []


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
    redis_server.client().config_resetstat()
    save(redis_url, state(5, 0.0), "s0")
    save(redis_url, state(5, 1.0), "s1")  # s0's values become spares
    grown = {**state(5, 2.0), "new": torch.rand(MIB)}  # 4 MiB more, no spare of its own
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
