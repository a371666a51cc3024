"""The engine contract, run against real LMDB and a real redis-server."""

from __future__ import annotations

import random
from collections.abc import Iterator

import fakeredis
import lmdb
import pytest

from kvckpt import StoreUnavailableError, open_store
from kvckpt.engines.base import DEFAULT_PART_BYTES
from kvckpt.engines.lmdb import LMDBEngine, close_idle_environments
from kvckpt.engines.redis import RedisEngine
from kvckpt.format import checksum, new_checksum
from kvckpt.testing.engine_checks import ENGINE_CHECKS
from kvckpt.testing.engine_checks import read_values as collect


@pytest.mark.parametrize("check", ENGINE_CHECKS, ids=lambda c: c.__name__)
def test_engine_contract(store_url: str, check) -> None:  # type: ignore[no-untyped-def]
    """Every check of kvckpt.testing.engine_checks, which third-party engines run too."""
    check(lambda: open_store(store_url))


def test_lmdb_map_grows_instead_of_failing(tmp_path) -> None:
    engine = LMDBEngine(str(tmp_path / "s"), map_size=1 << 20)  # 1 MiB map
    payload = memoryview(bytearray(b"\x01" * (64 << 20)))
    engine.put_many([(f"k/{i}", payload) for i in range(3)])  # 192 MiB
    assert engine.get("k/2") == bytes(payload)


def test_lmdb_two_engines_one_env_in_a_process(tmp_path) -> None:
    a = LMDBEngine(str(tmp_path / "s"))
    b = LMDBEngine(str(tmp_path / "s"))
    a.put_many([("x", b"1")])
    assert b.get("x") == b"1"
    a.close()
    assert b.get("x") == b"1"


def test_lmdb_close_idle_environments_of_one_path(tmp_path) -> None:
    """Deleting one store's directory must not unmap another store a training job keeps
    saving into (its next save would fault every page in again)."""
    import os

    from kvckpt.engines.lmdb import _SharedEnv, close_idle_environments

    kept, dropped = str(tmp_path / "kept"), str(tmp_path / "dropped")
    for path in (kept, dropped):
        engine = LMDBEngine(path)
        engine.put_many([("x", b"1")])
        engine.close()  # idle now: still open and mapped
    open_paths = {path for pid, path in _SharedEnv._envs if pid == os.getpid()}
    assert {os.path.realpath(kept), os.path.realpath(dropped)} <= open_paths
    close_idle_environments(dropped)
    open_paths = {path for pid, path in _SharedEnv._envs if pid == os.getpid()}
    assert os.path.realpath(kept) in open_paths
    assert os.path.realpath(dropped) not in open_paths
    assert LMDBEngine(dropped).get("x") == b"1"  # reopens on demand
    close_idle_environments()


