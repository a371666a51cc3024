"""LMDB saves that write large values into room reserved in the map (``_lmdb_reserve``): the
same bytes and checksums as LMDB's own put, a map that grows mid-save, a new store's pages
written through the file and the map, and the fallbacks."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.engines import _lmdb_reserve
from kvckpt.engines._pages import _on_tmpfs, address_of, file_offsets
from kvckpt.engines.lmdb import LMDBEngine, close_idle_environments

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not _lmdb_reserve.usable(), reason="py-lmdb's put cannot reserve on this platform"
)


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"big/{i}": rng.integers(0, 255, 2 * MIB + 8 * i, dtype=np.uint8) for i in range(6)}
    out["small"] = rng.integers(0, 255, 4096, dtype=np.uint8)
    out["big/float"] = rng.standard_normal(MIB // 2).astype(np.float32)  # not a byte view
    return out


def save(engine: LMDBEngine, items: dict[str, np.ndarray]) -> dict[str, int]:
    keys = list(items)
    digests: dict[str, int] = {}
    engine.put_many(
        items.items(),
        on_value=lambda i, d: digests.__setitem__(keys[i], d),
        hasher=xxhash.xxh3_64,
    )
    return digests


def check(engine: LMDBEngine, items: dict[str, np.ndarray], digests: dict[str, int]) -> None:
    for key, value in items.items():
        assert engine.get(key) == value.tobytes(), key
        assert digests[key] == xxhash.xxh3_64(value.tobytes()).intdigest(), key


def count_reserves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = _lmdb_reserve.Reserver.room

    def counted(self: _lmdb_reserve.Reserver, key: bytes, nbytes: int) -> memoryview:
        sizes.append(nbytes)
        return real(self, key, nbytes)

    monkeypatch.setattr(_lmdb_reserve.Reserver, "room", counted)
    return sizes


def test_large_values_are_written_into_reserved_room(tmp_path: Path, monkeypatch) -> None:
    sizes = count_reserves(monkeypatch)
    engine = LMDBEngine(str(tmp_path / "s"))
    items = values()
    check(engine, items, save(engine, items))
    assert sorted(sizes) == sorted(v.nbytes for v in items.values() if v.nbytes >= MIB)


def test_the_same_bytes_and_checksums_as_lmdbs_put(tmp_path: Path, monkeypatch) -> None:
    items = values()
    reserved = LMDBEngine(str(tmp_path / "reserved"))
    with_reserve = save(reserved, items)
    monkeypatch.setattr(_lmdb_reserve, "_engines", {})  # KVCKPT_LMDB_RESERVE=0
    sizes = count_reserves(monkeypatch)
    put = LMDBEngine(str(tmp_path / "put"))
    assert save(put, items) == with_reserve
    check(put, items, with_reserve)
    assert sizes == []


def test_no_reserving_without_writemap(tmp_path: Path, monkeypatch) -> None:
    sizes = count_reserves(monkeypatch)
    engine = LMDBEngine(str(tmp_path / "s"), writemap=False)
    items = values()
    check(engine, items, save(engine, items))
    assert sizes == []


def test_a_map_that_fills_mid_save_grows_and_the_save_completes(tmp_path: Path) -> None:
    engine = LMDBEngine(str(tmp_path / "s"), map_size=4 * MIB)
    items = values()
    check(engine, items, save(engine, items))


def test_a_reserved_value_that_reads_back_wrong_is_put_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(_lmdb_reserve, "_confirmed", None)
    monkeypatch.setattr(_lmdb_reserve, "confirm", lambda read, written: False)
    sizes = count_reserves(monkeypatch)
    engine = LMDBEngine(str(tmp_path / "s"))
    items = values()
    check(engine, items, save(engine, items))
    assert sizes  # reserved, then put over


@pytest.mark.parametrize("lib_version", [0, 1])
def test_each_bundled_lmdb_reserves_with_its_own_functions(tmp_path: Path, lib_version) -> None:
    """py-lmdb binds an environment to LMDB 0.9 or 1.0, whose transactions differ."""
    if lib_version not in _lmdb_reserve._engines:
        pytest.skip(f"this py-lmdb has no LMDB {lib_version}.x")
    env = lmdb.open(str(tmp_path / "s"), writemap=True, lib_version=lib_version)
    value = np.arange(MIB, dtype=np.uint8)
    with env.begin(write=True) as txn:
        reserver = _lmdb_reserve.reserver(env, txn)
        assert reserver is not None
        reserver.room(b"k", value.nbytes)[:] = value.data
    with env.begin() as txn:
        assert txn.get(b"k") == value.tobytes()
    env.close()


def test_a_checkpoint_saved_into_reserved_room_loads_verified(tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path / 'store'}"
    state = {"w": torch.randn(1024, 1024), "b": torch.randn(16)}
    dcp.save(state, storage_writer=KVStorageWriter(url), checkpoint_id="step-1")
    back = {"w": torch.zeros(1024, 1024), "b": torch.zeros(16)}
    dcp.load(back, storage_reader=KVStorageReader(url), checkpoint_id="step-1")
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])


@pytest.fixture
def on_tmpfs() -> Iterator[Path]:
    if not _on_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="kvckpt-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        close_idle_environments(str(path))
        shutil.rmtree(path, ignore_errors=True)


def big_values() -> dict[str, np.ndarray]:
    """80 MiB of large values: a save big enough to create its pages itself."""
    rng = np.random.default_rng(1)
    out = {f"big/{i}": rng.integers(0, 255, 2 * MIB + 4096 * i, dtype=np.uint8) for i in range(39)}
    out["small"] = rng.integers(0, 255, 100, dtype=np.uint8)
    return out


@pytest.mark.parametrize("mapping", ["works", "fails"])
def test_a_first_save_on_tmpfs_writes_its_new_pages_through_the_file_and_the_map(
    on_tmpfs: Path, monkeypatch: pytest.MonkeyPatch, mapping: str
) -> None:
    """Into a new store on a tmpfs, one thread ``pwrite``s values into the file and the other
    maps pages in and copies; where mapping fails (no room: EFAULT) that thread writes too.
    Either way the bytes and digests are those of LMDB's put."""
    from kvckpt.engines import lmdb as lmdb_engine

    ways: list[str] = []
    real_map_in = lmdb_engine.map_in

    def map_in(view: memoryview) -> bool:
        ways.append(mapping)
        return mapping == "works" and real_map_in(view)

    monkeypatch.setattr(lmdb_engine, "map_in", map_in)
    writes = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: writes.append(a[2]) or real_pwrite(*a))
    items = big_values()
    engine = LMDBEngine(str(on_tmpfs / "s"))
    digests = save(engine, items)
    check(engine, items, digests)
    assert writes and ways  # both threads took values
    monkeypatch.setattr(_lmdb_reserve, "_engines", {})  # KVCKPT_LMDB_RESERVE=0
    assert save(LMDBEngine(str(on_tmpfs / "put")), items) == digests


def test_file_offsets_are_found_from_the_map_or_not_at_all(on_tmpfs: Path) -> None:
    path = on_tmpfs / "f"
    with open(path, "w+b") as f:
        f.truncate(4 * MIB)
        with mmap.mmap(f.fileno(), 4 * MIB) as mm:
            view = memoryview(mm)
            base = address_of(view)
            assert file_offsets(str(path), [base, base + 3 * MIB + 5]) == [0, 3 * MIB + 5]
            assert file_offsets(str(path), [base + 4 * MIB]) is None
            assert file_offsets(str(on_tmpfs / "other"), [base]) is None
            view.release()
