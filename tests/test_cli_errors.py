"""Queries on a store that does not exist, errors that name the problem, exit codes, --json on
every command, gc --dry-run, and a command line that lists without importing torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp

import kvckpt
from kvckpt import (
    CheckpointNotFoundError,
    InvalidURLError,
    KVCheckpointError,
    KVStorageReader,
    KVStorageWriter,
    StoreFullError,
    StoreNotFoundError,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.catalog import mark_pending
from kvckpt.cli import EXIT_CODES, exit_code
from kvckpt.errors import (
    MetadataError,
    ReadOnlyStoreError,
    SaveAbandonedError,
    StoreUnavailableError,
)
from kvckpt.format import decode_metadata, decode_summary
from kvckpt.keys import data_prefix, meta_key
from kvckpt.manage import gc
from kvckpt.testing import RedisServer

from ._cli import ROOT, run


def save(url: str, cid: str) -> None:
    dcp.save(
        {"w": torch.randn(16, 8), "step": 3}, storage_writer=KVStorageWriter(url), checkpoint_id=cid
    )


# -- queries on a store that does not exist -------------------------------------------------


def test_queries_on_a_missing_lmdb_store_answer_none_and_create_nothing(tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path / 'first-run' / 'ckpt'}"
    assert latest_checkpoint(url) is None
    assert list_checkpoints(url) == []
    assert list_checkpoints(url, include_incomplete=True) == []
    assert not (tmp_path / "first-run").exists()
    # the command line keeps its clear error for a mistyped path
    result = run("ls", url)
    assert result.returncode == 3 and "no LMDB store at" in result.stderr


def test_queries_on_an_empty_redis_answer_none_and_write_nothing(redis_url: str) -> None:
    assert latest_checkpoint(redis_url) is None
    assert list_checkpoints(redis_url) == []
    client = open_store(redis_url)._client  # type: ignore[attr-defined]
    assert client.dbsize() == 0


# -- CheckpointNotFoundError is a FileNotFoundError ----------------------------------------


def test_checkpoint_not_found_is_a_file_not_found_error(lmdb_url: str) -> None:
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointNotFoundError, KVCheckpointError)
    assert issubclass(StoreNotFoundError, FileNotFoundError)
    save(lmdb_url, "here")
    with pytest.raises(FileNotFoundError) as info:
        KVStorageReader(lmdb_url, checkpoint_id="gone").read_record()
    assert isinstance(info.value, CheckpointNotFoundError)
    assert "'gone' not found" in str(info.value) and "'here'" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no LMDB store"):
        kvckpt.delete_checkpoint(f"{lmdb_url}-missing", "here")


# -- errors that name the problem -----------------------------------------------------------


def test_unknown_url_options_are_named_with_the_valid_ones(tmp_path: Path) -> None:
    for url, what, valid in (
        (f"lmdb://{tmp_path}?prefx=a", "LMDB URL", "map_size"),
        ("redis://127.0.0.1:1/0?prefx=a", "Redis URL", "socket_timeout"),
        ("redis+cluster://127.0.0.1:1?prefx=a", "Redis URL", "wait_replicas"),
    ):
        with pytest.raises(InvalidURLError) as info:
            open_store(url)
        text = str(info.value)
        assert "'prefx'" in text and "did you mean 'prefix'" in text, text
        assert what in text and "valid options:" in text and valid in text, text
        assert "unexpected keyword" not in text
    with pytest.raises(InvalidURLError, match="TLS options need a rediss:// URL"):
        open_store("redis://127.0.0.1:1/0?ssl_ca_certs=/x.pem")
    open_store("rediss://127.0.0.1:1/0?ssl_ca_certs=/x.pem&socket_timeout=5")  # both valid
    assert not any(tmp_path.iterdir())


def test_a_url_missing_its_slashes_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidURLError) as info:
        open_store(f"lmdb:{tmp_path}/ckpt")
    assert "lacks the '//'" in str(info.value) and f"'lmdb://{tmp_path}/ckpt'" in str(info.value)
    with pytest.raises(InvalidURLError) as info:
        open_store("redis:admin:hunter2@host:6379/0")
    assert "hunter2" not in str(info.value) and "'redis://admin:***@host:6379/0'" in str(info.value)


def test_db_index_out_of_range_names_the_url(redis_server: RedisServer) -> None:
    url = redis_server.url(db=99)
    result = run("ls", url)
    assert result.returncode == 2, result.stderr
    assert url in result.stderr and "no database 99" in result.stderr
    assert "CONFIG GET databases" in result.stderr


def test_a_password_the_server_needs_is_named_as_missing(server) -> None:
    srv = server()
    client = srv.client()
    client.config_set("requirepass", "hunter2")
    missing = run("ls", srv.url())
    assert missing.returncode == 4
    assert "requires a password" in missing.stderr and srv.url() in missing.stderr
    wrong = srv.url().replace("redis://", "redis://:wrong@")
    refused = run("ls", wrong)
    assert refused.returncode == 4 and "refused the credentials" in refused.stderr
    assert "wrong" not in refused.stderr
    right = srv.url().replace("redis://", "redis://:hunter2@")
    assert run("ls", right).returncode == 0


def test_redis_out_of_memory_is_store_full_on_every_write_path(server) -> None:
    srv = server()
    url = srv.url()
    engine = open_store(url)
    big = b"s" * (128 << 10)  # above the size sent as its own piece and the size reused
    engine.put_many([("spare-of-k3", big)])
    client = srv.client()
    client.set("filler", b"x" * (2 << 20))
    client.config_set("maxmemory", 1 << 20)  # already past it
    writes = {
        "k1": lambda: engine.put_many([("k1", b"small")]),  # coalesced with the commands
        "k2": lambda: engine.put_many([("k2", big)]),  # pipelined piece
        "k3": lambda: engine.put_many([("k3", big)], spare_of=lambda key: f"spare-of-{key}"),
        "{kvckpt}/index": lambda: engine.transact(
            ["{kvckpt}/index"], lambda current: {"{kvckpt}/index": b"\xff\x00binary"}
        ),
    }
    for key, write in writes.items():
        with pytest.raises(StoreFullError) as info:
            write()
        text = str(info.value)
        assert f"{key!r}" in text and url in text and "maxmemory" in text, text
        assert "Command #" not in text and "\\x" not in text and "binary" not in text, text
    # a save into the full server: StoreFullError, never redis-py's OutOfMemoryError
    with pytest.raises(BaseException) as failed:
        save(url, "late")
    assert exit_code(failed.value) == 6
    assert "OutOfMemoryError" not in str(failed.value)


def test_unknown_msgpack_extension_names_the_checkpoint() -> None:
    raw = msgpack.packb({"magic": "kvckpt", "version": 2, "x": msgpack.ExtType(5, b"\x00")})
    where = "checkpoint 'step-7' in lmdb:///dev/shm/ckpt"
    for decode in (decode_metadata, decode_summary):
        with pytest.raises(MetadataError) as info:
            decode(raw, where=where)
        assert where in str(info.value) and "extension type 5" in str(info.value)


# -- exit codes ---------------------------------------------------------------------------


def test_exit_codes_are_documented_and_distinct() -> None:
    assert sorted(EXIT_CODES) == list(range(8))
    text = " ".join(run("--help").stdout.split())
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {meaning}" in text
    assert exit_code(InvalidURLError("x")) == 2
    assert exit_code(CheckpointNotFoundError("x")) == 3
    assert exit_code(StoreUnavailableError("x")) == 4
    assert exit_code(MetadataError("x")) == 5
    assert exit_code(StoreFullError("x")) == 6
    assert exit_code(ReadOnlyStoreError("x")) == 6
    assert exit_code(PermissionError(13, "Permission denied")) == 6
    assert exit_code(SaveAbandonedError("x")) == 7
    assert exit_code(RuntimeError("x")) == 7
    from torch.distributed.checkpoint.api import CheckpointException

    wrapped = CheckpointException("load", {0: (CheckpointNotFoundError("x"), None)})
    assert exit_code(wrapped) == 3


def test_exit_codes_of_the_command_line(lmdb_url: str, tmp_path: Path) -> None:
    save(lmdb_url, "s")
    assert run("ls", f"{lmdb_url}?prefx=a").returncode == 2
    assert run("ls", "lmdb:/x").returncode == 2
    assert run("info", lmdb_url, "gone").returncode == 3
    engine = open_store(lmdb_url)
    engine.put_many([(meta_key(engine.prefix, "broken"), b"\xc1 not msgpack")])
    damaged = run("info", lmdb_url, "broken")
    assert damaged.returncode == 5 and "'broken'" in damaged.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = run("export", lmdb_url, "s", str(blocker / "out"))
    assert unwritable.returncode == 6, unwritable.stderr


def test_every_write_path_error_exits_6_naming_the_path_and_the_fix(
    lmdb_url: str, tmp_path: Path
) -> None:
    """Export into a directory that holds files, a safetensors export or a store under a
    path that cannot be created (under a regular file; /proc): each is a destination that
    cannot be written (exit 6), and says which path and what to do."""
    save(lmdb_url, "s")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dcp_dir = tmp_path / "dcp"
    assert run("export", lmdb_url, "s", str(dcp_dir)).returncode == 0
    cases = [
        (("export", lmdb_url, "s", str(full)), full, "choose a new or empty directory"),
        (
            ("export", lmdb_url, "s", str(full), "--format", "safetensors", "--prefix", ""),
            full,
            "choose a new or empty directory",
        ),
        (
            (
                "export",
                lmdb_url,
                "s",
                str(blocker / "hf"),
                "--format",
                "safetensors",
                "--prefix",
                "",
            ),
            blocker / "hf",
            "choose a path you can write to",
        ),
        (("torch-save", lmdb_url, "s", str(blocker / "m.pt")), blocker / "m.pt", "choose a path"),
        (("copy", lmdb_url, "s", "lmdb:///proc/kvstore"), "/proc/kvstore", "choose a store path"),
        (("copy", lmdb_url, "s", f"lmdb://{blocker}/store"), blocker, "choose a store path"),
        (("import", str(dcp_dir), "lmdb:///proc/kvstore", "i"), "/proc/kvstore", "choose a store"),
    ]
    for args, path, fix in cases:
        result = run(*args)
        assert result.returncode == 6, (args, result.stderr)
        assert str(path) in result.stderr and fix in result.stderr, (args, result.stderr)
        assert "'s'" in result.stderr or "'i'" in result.stderr, (args, result.stderr)
        assert "[Errno" not in result.stderr, (args, result.stderr)
    assert [p.name for p in full.iterdir()] == ["keep"]
    assert not (blocker.parent / "hf").exists() and not os.path.exists("/proc/kvstore")


# -- --json on every command, gc --dry-run ------------------------------------------------


def test_every_command_prints_json(lmdb_url: str, redis_url: str, tmp_path: Path) -> None:
    save(lmdb_url, "a")
    save(lmdb_url, "b")

    def doc(*args: str, code: int = 0) -> object:
        result = run(*args, "--json")
        assert result.returncode == code, result.stderr
        return json.loads(result.stdout)

    assert [c["checkpoint_id"] for c in doc("ls", lmdb_url)] == ["b", "a"]  # type: ignore[index]
    info = doc("info", lmdb_url, "a")
    assert info["checkpoint_id"] == "a" and info["tensors"][1]["shape"] == [16, 8]  # type: ignore[index]
    keys = doc("info", lmdb_url, "a", "--keys")
    assert all(item["keys"] for item in keys["write_items"])  # type: ignore[index]
    verified = doc("verify", lmdb_url, "a")
    assert verified["ok"] is True and verified["problems"] == []  # type: ignore[index]
    exported = doc("export", lmdb_url, "a", str(tmp_path / "dcp"))
    assert exported == {"checkpoint_id": "a", "directory": str(tmp_path / "dcp"), "format": "dcp"}
    stats = doc("stats", lmdb_url)
    assert stats["checkpoints"] == 2 and stats["used_bytes"] > 0  # type: ignore[index]
    imported = doc("import", str(tmp_path / "dcp"), redis_url, "i")
    assert imported["checkpoint_id"] == "i" and imported["items"] == 2  # type: ignore[index]
    copied = doc("copy", lmdb_url, "b", redis_url)
    assert copied["new_id"] == "b" and copied["destination"] == open_store(redis_url).url  # type: ignore[index]
    written = doc("torch-save", redis_url, "i", str(tmp_path / "full.pt"))
    assert written == {"checkpoint_id": "i", "file": str(tmp_path / "full.pt")}
    removed = doc("rm", redis_url, "i", "b")
    assert [d["checkpoint_id"] for d in removed["deleted"]] == ["i", "b"]  # type: ignore[index]
    collected = doc("gc", lmdb_url, "--keep-last", "1")
    assert collected["deleted_checkpoints"] == ["a"] and collected["dry_run"] is False  # type: ignore[index]
    error = doc("info", lmdb_url, "a", code=3)
    assert error["exit_code"] == 3 and "'a' not found" in error["error"]  # type: ignore[index]


def _contents(url: str) -> dict[str, bytes | None]:
    engine = open_store(url)
    keys = sorted(engine.scan(""))
    return {key: engine.get(key) for key in keys}


def test_gc_dry_run_reports_and_changes_nothing(store_url: str) -> None:
    for cid in ("s1", "s2", "s3"):
        save(store_url, cid)
    engine = open_store(store_url)
    orphan = f"{data_prefix(engine.prefix, 'lost', 'e' * 32)}0/0/0"
    engine.put_many([(orphan, b"y")])
    mark_pending(engine, "crashed", "f" * 32, None)
    engine.put_many([(f"{data_prefix(engine.prefix, 'crashed', 'f' * 32)}0/w/0", b"z")])
    before = _contents(store_url)

    result = run("gc", store_url, "--keep-last", "1", "--incomplete-older-than", "0", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "would delete checkpoint s2" in result.stdout and "nothing changed" in result.stdout
    planned = gc(store_url, keep_last=1, incomplete_older_than=0, dry_run=True)
    assert _contents(store_url) == before  # a dry run changed nothing

    assert planned.dry_run and planned.deleted_checkpoints == ["s2", "s1"]
    assert "crashed/" + "f" * 32 + "/all" in planned.removed_incomplete
    assert f"lost/{'e' * 32} (orphaned)" in planned.removed_incomplete
    done = gc(store_url, keep_last=1, incomplete_older_than=0)
    assert not done.dry_run
    assert done.deleted_checkpoints == planned.deleted_checkpoints
    assert sorted(done.removed_incomplete) == sorted(planned.removed_incomplete)
    assert done.deleted_keys == planned.deleted_keys


# -- the command line lists without torch -------------------------------------------------


def test_listing_inspecting_deleting_and_gc_never_import_torch(lmdb_url: str) -> None:
    save(lmdb_url, "a")
    save(lmdb_url, "b")
    script = textwrap.dedent(
        f"""
        import sys
        import kvckpt.cli
        for args in (["ls", {lmdb_url!r}], ["info", {lmdb_url!r}, "a"],
                     ["info", {lmdb_url!r}, "a", "--keys", "--json"],
                     ["rm", {lmdb_url!r}, "b"], ["gc", {lmdb_url!r}, "--dry-run"],
                     ["gc", {lmdb_url!r}, "--keep-last", "0"]):
            try:
                kvckpt.cli.main(args, standalone_mode=False)
            except SystemExit as e:
                assert not e.code, (args, e.code)
        import kvckpt
        kvckpt.latest_checkpoint({lmdb_url!r})
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
    assert "deleted b" in result.stdout and "deleted checkpoint a" in result.stdout


def test_public_names_still_import() -> None:
    script = (
        "import sys, kvckpt; assert 'torch' not in sys.modules; "
        "from kvckpt import KVStorageWriter, KVStorageReader, Tiers, DirectoryReader; "
        "assert all(getattr(kvckpt, n) is not None for n in kvckpt.__all__); "
        "assert set(kvckpt.__all__) <= set(dir(kvckpt)); print(KVStorageWriter.__module__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "kvckpt.writer", result.stderr