def test_lmdb_engine_collected_while_a_store_opens_does_not_hang(tmp_path) -> None:
    """A garbage collection can finalize an engine on the thread that is opening another
    store, inside the lock that guards the shared environments. The finalizer leaves its
    reference for the lock's next holder instead of waiting for the lock forever."""
    import gc
    import threading

    from kvckpt.engines._lmdb_env import _SharedEnv

    first = LMDBEngine.from_url(f"lmdb://{tmp_path / 'a'}")
    first.put_many([("k", b"v")])
    shared = first._env

    def collect_inside_the_lock() -> None:
        nonlocal first
        with _SharedEnv._lock:
            del first
            gc.collect()

    thread = threading.Thread(target=collect_inside_the_lock, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the finalizer waited for the lock its own thread holds"
    assert shared.refs == 1  # left for the lock's next holder
    second = LMDBEngine.from_url(f"lmdb://{tmp_path / 'b'}")
    second.put_many([("k", b"v")])  # opens b: releases a's reference on the way
    assert shared.refs == 0 and not _SharedEnv._dropped
    second.close()


def test_lmdb_reads_are_zero_copy_views(tmp_path) -> None:
    engine = LMDBEngine(str(tmp_path / "s"))
    engine.put_many([("v", b"hello")])
    seen = []
    engine.get_many(["v"], lambda i, v: seen.append((type(v), v.readonly)))
    assert seen == [(memoryview, True)]


def test_lmdb_default_parts_fill_whole_overflow_pages(tmp_path) -> None:
    """A default part and LMDB's 16-byte page header take 1024 pages of 4 KiB (4 MiB of pages
    of any size), where a part of exactly 4 MiB would take one page more."""
    engine = LMDBEngine(str(tmp_path / "s"))
    assert engine.max_value_bytes == DEFAULT_PART_BYTES
    engine.put_many([("a", bytes(DEFAULT_PART_BYTES)), ("b", bytes(DEFAULT_PART_BYTES))])
    engine.close()
    close_idle_environments(engine.path)
    env = lmdb.open(str(tmp_path / "s"), readonly=True, lock=False)
    try:
        assert env.stat()["overflow_pages"] == 2 * (4 * 1024 * 1024 // env.stat()["psize"])
    finally:
        env.close()


def test_unreachable_redis_names_host_and_hides_password(redis_server) -> None:
    from tests.conftest import free_port

    port = free_port()
    engine = open_store(f"redis://admin:hunter2@127.0.0.1:{port}/0")
    with pytest.raises(StoreUnavailableError) as info:
        engine.get("x")
    assert f"127.0.0.1:{port}" in str(info.value)
    assert "hunter2" not in str(info.value)
    assert "***" in str(info.value)


def test_redis_transact_logic_with_fakeredis() -> None:
    """Fast logic check of the WATCH/MULTI path (the real-server version runs above)."""
    engine = RedisEngine.from_url("redis://fake:6379/0")
    engine._client_obj = fakeredis.FakeRedis()
    engine.transact(["m"], lambda cur: {"m": b"1", "n": b"2"})
    engine.transact(["m", "n"], lambda cur: {"m": cur[0] + cur[1], "n": None})
    assert engine.get("m") == b"12"
    assert engine.get("n") is None


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_get_into_reads_into_buffers(redis_url: str, protocol: int) -> None:
    engine = open_store(f"{redis_url}?protocol={protocol}")
    engine.put_many([("g/a", b"a" * 100), ("g/b", b"b" * (3 << 20)), ("g/c", b"")])
    bufs = [
        memoryview(bytearray(100)),
        memoryview(bytearray(3 << 20)),
        memoryview(bytearray(0)),
        memoryview(bytearray(7)),
        memoryview(bytearray(5)),
    ]
    sizes = engine.get_into(["g/a", "g/b", "g/c", "g/missing", "g/a"], bufs)
    assert sizes == [100, 3 << 20, 0, None, 100]  # the last one did not fit: size reported
    assert bytes(bufs[0]) == b"a" * 100 and bytes(bufs[1]) == b"b" * (3 << 20)
    # The connection is still in sync after a mismatch.
    assert engine.get("g/a") == b"a" * 100


def test_lmdb_get_into(lmdb_url: str) -> None:
    engine = open_store(lmdb_url)
    engine.put_many([("x", b"12345")])
    bufs = [memoryview(bytearray(5)), memoryview(bytearray(2)), memoryview(bytearray(1))]
    assert engine.get_into(["x", "x", "nope"], bufs) == [5, 5, None]
    assert bytes(bufs[0]) == b"12345"


def test_redis_put_many_hashes_across_pipelined_batches(redis_server, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    """Batches flushed mid-stream (pipeline_bytes) keep each digest with its value's position."""
    engine = open_store(redis_server.url(pipeline_bytes="1MiB"))
    rng = random.Random(12)
    values = [(f"b/{i}", rng.randbytes(rng.choice([10, 300_000, 700_000]))) for i in range(12)]
    seen: dict[int, int | None] = {}
    engine.put_many(values, on_value=seen.__setitem__, hasher=new_checksum)
    assert seen == {i: checksum(v) for i, (_, v) in enumerate(values)}
    assert collect(engine, [k for k, _ in values]) == [v for _, v in values]


def _in_forked_child(check) -> int:  # type: ignore[no-untyped-def]
    """Run ``check()`` in a forked child; its exit code (0: it returned True)."""
    import os

    pid = os.fork()
    if pid == 0:
        try:
            code = 0 if check() else 1
        except BaseException:
            code = 2
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_lmdb_store_opens_in_a_forked_child(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LMDBEngine(str(tmp_path))
    engine.put_many([("k", b"v")])
    # Nothing in flight at the fork (Megatron's async save forks like this): the child closes
    # its inherited handle and opens the store afresh; the parent's handle is unaffected.
    assert _in_forked_child(lambda: LMDBEngine(str(tmp_path)).get("k") == b"v") == 0
    engine.put_many([("k2", b"w")])
    assert engine.get("k") == b"v" and engine.get("k2") == b"w"


def test_lmdb_fork_during_a_transaction_is_refused_in_the_child(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = LMDBEngine(str(tmp_path))
    engine.put_many([("k", b"v")])

    def refused() -> bool:
        try:
            LMDBEngine(str(tmp_path)).get("k")
        except StoreUnavailableError as e:
            return "forked" in str(e)
        return False

    # A parent thread inside a read when the process forks: closing the child's copy would
    # end that read's slot in the shared lock file, so the child refuses with a clear error.
    with engine._env.reading():
        assert _in_forked_child(refused) == 0
    assert engine.get("k") == b"v"


@pytest.fixture
def small_output_buffer(redis_server, redis_url: str) -> Iterator[str]:
    """The shared test server, made to drop any client whose replies pile up past 8 MiB."""
    client = redis_server.client()
    before = client.config_get("client-output-buffer-limit")["client-output-buffer-limit"]
    client.config_set("client-output-buffer-limit", "normal 8mb 8mb 0")
    try:
        yield redis_url
    finally:
        client.config_set("client-output-buffer-limit", before)
        client.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_redis_reads_request_only_read_ahead_bytes_at_a_time(
    small_output_buffer: str, protocol: int
) -> None:
    """Reads keep at most ``read_ahead_bytes`` of GETs outstanding (and always the next two
    values), so the server never holds a whole batch of replies: a server that drops clients
    over 8 MiB of pending output serves a 40 MiB read with a 4 MiB read-ahead, and drops a
    read whose read-ahead lets replies pile up."""
    url = f"{small_output_buffer}?protocol={protocol}"
    mib = 1 << 20
    sizes = [mib] * 30 + [3 * mib, 0, 17] + [4096] * 2000 + [mib] * 2
    values = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    keys = [f"ra/{i}" for i in range(len(values))]
    open_store(url).put_many(zip(keys, values, strict=True))
    engine = open_store(f"{url}&read_ahead_bytes=4MiB")

    bufs = [memoryview(bytearray(n)) for n in sizes] + [memoryview(bytearray(1))]
    assert engine.get_into([*keys, "ra/missing"], bufs) == [*sizes, None]
    assert all(bytes(b) == v for b, v in zip(bufs, values, strict=False))
    assert collect(engine, [*keys, "ra/missing"]) == [*values, None]

    greedy = open_store(f"{url}&read_ahead_bytes=1GiB")
    with pytest.raises(StoreUnavailableError, match="cannot reach Redis"):
        greedy.get_into(keys, [memoryview(bytearray(n)) for n in sizes])


def test_redis_read_ahead_sends_groups_within_the_window() -> None:
    """The request window's arithmetic, on a stand-in connection that records what is sent."""
    from kvckpt.engines._resp import GetRequests

    class Recorder:
        def __init__(self) -> None:
            self.sends: list[int] = []  # GETs per send

        def send_packed_command(self, parts: list[bytearray], check_health: bool) -> None:
            self.sends.append(bytes(parts[0]).count(b"GET"))

    def replay(sizes: list[int], window: int) -> tuple[list[int], int]:
        conn = Recorder()
        keys = [f"k{i}" for i in range(len(sizes))]
        requests = GetRequests(conn, keys, sizes.__getitem__, window)
        most = 0
        for i in range(len(sizes)):
            requests.send_ahead_of(i)
            assert requests.sent >= min(len(sizes), i + 2)  # the next value is always asked for
            most = max(most, requests.outstanding)
            requests.received(i)
        assert requests.outstanding == 0 and sum(conn.sends) == len(sizes)
        return conn.sends, most

    sends, most = replay([4 << 20] * 64, 16 << 20)  # 4 MiB parts: 4 in flight, one sent per reply
    assert most == 16 << 20 and sends[0] == 4 and set(sends[1:]) == {1}
    sends, most = replay([4096] * 10_000, 16 << 20)  # tiny values: few, large sends
    assert most <= 16 << 20 and len(sends) < 30
    sends, most = replay([64 << 20] * 4, 16 << 20)  # parts over the window: still two in flight
    assert most == 128 << 20 and sends == [2, 1, 1]


def test_redis_over_a_unix_socket(tmp_path) -> None:
    """unix:// URLs (a Redis on the same node), with a password, a database and options, read
    and write through the same zero-copy paths as TCP; the password never shows."""
    import redis
    import torch
    import torch.distributed.checkpoint as dcp

    from kvckpt import KVStorageReader, KVStorageWriter
    from kvckpt.testing import RedisServer

    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "srv", "--unixsocket", str(sock), "--unixsocketperm", "700")
    try:
        server.client().config_set("requirepass", "s3cret")
        url = f"unix://:s3cret@{sock}?db=3&prefix=job&read_ahead_bytes=1MiB"
        sd = {"w": torch.randn(300_000), "b": torch.arange(10)}
        dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id="s1")
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="s1")
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        engine = open_store(url)
        assert engine.address == str(sock)
        assert "s3cret" not in engine.url and "s3cret" not in repr(KVStorageReader(url))
        direct = redis.Redis(unix_socket_path=str(sock), password="s3cret", db=3)
        keys = list(direct.scan_iter())
        assert b"{job}/meta/s1" in keys and all(k.startswith((b"job/", b"{job}/")) for k in keys)
        direct.close()
        with pytest.raises(StoreUnavailableError) as info:
            open_store(f"unix://:wrong@{sock}?db=3").get("x")
        assert str(sock) in str(info.value) and "wrong" not in str(info.value)
    finally:
        server.stop()


def test_a_redis_server_on_huge_pages_as_the_tutorial_starts_it(tmp_path) -> None:
    """docs/TUTORIAL.md's server, its allocator on transparent huge pages, starts with those
    settings (jemalloc reports ``opt.thp: "always"``; Redis leaves huge pages on for itself)
    and serves a save and a load bit-exact. How many huge pages the kernel then gives it is
    the benchmark's to measure."""
    import torch
    import torch.distributed.checkpoint as dcp

    from kvckpt import KVStorageReader, KVStorageWriter
    from kvckpt.testing import RedisServer

    env = {"MALLOC_CONF": "thp:always", "JE_MALLOC_CONF": "thp:always"}
    server = RedisServer(tmp_path / "srv", "--disable-thp", "no", env=env)
    client = server.client()
    try:
        if not str(client.info("memory")["mem_allocator"]).startswith("jemalloc"):
            pytest.skip("this redis-server's allocator is not jemalloc")
        assert 'opt.thp: "always"' in client.execute_command("MEMORY", "MALLOC-STATS").decode()
        assert client.config_get("disable-thp") == {"disable-thp": "no"}
        sd = {"w": torch.randn(4 << 20), "b": torch.arange(10)}
        dcp.save(sd, storage_writer=KVStorageWriter(server.url()), checkpoint_id="s1")
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=KVStorageReader(server.url()), checkpoint_id="s1")
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("hashed", [True, False])
def test_lmdb_reads_on_two_threads_land_every_value_and_its_digest(
    tmp_path, monkeypatch, hashed: bool
) -> None:
    from kvckpt.engines import _parallel

    monkeypatch.setattr(_parallel, "_COPY_PIECE", 1 << 20)  # split large values across threads
    rng = random.Random(3)
    values = [rng.randbytes(n) for n in (0, 1, 4096, 3 << 20, 5 << 20, 1 << 20, 777)]
    engine = LMDBEngine(str(tmp_path / "s"))
    engine.put_many([(f"k{i}", v) for i, v in enumerate(values)])
    keys = [f"k{i}" for i in range(len(values))] + ["missing"]
    buffers = [memoryview(bytearray(len(v))) for v in values] + [memoryview(bytearray(8))]
    reported: dict[int, int | None] = {}
    sizes = engine.get_into(
        keys, buffers, on_value=reported.__setitem__, hasher=new_checksum if hashed else None
    )
    assert sizes == [len(v) for v in values] + [None]
    assert [bytes(b) for b in buffers[:-1]] == values
    assert sorted(reported) == list(range(len(values)))
    if hashed:
        assert reported == {i: checksum(memoryview(v)) for i, v in enumerate(values)}


def test_lmdb_saves_report_each_values_digest_hashed_ahead_of_its_copy(tmp_path) -> None:
    rng = random.Random(4)
    values = [rng.randbytes(n) for n in (5, 2 << 20, 0, 3 << 20)]
    engine = LMDBEngine(str(tmp_path / "s"), txn_bytes=2 << 20)  # several write transactions
    reported: dict[int, int | None] = {}
    engine.put_many(
        [(f"k{i}", v) for i, v in enumerate(values)],
        on_value=reported.__setitem__,
        hasher=new_checksum,
    )
    assert reported == {i: checksum(memoryview(v)) for i, v in enumerate(values)}
    assert [engine.get(f"k{i}") for i in range(len(values))] == values
