"""DCP save/load through kvckpt in one process (no process group), on real LMDB and Redis."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    CheckpointNotFoundError,
    InvalidCheckpointIdError,
    KVStorageReader,
    KVStorageWriter,
    MetadataError,
    StoreUnavailableError,
    UnsupportedFormatVersionError,
    list_checkpoints,
    open_store,
)
from kvckpt.format import FORMAT_VERSION
from kvckpt.keys import meta_key
from kvckpt.staging import accelerator_available
from tests._errors import load_fails

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def mixed_state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    return {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(128, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 3, generator=g).half(),
        "f64": torch.randn(7, generator=g).double(),
        "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(16, generator=g).to(torch.float8_e5m2),
        "bool": torch.rand(9, generator=g) > 0.5,
        "i8": torch.randint(-128, 127, (10,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (10,), dtype=torch.uint8, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=g),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "c128": torch.randn(3, 2, dtype=torch.complex128, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "view": base[10:12],  # a view must not drag its 16 KiB storage along
        "strided": base[::3, 1::2],  # non-contiguous
        "transposed": base.t(),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
        "nested": {"inner": torch.ones(3), "step": 7, "name": "adam", "betas": (0.9, 0.99)},
        "list": [torch.zeros(2), 5],
    }


def zeros_like_sd(sd: dict) -> dict:
    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return None if not isinstance(v, int | float | str | tuple) else type(v)()

    return {k: z(v) for k, v in sd.items()}


def assert_bit_equal(a, b, path="sd") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def save(sd, url, cid="step-1", **kw):
    dcp.save(sd, storage_writer=KVStorageWriter(url, **kw), checkpoint_id=cid)


def load(sd, url, cid="step-1", **kw):
    dcp.load(sd, storage_reader=KVStorageReader(url, **kw), checkpoint_id=cid)
    return sd


def test_mixed_dtypes_round_trip_bit_exact(store_url: str) -> None:
    sd = mixed_state_dict()
    save(sd, store_url)
    out = load(zeros_like_sd(sd), store_url)
    assert_bit_equal(sd, out)


def test_tensor_bytes_of_every_dtype_and_layout() -> None:
    """The writer's no-copy path (numpy, or an int view for dtypes numpy lacks) gives the
    bytes of the contiguous projection for every dtype, view, conj/neg bit and empty shape."""
    from kvckpt.writer import tensor_bytes

    def expected(t: torch.Tensor) -> bytes:
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""

    dtypes = [
        *(torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool),
        *(torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32),
        *(torch.int64, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2),
        *(torch.complex64, torch.complex128),
    ]
    cases = []
    for dtype in dtypes:
        base = (torch.arange(24) % 7).to(dtype)
        cases += [base, base.reshape(2, 3, 4)[:, 1], base.reshape(4, 6).t(), base[3], base[:0]]
        cases.append(base.reshape(2, 3, 4)[:, :0])
    z = torch.randn(5, dtype=torch.complex64)
    cases += [z.conj(), z.conj().imag, torch.randn(4, requires_grad=True)]
    for t in cases:
        view = tensor_bytes(t)
        assert view.format == "B" and bytes(view) == expected(t), (t.dtype, t.shape)


def test_a_view_stores_only_its_elements(store_url: str) -> None:
    base = torch.randn(1024, 1024)
    save({"v": base[:2]}, store_url)
    record = KVStorageReader(store_url, checkpoint_id="step-1").read_record()
    assert record.total_bytes == 2 * 1024 * 4


def test_values_are_raw_bytes_not_torch_save(store_url: str) -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    save({"t": t}, store_url)
    engine = open_store(store_url)
    record = KVStorageReader(engine, checkpoint_id="step-1").read_record()
    (key,) = record.data_keys(engine.prefix)
    assert engine.get(key) == t.numpy().tobytes()


def test_items_larger_than_a_part_are_split(store_url: str) -> None:
    url = store_url + ("&" if "?" in store_url else "?") + "part_bytes=1000"
    sd = {"big": torch.randn(1000), "obj": {"x": list(range(500))}}
    save(sd, url)
    engine = open_store(url)
    assert len(list(engine.scan(f"{engine.prefix}/data/"))) >= 6
    out = load({"big": torch.zeros(1000), "obj": {"x": None}}, url)
    assert_bit_equal(sd, out)
    # Resharded read of a multi-part item goes through the assembly buffer.
    part = {"big": torch.zeros(1000)}
    load(part, url)
    assert torch.equal(part["big"], sd["big"])


def test_checkpoint_id_from_constructor(store_url: str) -> None:
    sd = {"a": torch.ones(3)}
    dcp.save(sd, storage_writer=KVStorageWriter(store_url, checkpoint_id="ctor"))
    out = {"a": torch.zeros(3)}
    dcp.load(out, storage_reader=KVStorageReader(store_url, checkpoint_id="ctor"))
    assert torch.equal(out["a"], sd["a"])


def test_no_checkpoint_id_is_a_clear_error(store_url: str) -> None:
    with pytest.raises(BaseException, match="no checkpoint id"):
        dcp.save({"a": torch.ones(1)}, storage_writer=KVStorageWriter(store_url))


def test_partial_load(store_url: str) -> None:
    sd = mixed_state_dict()
    save(sd, store_url)
    out = load({"f32": torch.zeros(33, 17), "nested": {"inner": torch.zeros(3)}}, store_url)
    assert torch.equal(out["f32"], sd["f32"])
    assert torch.equal(out["nested"]["inner"], sd["nested"]["inner"])


def test_resave_replaces_atomically_and_drops_old_data(store_url: str) -> None:
    engine = open_store(store_url)
    save({"a": torch.ones(100)}, store_url)
    old = KVStorageReader(store_url, checkpoint_id="step-1").read_record()
    save({"a": torch.full((100,), 2.0)}, store_url)
    new = KVStorageReader(store_url, checkpoint_id="step-1").read_record()
    assert new.save_id != old.save_id
    data = sorted(engine.scan(f"{engine.prefix}/data/"))
    assert data and all(new.save_id in k for k in data)
    assert torch.equal(load({"a": torch.zeros(100)}, store_url)["a"], torch.full((100,), 2.0))


def test_overwrite_false_refuses(store_url: str) -> None:
    save({"a": torch.ones(1)}, store_url)
    with pytest.raises(BaseException, match="already exists"):
        save({"a": torch.ones(1)}, store_url, overwrite=False)


def test_unknown_checkpoint_lists_existing_ids(store_url: str, caplog) -> None:
    save({"a": torch.ones(1)}, store_url, cid="step-1")
    save({"a": torch.ones(1)}, store_url, cid="step-2")
    with load_fails(caplog, "'step-3' not found.*'step-1', 'step-2'"):
        load({"a": torch.zeros(1)}, store_url, cid="step-3")
    with pytest.raises(CheckpointNotFoundError, match="'step-1', 'step-2'"):
        KVStorageReader(store_url, checkpoint_id="step-3").read_record()


def test_empty_store_says_so(store_url: str) -> None:
    open_store(store_url).get("-")  # a store that exists and is empty (an engine that may write)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
        KVStorageReader(store_url, checkpoint_id="x").read_record()


def test_unreachable_redis(redis_server) -> None:
    from tests.conftest import free_port

    url = f"redis://default:topsecret@127.0.0.1:{free_port()}/0"
    writer = KVStorageWriter(url)
    with pytest.raises(BaseException) as info:
        dcp.save({"a": torch.ones(1)}, storage_writer=writer, checkpoint_id="x")
    assert "127.0.0.1:" in str(info.value)
    assert "topsecret" not in str(info.value) and "topsecret" not in repr(writer)
    with pytest.raises(StoreUnavailableError):
        KVStorageReader(url, checkpoint_id="x").read_record()


def test_invalid_checkpoint_id_in_dcp_save(store_url: str) -> None:
    with pytest.raises(InvalidCheckpointIdError, match="key schema"):
        save({"a": torch.ones(1)}, store_url, cid="a/b")
    with pytest.raises(InvalidCheckpointIdError):
        save({"a": torch.ones(1)}, store_url, cid="{tag}")


def overwrite_meta(url: str, cid: str, raw: bytes) -> None:
    engine = open_store(url)
    engine.transact([], lambda _: {meta_key(engine.prefix, cid): raw})


def test_newer_format_version(store_url: str, caplog) -> None:
    import msgpack

    save({"a": torch.ones(1)}, store_url)
    engine = open_store(store_url)
    doc = msgpack.unpackb(engine.get(meta_key(engine.prefix, "step-1")), strict_map_key=False)
    doc["version"] = FORMAT_VERSION + 1
    overwrite_meta(store_url, "step-1", msgpack.packb(doc))
    with pytest.raises(UnsupportedFormatVersionError, match=f"version {FORMAT_VERSION + 1}"):
        KVStorageReader(store_url, checkpoint_id="step-1").read_record()
    with load_fails(caplog, "upgrade kvckpt"):
        load({"a": torch.zeros(1)}, store_url)


def test_corrupted_metadata(store_url: str) -> None:
    save({"a": torch.ones(1)}, store_url)
    engine = open_store(store_url)
    raw = engine.get(meta_key(engine.prefix, "step-1"))
    overwrite_meta(store_url, "step-1", raw[: len(raw) // 2])
    with pytest.raises(MetadataError, match="step-1"):
        KVStorageReader(store_url, checkpoint_id="step-1").read_record()


def test_damaged_data_value_is_detected(store_url: str) -> None:
    save({"a": torch.ones(10)}, store_url)
    engine = open_store(store_url)
    (key,) = list(engine.scan(f"{engine.prefix}/data/"))
    engine.put_many([(key, b"short")])
    with pytest.raises(BaseException, match="holds 5 bytes, expected 40"):
        load({"a": torch.zeros(10)}, store_url)
    engine.delete([key])
    with pytest.raises(BaseException, match="is missing"):
        load({"a": torch.zeros(10)}, store_url)


class Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/kvckpt-pwned",))


def test_pickle_payload_in_every_value_runs_no_code(store_url: str, tmp_path) -> None:
    """An attacker who can write to the store overwrites every value with a pickle payload."""
    import os

    marker = "/tmp/kvckpt-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    sd = mixed_state_dict()
    save(sd, store_url)
    engine = open_store(store_url)
    payload = pickle.dumps(Payload())
    keys = list(engine.scan(""))
    assert len(keys) > 10
    engine.put_many((k, payload) for k in keys)
    with pytest.raises(BaseException) as info:
        load(zeros_like_sd(sd), store_url)
    assert "metadata" in str(info.value)
    assert not os.path.exists(marker)


def test_torch_save_payload_in_object_values_is_refused(store_url: str) -> None:
    """A well-formed torch.save payload with a code-running pickle, sizes made consistent."""
    import dataclasses
    import io
    import os

    from kvckpt.format import encode_metadata

    marker = "/tmp/kvckpt-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    save({"t": torch.ones(2), "obj": {"k": "v"}}, store_url)
    engine = open_store(store_url)
    record = KVStorageReader(engine, checkpoint_id="step-1").read_record()
    buf = io.BytesIO()
    torch.save(Payload(), buf)
    payload = buf.getvalue()
    locations = dict(record.locations)
    for idx, loc in locations.items():
        if idx.offset is None:
            locations[idx] = dataclasses.replace(
                loc, nbytes=len(payload), part_bytes=1 << 30, checksums=None
            )
            (key,) = locations[idx].keys(engine.prefix, "step-1", record.save_id)
            engine.put_many([(key, payload)])
    raw = encode_metadata(
        record.metadata, locations, checkpoint_id="step-1", save_id=record.save_id, world_size=1
    )
    overwrite_meta(store_url, "step-1", raw)
    with pytest.raises(BaseException, match="weights_only=False") as info:
        load({"t": torch.zeros(2), "obj": {"k": None}}, store_url)
    assert "UnsafeObjectError" in str(info.value) and "'obj.k'" in str(info.value)
    assert not os.path.exists(marker)


def test_weights_only_blocks_unsafe_objects_and_opt_out_allows(store_url: str) -> None:
    import argparse

    sd = {"t": torch.ones(2), "args": argparse.Namespace(lr=0.1)}
    save(sd, store_url)
    with pytest.raises(BaseException, match="weights_only"):
        load({"t": torch.zeros(2), "args": None}, store_url)
    out = load({"t": torch.zeros(2), "args": None}, store_url, weights_only=False)
    assert out["args"].lr == 0.1


def test_bytesio_and_plain_values_load_by_default(store_url: str) -> None:
    """PyTorch's DCP tests and some trainers keep blobs as io.BytesIO; rebuilding one (or a
    frozenset, a datetime) runs no code, so the safe default loads them, as FileSystemReader
    does."""
    import datetime
    import io

    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    started = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    train = {
        "step": 7,
        "losses": losses,
        "seen": frozenset({1, 2}),
        "started": started,
        "day": started.date(),
        "elapsed": datetime.timedelta(seconds=90),
    }
    save({"t": torch.ones(2), "train": train}, store_url)
    out = load({"t": torch.zeros(2), "train": dict.fromkeys(train)}, store_url)
    got = out["train"]
    assert isinstance(got["losses"], io.BytesIO)
    got["losses"].seek(0)
    assert torch.load(got["losses"], weights_only=True) == [0.5, 0.25]
    assert got["seen"] == frozenset({1, 2}) and got["started"] == started
    assert got["day"] == started.date() and got["elapsed"] == datetime.timedelta(seconds=90)
    # The allowance lasts only for kvckpt's check: torch's process-wide allowlist is as it was.
    assert io.BytesIO not in torch.serialization.get_safe_globals()


def test_bytesio_carries_no_code_past_the_check(store_url: str) -> None:
    """A BytesIO's pickled state includes its __dict__: what is in there is checked too."""
    import io
    import os

    marker = "/tmp/kvckpt-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    smuggler = io.BytesIO(b"blob")
    smuggler.extra = Payload()
    save({"t": torch.ones(2), "blob": smuggler}, store_url)
    refused = r"'blob' in checkpoint 'step-1'.*GLOBAL (posix|os)\.system"
    with pytest.raises(BaseException, match=refused):
        load({"t": torch.zeros(2), "blob": None}, store_url)
    assert not os.path.exists(marker)


