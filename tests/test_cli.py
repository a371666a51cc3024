"""The `kvckpt` command line, run as a subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, open_store
from kvckpt.cli import human_bytes
from kvckpt.cli_common import count
from tests.conftest import free_port

from ._cli import ROOT, run, run_process


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


def test_counts_take_the_number_of_their_noun() -> None:
    assert count(1, "key") == "1 key" and count(0, "key") == "0 keys"
    assert count(2, "problem") == "2 problems" and count(3, "entry", "entries") == "3 entries"


def test_output_says_1_of_a_thing_in_the_singular(lmdb_url: str, tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="one")
    info = run("info", lmdb_url, "one").stdout
    assert "16 B in 1 item" in info, info
    ok = run("verify", lmdb_url, "one").stdout
    assert "one: OK (1 key, 16 B)" in ok, ok
    assert run("export", lmdb_url, "one", str(tmp_path / "dcp")).returncode == 0
    imported = run("import", str(tmp_path / "dcp"), lmdb_url, "again")
    assert "(1 item, 16 B)" in imported.stdout, imported.stdout
    engine = open_store(lmdb_url)
    (key,) = engine.scan(f"{engine.prefix}/data/one/")
    engine.put_many([(key, b"x")])
    bad = run("verify", lmdb_url, "one")
    assert bad.returncode == 1, bad.stdout
    assert "holds 1 byte, expected 16 bytes" in bad.stdout, bad.stdout
    assert "one: FAILED (1 problem in 1 key)" in bad.stdout, bad.stdout
    rm = run("rm", lmdb_url, "one").stdout
    assert "deleted one (1 data key)" in rm, rm
    gc = run("gc", lmdb_url).stdout
    assert "0 data keys deleted" in gc, gc


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
    for missing in (run("info", lmdb_url, "gone"), run_process("info", lmdb_url, "gone")):
        assert missing.returncode == 3  # in this process, and as a shell sees it
        assert "'gone' not found" in missing.stderr and "'here'" in missing.stderr
    url = f"redis://admin:hunter2@127.0.0.1:{free_port()}/0"
    down = run("ls", url)
    assert down.returncode == 4
    assert "127.0.0.1" in down.stderr and "hunter2" not in down.stderr + down.stdout
    assert run("ls", "ftp://x").returncode == 2
    assert run("info", lmdb_url, "bad/id").returncode == 2
    assert run("gc", lmdb_url, "--keep-last", "-1").returncode == 2
    assert run("nonsense").returncode == 2
    assert run_process("ls", lmdb_url).stdout.splitlines()[1].startswith("here ")


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
    assert [c["checkpoint_id"] for c in doc["checkpoint_list"]] == ["step-2", "step-1"]
    assert doc["held_bytes"] >= doc["used_bytes"]  # its data file's blocks
    text = run("stats", lmdb_url).stdout
    assert "checkpoints  2," in text and "in use, of " in text and "step-2" in text
    assert "memory held  " in text

    url = redis_server.url(db=3)
    save(url, "step-1")
    client = redis_server.client()
    client.config_set("maxmemory", "0")
    doc = json.loads(run("stats", url, "--json").stdout)
    assert doc["used_bytes"] > size and doc["limit_bytes"] is None
    assert doc["held_bytes"] is None and [c["checkpoint_id"] for c in doc["checkpoint_list"]] == [
        "step-1"
    ]
    assert "memory held" not in run("stats", url).stdout
    client.config_set("maxmemory", str(1 << 30))
    try:
        doc = json.loads(run("stats", url, "--json").stdout)
        assert doc["limit_bytes"] == 1 << 30 and doc["limit_from"] == "maxmemory"
    finally:
        client.config_set("maxmemory", "0")
    missing = run("stats", f"lmdb://{tmp_path / 'nothing'}")
    assert missing.returncode == 3 and not (tmp_path / "nothing").exists()


def test_stats_says_what_memory_the_lmdb_file_holds() -> None:
    """On a tmpfs, LMDB's file holds more than the pages in use (pages made ready ahead of the
    next saves): stats says how much and why, and --json carries it with the table."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    from kvckpt.engines._pages import _on_tmpfs

    store = Path(tempfile.mkdtemp(prefix="kvckpt-test-stats-", dir="/dev/shm"))
    try:
        if not _on_tmpfs(str(store)):
            pytest.skip("/dev/shm is not a tmpfs here")
        url = f"lmdb://{store}"
        # saved by a process of its own, so no background fault-in is still at work here
        script = textwrap.dedent(
            f"""
            import torch, torch.distributed.checkpoint as dcp
            from kvckpt import KVStorageWriter
            for cid in ("s0", "s1"):
                dcp.save({{"w": torch.ones(2 << 20)}}, checkpoint_id=cid,
                         storage_writer=KVStorageWriter({url!r}, keep_last=2))
            """
        )
        saved = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert saved.returncode == 0, saved.stderr
        doc = json.loads(run("stats", url, "--json").stdout)
        held = os.stat(store / "data.mdb").st_blocks * 512
        assert doc["held_bytes"] == held and held > doc["used_bytes"] > 16 << 20, doc
        assert [c["checkpoint_id"] for c in doc["checkpoint_list"]] == ["s1", "s0"]
        assert all(
            c["total_bytes"] == 8 << 20 and c["num_items"] == 1 for c in doc["checkpoint_list"]
        )
        text = run("stats", url).stdout
        beyond = human_bytes(held - doc["used_bytes"])
        assert (
            f"memory held  {human_bytes(held)} by the store's file: {beyond} more than in use"
            in text
        )
        assert "pages made ready ahead of the next saves" in text, text
        assert "s1" in text and "8.0 MiB" in text
    finally:
        subprocess.run(["rm", "-rf", str(store)], check=False)
