"""The `kvckpt` command line, run as a subprocess the way a user runs it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, open_store
from kvckpt.cli import human_bytes
from tests.conftest import free_port

from ._cli import run


def save(url: str, cid: str) -> None:
    dcp.save(
        {"layer": {"weight": torch.randn(64, 32), "bias": torch.zeros(64)}, "step": 10, "lr": 0.5},
        storage_writer=KVStorageWriter(url),
        checkpoint_id=cid,
    )


def test_human_sizes() -> None:
    assert human_bytes(10) == "10 B"
    assert human_bytes(2048) == "2.0 KiB"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(5 * 2**30) == "5.0 GiB"


@pytest.mark.parametrize(
    "command",
    ["ls", "info", "stats", "rm", "gc", "verify", "export", "import", "copy", "torch-save"],
)
def test_every_subcommand_has_help_with_an_example(command: str) -> None:
    result = run(command, "--help")
    assert result.returncode == 0
    assert "Example:" in result.stdout and f"kvckpt {command}" in result.stdout


def test_ls_info_verify_rm_gc(store_url: str) -> None:
    open_store(store_url).get("-")  # a store that exists and is empty (an engine that may write)
    result = run("ls", store_url)
    assert result.returncode == 0 and "no checkpoints" in result.stdout
    save(store_url, "step-1")
    save(store_url, "step-2")
    result = run("ls", store_url)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["ID", "CREATED", "SIZE", "ITEMS", "WORLD", "STATUS"]
    assert lines[1].startswith("step-2") and lines[2].startswith("step-1")
    assert "KiB" in lines[1] and "complete" in lines[1]
    listed = json.loads(run("ls", store_url, "--json").stdout)
    assert [c["checkpoint_id"] for c in listed] == ["step-2", "step-1"]
    assert listed[0]["complete"] is True and listed[0]["total_bytes"] > 8000

    info = run("info", store_url, "step-1")
    assert info.returncode == 0
    assert "layer.weight" in info.stdout and "(64, 32)" in info.stdout
    assert "float32" in info.stdout and "8.0 KiB" in info.stdout
    tensors = json.loads(run("info", store_url, "step-1", "--json").stdout)["tensors"]
    assert {
        "fqn": "layer.weight",
        "dtype": "float32",
        "shape": [64, 32],
        "chunks": 1,
        "bytes": 8192,
    } in tensors

    ok = run("verify", store_url, "step-1")
    assert ok.returncode == 0 and "OK" in ok.stdout
    engine = open_store(store_url)
    key = next(iter(engine.scan(f"{engine.prefix}/data/step-1/")))
    engine.put_many([(key, b"bad")])
    bad = run("verify", store_url, "step-1")
    assert bad.returncode == 1 and "FAILED" in bad.stdout and "wrong size" in bad.stdout

    rm = run("rm", store_url, "step-1")
    assert rm.returncode == 0 and "deleted step-1" in rm.stdout
    assert run("rm", store_url, "step-1").returncode == 3
    save(store_url, "step-3")
    gc = run("gc", store_url, "--keep-last", "1")
    assert gc.returncode == 0 and "deleted checkpoint step-2" in gc.stdout
    assert [c["checkpoint_id"] for c in json.loads(run("ls", store_url, "--json").stdout)] == [
        "step-3"
    ]


def test_export_import_copy_torch_save(lmdb_url: str, redis_url: str, tmp_path) -> None:
    save(lmdb_url, "s")
    exported = tmp_path / "dcp"
    assert run("export", lmdb_url, "s", str(exported)).returncode == 0
    assert (exported / ".metadata").exists()
    result = run("import", str(exported), redis_url, "imported")
    assert result.returncode == 0, result.stderr
    result = run("copy", lmdb_url, "s", redis_url)
    assert result.returncode == 0, result.stderr
    listed = {c["checkpoint_id"] for c in json.loads(run("ls", redis_url, "--json").stdout)}
    assert listed == {"s", "imported"}
    result = run("torch-save", redis_url, "imported", str(tmp_path / "full.pt"))
    assert result.returncode == 0, result.stderr
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert full["step"] == 10 and full["layer"]["weight"].shape == (64, 32)


def test_exit_codes_and_messages(lmdb_url: str) -> None:
    save(lmdb_url, "here")
    missing = run("info", lmdb_url, "gone")
    assert missing.returncode == 3
    assert "'gone' not found" in missing.stderr and "'here'" in missing.stderr
    url = f"redis://admin:hunter2@127.0.0.1:{free_port()}/0"
    down = run("ls", url)
    assert down.returncode == 4
    assert "127.0.0.1" in down.stderr and "hunter2" not in down.stderr + down.stdout
    assert run("ls", "ftp://x").returncode == 2
    assert run("info", lmdb_url, "bad/id").returncode == 2
    assert run("gc", lmdb_url, "--keep-last", "-1").returncode == 2
    assert run("nonsense").returncode == 2


def test_read_only_commands_never_create_a_store(tmp_path) -> None:
    """Read-only commands on a missing LMDB path (a typo) fail naming it, and create no
    directory and no data.mdb."""
    typo = tmp_path / "some" / "typo"
    url = f"lmdb://{typo}"
    for args in (
        ("ls", url),
        ("info", url, "step-1"),
        ("verify", url, "step-1"),
        ("export", url, "step-1", str(tmp_path / "out")),
        ("torch-save", url, "step-1", str(tmp_path / "out.pt")),
    ):
        result = run(*args)
        assert result.returncode == 3, (args, result.stdout, result.stderr)
        assert f"no LMDB store at {typo}" in result.stderr, (args, result.stderr)
    assert not (tmp_path / "some").exists() and not (tmp_path / "out").exists()


def test_stats_shows_checkpoints_bytes_and_the_stores_memory(
    lmdb_url: str, redis_server, tmp_path
) -> None:
    """LMDB: its pages in use against its file plus the filesystem's free space. Redis: its
    used_memory against maxmemory, and no limit where maxmemory is unset."""
    save(lmdb_url, "step-1")
    save(lmdb_url, "step-2")
    doc = json.loads(run("stats", lmdb_url, "--json").stdout)
    size = KVStorageReader(lmdb_url, checkpoint_id="step-1").read_record().total_bytes
    assert doc["checkpoints"] == 2 and doc["checkpoint_bytes"] == 2 * size
    assert doc["used_bytes"] >= 2 * size and doc["limit_bytes"] > doc["used_bytes"]
    assert "free space" in doc["limit_from"]
    text = run("stats", lmdb_url).stdout
    assert "checkpoints  2," in text and "in use, of " in text and "step-2" in text

    url = redis_server.url(db=3)
    save(url, "step-1")
    client = redis_server.client()
    client.config_set("maxmemory", "0")
    doc = json.loads(run("stats", url, "--json").stdout)
    assert doc["used_bytes"] > size and doc["limit_bytes"] is None
    client.config_set("maxmemory", str(1 << 30))
    try:
        doc = json.loads(run("stats", url, "--json").stdout)
        assert doc["limit_bytes"] == 1 << 30 and doc["limit_from"] == "maxmemory"
    finally:
        client.config_set("maxmemory", "0")
    missing = run("stats", f"lmdb://{tmp_path / 'nothing'}")
    assert missing.returncode == 3 and not (tmp_path / "nothing").exists()
