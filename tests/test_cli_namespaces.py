"""Namespaces (``?prefix=NAME``) from the command line: ``ls`` on an empty namespace names the
store's others, and ``ls --namespaces`` lists them from key names and indexes, reading no data
key. Real LMDB in a tmp dir, a real redis-server."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageWriter, list_checkpoints, open_store
from kvckpt.catalog import index_key
from kvckpt.manage import list_namespaces
from kvckpt.testing import RedisServer

from ._cli import run


def save(url: str, cid: str) -> None:
    dcp.save(
        {"w": torch.ones(64), "step": 1}, storage_writer=KVStorageWriter(url), checkpoint_id=cid
    )


def with_prefix(url: str, prefix: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}prefix={prefix}"


def test_ls_of_an_empty_namespace_names_the_others(tmp_path: Path) -> None:
    base = f"lmdb://{tmp_path / 'store'}"
    save(with_prefix(base, "run-a"), "step-1")
    save(with_prefix(base, "run-a"), "step-2")
    save(with_prefix(base, "run-b"), "step-1")

    result = run("ls", base)  # the default namespace, "kvckpt", holds nothing
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"no checkpoints in {base}?prefix=kvckpt" in out
    assert "'run-a' (2 checkpoints)" in out and "'run-b' (1 checkpoint)" in out, out
    assert "?prefix=NAME" in out and f"kvckpt ls '{base}?prefix=run-a'" in out, out

    listed = run("ls", base, "--json")  # the document stays a list; the hint goes to stderr
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    assert "'run-a' (2 checkpoints)" in listed.stderr

    # a namespace that holds checkpoints lists them, and names no other
    result = run("ls", with_prefix(base, "run-b"))
    assert result.returncode == 0 and "step-1" in result.stdout
    assert "run-a" not in result.stdout + result.stderr


def test_ls_namespaces_lists_them_with_their_checkpoints(tmp_path: Path) -> None:
    base = f"lmdb://{tmp_path / 'store'}"
    for prefix, ids in (("alpha", ["s1", "s2", "s3"]), ("beta", ["s1"])):
        for cid in ids:
            save(with_prefix(base, prefix), cid)

    result = run("ls", "--namespaces", base)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "CHECKPOINTS", "SIZE", "URL"]
    assert lines[1].split()[:2] == ["alpha", "3"] and lines[1].endswith(f"{base}?prefix=alpha")
    assert lines[2].split()[:2] == ["beta", "1"] and lines[2].endswith(f"{base}?prefix=beta")

    doc = json.loads(run("ls", "--namespaces", with_prefix(base, "beta"), "--json").stdout)
    assert [(n["prefix"], n["checkpoints"], n["url"]) for n in doc] == [
        ("alpha", 3, f"{base}?prefix=alpha"),
        ("beta", 1, f"{base}?prefix=beta"),
    ]
    alpha = list_checkpoints(with_prefix(base, "alpha"))
    assert doc[0]["total_bytes"] == sum(i.total_bytes for i in alpha) and doc[0]["indexed"]
    assert [n.prefix for n in list_namespaces(base)] == ["alpha", "beta"]


def test_ls_namespaces_on_a_missing_store_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "typo" / "store"
    for args in (("ls", "--namespaces", f"lmdb://{typo}"), ("ls", f"lmdb://{typo}")):
        result = run(*args, "--json")
        assert result.returncode == 3, result.stderr
        assert json.loads(result.stdout)["exit_code"] == 3
        assert f"no LMDB store at {typo}" in result.stderr
    assert not (tmp_path / "typo").exists()


def _calls(server: RedisServer) -> dict[str, int]:
    stats = server.client().info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def test_ls_namespaces_on_redis_reads_no_data_key(
    redis_server: RedisServer, redis_url: str
) -> None:
    """On Redis the namespaces come from one SCAN whose pattern leaves data keys out, and a GET
    of each namespace's index: no data key is read, nothing is written."""
    for prefix, ids in (("a", ["s1", "s2"]), ("b", ["s1"]), ("noindex", ["s1", "s2"])):
        for cid in ids:
            save(with_prefix(redis_url, prefix), cid)
    client = redis_server.client()
    client.delete(index_key("noindex"))  # a namespace whose index is gone: its metadata counts
    keys_before = sorted(client.scan_iter())
    client.config_resetstat()

    result = run("ls", "--namespaces", redis_url, "--json")
    assert result.returncode == 0, result.stderr
    calls = _calls(redis_server)
    doc = json.loads(result.stdout)
    assert [(n["prefix"], n["checkpoints"], n["indexed"]) for n in doc] == [
        ("a", 2, True),
        ("b", 1, True),
        ("noindex", 2, False),
    ]
    assert doc[0]["url"] == f"{redis_url}?prefix=a"
    # reads: SCAN, and one GET per index; no value of any other key
    assert calls.get("get") == 2, calls
    read_values = {"mget", "getrange", "strlen", "dump", "getex", "substr", "hgetall", "exists"}
    assert not read_values & set(calls), calls
    assert calls.get("scan", 0) >= 1, calls
    assert sorted(client.scan_iter()) == keys_before  # nothing written

    text = run("ls", "--namespaces", redis_url).stdout
    assert "no index" in text and "noindex" in text

    # an empty namespace of this Redis names the others
    empty = run("ls", with_prefix(redis_url, "nothing-here"))
    assert empty.returncode == 0 and "'a' (2 checkpoints)" in empty.stdout, empty.stdout
    assert f"{redis_url}?prefix=a" in empty.stdout


def test_ls_namespaces_of_an_empty_store(redis_url: str) -> None:
    result = run("ls", "--namespaces", redis_url)
    assert result.returncode == 0 and "no namespaces" in result.stdout
    assert json.loads(run("ls", "--namespaces", redis_url, "--json").stdout) == []
    assert open_store(redis_url)._client.dbsize() == 0  # type: ignore[attr-defined]
