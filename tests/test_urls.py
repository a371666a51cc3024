import sys
import textwrap

import pytest

import kvckpt
from kvckpt import InvalidCheckpointIdError, InvalidURLError, open_store
from kvckpt.engines.lmdb import LMDBEngine
from kvckpt.engines.redis import RedisEngine
from kvckpt.urls import mask_url, parse_size


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:s3cret@host/1?prefix=a", "rediss://:***@host/1?prefix=a"),
        ("redis://s3cret@host", "redis://***@host"),
        ("redis://host?password=s3cret&db=2", "redis://host?password=***&db=2"),
        ("lmdb:///dev/shm/x", "lmdb:///dev/shm/x"),
    ],
)
def test_mask_url_hides_passwords(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_builtin_schemes_open_the_right_engine(tmp_path) -> None:
    assert isinstance(open_store(f"lmdb://{tmp_path}"), LMDBEngine)
    for url in ("redis://localhost:6379/0", "rediss://localhost", "unix:///tmp/r.sock?db=2"):
        assert isinstance(open_store(url), RedisEngine)


def test_prefix_option(tmp_path) -> None:
    assert open_store(f"lmdb://{tmp_path}?prefix=run7").prefix == "run7"
    assert open_store("redis://h/0?prefix=run7").prefix == "run7"
    assert open_store("redis://h/0").prefix == kvckpt.urls.DEFAULT_PREFIX


def test_engine_object_passes_through(tmp_path) -> None:
    engine = open_store(f"lmdb://{tmp_path}")
    assert open_store(engine) is engine


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("s3://bucket/x", "unsupported store URL scheme 's3'"),
        ("/dev/shm/ckpt", "has no scheme"),
        ("lmdb://relative/dir", "names a host"),
        ("redis://h:6379/0?prefix=bad/name", "invalid prefix"),
        ("redis://h:notaport/0", "invalid port"),
        ("redis://h/0?part_bytes=1GiB", "must be between 1 and"),
        ("lmdb:///tmp/x?bogus=1", "unknown option"),
    ],
)
def test_bad_urls_get_clear_errors(url: str, fragment: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_store(url)
    assert fragment in str(info.value)


def test_unsupported_scheme_lists_known_ones() -> None:
    with pytest.raises(InvalidURLError) as info:
        open_store("foo://bar")
    assert "lmdb" in str(info.value) and "redis" in str(info.value)
    assert "kvckpt.engines" in str(info.value)


def test_bad_url_errors_mask_the_password() -> None:
    with pytest.raises(InvalidURLError) as info:
        open_store("redis://u:hunter2@h:6379/0?prefix=a*b")
    assert "hunter2" not in str(info.value)


def test_repr_never_shows_password() -> None:
    engine = open_store("redis://u:hunter2@h:6379/0")
    writer = kvckpt.KVStorageWriter(engine, checkpoint_id="x")
    for text in (repr(engine), engine.url, repr(writer), str(writer)):
        assert "hunter2" not in text


def test_sizes() -> None:
    assert parse_size("1048576") == 1 << 20
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1MB") == 1_000_000


@pytest.mark.parametrize("bad", ["", "a/b", "{x}", "a*", "sp ace", "-lead", "x" * 201, "é"])
def test_invalid_checkpoint_ids(bad: str, tmp_path) -> None:
    with pytest.raises(InvalidCheckpointIdError, match="invalid checkpoint id"):
        kvckpt.KVStorageWriter(f"lmdb://{tmp_path}", checkpoint_id=bad)


def test_entry_point_plugin_registers_a_scheme(tmp_path, monkeypatch) -> None:
    """A third-party package registers a scheme under the 'kvckpt.engines' entry-point group."""
    pkg = tmp_path / "site"
    (pkg / "memplugin").mkdir(parents=True)
    (pkg / "memplugin" / "__init__.py").write_text(
        textwrap.dedent("""
        from kvckpt.engines.lmdb import LMDBEngine

        def open_mem(url):
            return LMDBEngine(url.split("://", 1)[1])
    """)
    )
    dist = pkg / "memplugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: memplugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvckpt.engines]\nmem = memplugin:open_mem\n")
    monkeypatch.syspath_prepend(str(pkg))
    engine = open_store(f"mem://{tmp_path / 'store'}")
    assert isinstance(engine, LMDBEngine)
    sys.modules.pop("memplugin", None)


def test_cluster_urls_parse_and_mask() -> None:
    engine = open_store("redis+cluster://trainer:s3cret@10.0.0.1:7000,10.0.0.2:7001?prefix=run1")
    assert engine.startup == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert engine.prefix == "run1" and engine.username == "trainer"
    assert "s3cret" not in engine.url and "s3cret" not in repr(engine)
    assert open_store("rediss+cluster://h:1").tls
    with pytest.raises(InvalidURLError, match="host:port pairs"):
        open_store("redis+cluster://h1:7000,h2")


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
@pytest.mark.parametrize(
    "query, problem",
    [("part_bytes=0", "part_bytes=0"), ("wait_replicas=-1", "wait_replicas must be >= 0")],
)
def test_redis_option_checks_name_the_url(scheme: str, query: str, problem: str) -> None:
    with pytest.raises(InvalidURLError, match=problem) as e:
        open_store(f"{scheme}://u:s3cret@h:7000?{query}")
    assert "s3cret" not in str(e.value) and "u:***@h:7000" in str(e.value)