def test_writer_and_reader_pickle(store_url: str) -> None:
    w = pickle.loads(pickle.dumps(KVStorageWriter(store_url, checkpoint_id="p")))
    dcp.save({"a": torch.ones(2)}, storage_writer=w)
    r = pickle.loads(pickle.dumps(KVStorageReader(store_url, checkpoint_id="p")))
    out = {"a": torch.zeros(2)}
    dcp.load(out, storage_reader=r)
    assert torch.equal(out["a"], torch.ones(2))


def test_tensor_larger_than_redis_value_limit(redis_server) -> None:
    """600 MiB in one tensor: over Redis's 512 MiB per-value limit, split transparently."""
    client = redis_server.client()
    client.flushall()
    url = redis_server.url()
    big = torch.arange(600 * (1 << 20) // 4, dtype=torch.int32)
    save({"big": big}, url)
    out = {"big": torch.zeros_like(big)}
    load(out, url)
    assert torch.equal(out["big"], big)
    client.flushall()


def flip_one_byte(url: str, cid: str, fqn: str) -> str:
    engine = open_store(url)
    record = KVStorageReader(engine, checkpoint_id=cid).read_record()
    loc = next(loc for idx, loc in record.locations.items() if idx.fqn == fqn)
    key = loc.keys(engine.prefix, cid, record.save_id)[0]
    value = bytearray(engine.get(key))
    value[len(value) // 2] ^= 0x01
    engine.put_many([(key, value)])
    return key


@pytest.mark.parametrize("direct", [True, False])
def test_checksum_mismatch_names_checkpoint_fqn_and_key(redis_url: str, direct: bool) -> None:
    """Redis records and verifies checksums by default; a flipped bit never loads silently."""
    sd = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    save(sd, redis_url)
    key = flip_one_byte(redis_url, "step-1", "w")
    # direct: the value lands in the destination tensor; staged: a resharded (partial) read.
    target = {"w": torch.zeros(64, 64)} if direct else {"w": torch.zeros(64, 64).t()}
    with pytest.raises(BaseException) as info:
        load(target, redis_url)
    text = str(info.value)
    assert "IntegrityError" in text and "'step-1'" in text and "'w'" in text and key in text
    # Opting out of verification loads the damaged value (the user asked for it).
    load({"w": torch.zeros(64, 64)}, redis_url, verify=False)


def test_verify_with_an_engine_that_does_not_hash_while_reading(lmdb_url: str) -> None:
    """A plugin engine written before get_into took a hasher (or that ignores it) still gets
    its values verified: the reader hashes what landed itself."""
    from kvckpt.engines.lmdb import LMDBEngine

    class NoHashing(LMDBEngine):
        def get_into(self, keys, buffers, on_value=None, hasher=None):  # type: ignore[override]
            sizes = super().get_into(keys, buffers)
            for i, n in enumerate(sizes):
                if on_value is not None and n == buffers[i].nbytes:
                    on_value(i, None)
            return sizes

    sd = {"w": torch.randn(32, 32)}
    save(sd, lmdb_url, checksums=True)
    engine = NoHashing.from_url(lmdb_url)
    assert torch.equal(load({"w": torch.zeros(32, 32)}, engine, verify=True)["w"], sd["w"])
    flip_one_byte(lmdb_url, "step-1", "w")
    with pytest.raises(BaseException, match="does not match the checksum"):
        load({"w": torch.zeros(32, 32)}, engine, verify=True)


def test_engine_that_claims_to_hash_while_writing_but_does_not(lmdb_url: str) -> None:
    """A plugin engine that sets hashes_while_writing but reports no digests fails the save
    with an error naming the engine and the fix, and commits nothing."""
    from kvckpt.engines.lmdb import LMDBEngine

    class Claims(LMDBEngine):
        hashes_while_writing = True

        def put_many(self, items, **ignored):  # type: ignore[no-untyped-def]
            super().put_many(items)

    engine = Claims.from_url(lmdb_url)
    with pytest.raises(BaseException, match="reported no checksum for a part of 'w'"):
        save({"w": torch.randn(8)}, engine, checksums=True)
    assert list_checkpoints(lmdb_url) == []


@pytest.mark.parametrize(
    ("way", "copy_way"),
    [("native", "memcpy"), ("native-stream", "stream"), (1024 * 1024, "memcpy")],
)
def test_lmdb_checksums_are_on_by_default_and_saves_without_them_keep_loading(
    lmdb_url: str, way: int | str, copy_way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way a load copies and hashes (the native loop with either kind of store, numpy's
    pieces) verifies, and each way it copies unverified loads the same bytes."""
    from kvckpt.engines import _copy_ways

    if isinstance(way, str) and _copy_ways.NATIVE_COPY_HASH is None:
        pytest.skip("the native copy-and-hash is not built here")
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", _copy_ways.TimedChoice((way,)))
    monkeypatch.setattr(_copy_ways, "COPY_WAY", _copy_ways.TimedChoice((copy_way,)))
    sd = {"w": torch.randn(1024, 2048)}  # 8 MiB: two parts, hashed and read on two threads
    save(sd, lmdb_url)
    record = KVStorageReader(lmdb_url, checkpoint_id="step-1").read_record()
    assert all(loc.checksums is not None for loc in record.locations.values())
    flip_one_byte(lmdb_url, "step-1", "w")
    with pytest.raises(BaseException, match="does not match the checksum"):
        load({"w": torch.zeros(1024, 2048)}, lmdb_url)
    save(sd, lmdb_url, cid="unsummed", checksums=False)
    record = KVStorageReader(lmdb_url, checkpoint_id="unsummed").read_record()
    assert all(loc.checksums is None for loc in record.locations.values())
    assert torch.equal(load({"w": torch.zeros(1024, 2048)}, lmdb_url, cid="unsummed")["w"], sd["w"])


def test_reader_pinned_to_a_save_refuses_a_resaved_id(store_url: str, caplog) -> None:
    dcp.save(
        {"t": torch.full((8,), 1.0)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="p"
    )
    first = KVStorageReader(store_url, checkpoint_id="p").read_record().save_id
    out = {"t": torch.zeros(8)}
    dcp.load(out, storage_reader=KVStorageReader(store_url, checkpoint_id="p", save_id=first))
    assert torch.equal(out["t"], torch.full((8,), 1.0))
    dcp.save(
        {"t": torch.full((8,), 2.0)}, storage_writer=KVStorageWriter(store_url), checkpoint_id="p"
    )
    with load_fails(caplog, f"was re-saved.*not save {first}"):
        dcp.load(out, storage_reader=KVStorageReader(store_url, checkpoint_id="p", save_id=first))
    assert torch.equal(out["t"], torch.full((8,), 1.0))  # nothing was loaded


def assert_each_holds_its_step(store_url: str, steps: tuple[int, ...]) -> None:
    """Checkpoint ``s{step}`` holds tensors filled with ``step`` (the async-save tests)."""
    for step in steps:
        out = load(
            {"w": torch.empty(1000), "b": torch.empty(10, dtype=torch.bfloat16)},
            store_url,
            f"s{step}",
        )
        assert all(torch.equal(t, torch.full_like(t, step)) for t in out.values())


def test_async_save_with_a_reused_dcp_stager(store_url: str) -> None:
    """A DCP stager kept across saves (staging into one reused buffer, the way to cut the time
    async_save blocks) works with kvckpt's writer: each checkpoint holds its own step's values."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    if TORCH_VERSION < (2, 13):
        pytest.skip(
            "torch 2.11's DefaultStager fails on its second stage() with DCP's own "
            "FileSystemWriter too (KeyError: <class 'type'>)"
        )
    stager = DefaultStager(StagingOptions(False, False, False, False))  # CPU: no pinning
    sd = {"w": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.bfloat16)}
    try:
        for step in (1, 2):
            for t in sd.values():
                t.fill_(step)
            fut = dcp.async_save(
                sd,
                storage_writer=KVStorageWriter(store_url),
                checkpoint_id=f"s{step}",
                async_stager=stager,
            )
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse on newer torch
            fut.result()
    finally:
        stager.close()
    assert_each_holds_its_step(store_url, (1, 2))


def test_writer_reused_with_cache_staged_state_dict_on_a_cpu_host(store_url: str) -> None:
    """cache_staged_state_dict=True keeps one staging copy across dcp.async_save calls. DCP's
    stager pins that copy unconditionally, which fails where there is no accelerator; kvckpt's
    pins it only where one is. Each checkpoint still holds its own step's values."""
    writer = KVStorageWriter(store_url, keep_last=2, cache_staged_state_dict=True)
    sd = {"w": torch.zeros(1000), "b": torch.zeros(10, dtype=torch.bfloat16)}
    buffers = []
    for step in (1, 2, 3):
        for t in sd.values():
            t.fill_(step)
        writer.reset(f"s{step}")
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=None)
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse on newer torch
        fut.result()
        buffers.append(writer.state_dict_cache["w"].data_ptr())
    assert len(set(buffers)) == 1  # the same staging copy, reused
    assert writer.state_dict_cache["w"].is_pinned() == accelerator_available()
    assert [c.checkpoint_id for c in list_checkpoints(store_url)] == ["s3", "s2"]
    assert_each_holds_its_step(store_url, (2, 3))


class _SlowHash:
    """xxh3 as kvckpt records it, slowed down: a CPU that hashes slowly for how fast it sends."""

    def __init__(self) -> None:
        import xxhash

        self._hash = xxhash.xxh3_64()

    def update(self, data) -> None:  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        self._hash.update(data)

    def intdigest(self) -> int:
        return self._hash.intdigest()


def test_a_redis_save_that_hashes_slowly_as_it_sends_hashes_on_a_thread_next_time(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where hashing inline took more than a tenth of a save's write and a core is free, the
    next saves to that store hash on a worker thread: the same checksums, checked on load."""
    from kvckpt import writer

    monkeypatch.setattr(writer, "new_checksum", _SlowHash)
    # two cores no rank trains on; the Redis server of the test, on this node, takes one
    monkeypatch.setattr(writer, "spare_cores", lambda: 2)
    monkeypatch.setattr(writer, "_HASH_ASIDE", set())
    sd = {f"w{i}": torch.randn(256, 256) for i in range(4)}
    save(sd, redis_url, cid="first")
    assert open_store(redis_url).url in writer._HASH_ASIDE  # measured: too slow inline
    sums = writer._Checksums(open_store(redis_url), True)
    assert sums.on_value is None and sums._pool is not None  # hashed on a worker thread
    sums.close()
    save(sd, redis_url, cid="second")
    for cid in ("first", "second"):
        record = KVStorageReader(redis_url, checkpoint_id=cid).read_record()
        assert all(loc.checksums is not None for loc in record.locations.values())
        out = load({k: torch.zeros(256, 256) for k in sd}, redis_url, cid=cid)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    flip_one_byte(redis_url, "second", "w1")
    with pytest.raises(BaseException, match="does not match the checksum"):
        load({k: torch.zeros(256, 256) for k in sd}, redis_url, cid="second")


def test_a_redis_save_with_no_core_to_spare_keeps_hashing_as_it_sends(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every core trains, a worker thread would take training's time: slow or not, the
    hashing stays on the sending thread."""
    from kvckpt import writer

    monkeypatch.setattr(writer, "spare_cores", lambda: 0)  # no core to hash on
    monkeypatch.setattr(writer, "new_checksum", _SlowHash)
    monkeypatch.setattr(writer, "_HASH_ASIDE", set())
    save({"w": torch.randn(256, 256)}, redis_url)
    assert set() == writer._HASH_ASIDE


def test_a_redis_server_on_this_node_takes_the_core_a_save_would_hash_on(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one core no rank trains on is the local Redis server's while a save sends: the
    hashing stays on the sending thread, however slow."""
    from kvckpt import writer

    assert open_store(redis_url).server_on_node
    monkeypatch.setattr(writer, "spare_cores", lambda: 1)
    monkeypatch.setattr(writer, "new_checksum", _SlowHash)
    monkeypatch.setattr(writer, "_HASH_ASIDE", set())
    save({"w": torch.randn(256, 256)}, redis_url)
    assert set() == writer._HASH_ASIDE


@pytest.mark.parametrize(
    ("url", "on_node"),
    [
        ("redis://localhost:6379/0", True),
        ("redis://127.0.0.1:6379/0", True),
        ("redis://[::1]:6379/0", True),
        ("unix:///run/redis.sock", True),
        ("redis://10.0.0.7:6379/0", False),
        ("redis://cache.internal:6379/0", False),
    ],
)
def test_a_redis_engine_knows_whether_its_server_is_on_this_node(url: str, on_node: bool) -> None:
    assert open_store(url).server_on_node is on_node
