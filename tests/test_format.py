"""The metadata codec of docs/FORMAT.md: round trips, and clear errors for anything malformed."""

from __future__ import annotations

import contextlib
import pickle

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from kvckpt import MetadataError, UnsupportedFormatVersionError
from kvckpt.format import DTYPES, decode_data_keys, decode_metadata, encode_metadata
from kvckpt.keys import ItemLocation, data_prefix, meta_key, parse_meta_key, part_ranges

SAVE_ID = "0123456789abcdef0123456789abcdef"


def sample() -> tuple[Metadata, dict[MetadataIndex, ItemLocation]]:
    tmd = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.bfloat16),
        size=torch.Size([4, 6]),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 6])),
            ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 6])),
        ],
    )
    md = Metadata(
        state_dict_metadata={"w": tmd, "opt.lr": BytesStorageMetadata()},
        planner_data={"w": ("w",), "opt.lr": ("opt", "lr", 0)},
        storage_meta=StorageMeta(checkpoint_id="c1", save_id=SAVE_ID, modules=["m"]),
        version="1.0.0",
    )
    locs = {
        MetadataIndex("w", [0, 0]): ItemLocation(0, 0, 24, 1 << 20),
        MetadataIndex("w", [2, 0]): ItemLocation(1, 0, 24, 1 << 20),
        MetadataIndex("opt.lr"): ItemLocation(0, 1, 100, 1 << 20),
    }
    return md, locs


def encode(**overrides: object) -> bytes:
    md, locs = sample()
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=lambda c, d: d)
    doc.update(overrides)
    return msgpack.packb(doc, use_bin_type=True)


def test_round_trip() -> None:
    md, locs = sample()
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    rec = decode_metadata(raw, where="test")
    assert rec.checkpoint_id == "c1" and rec.save_id == SAVE_ID and rec.world_size == 2
    assert rec.total_bytes == 148
    assert rec.metadata.state_dict_metadata == md.state_dict_metadata
    assert rec.metadata.planner_data == md.planner_data  # tuples stay tuples
    assert isinstance(rec.metadata.planner_data["opt.lr"], tuple)
    assert rec.locations == locs
    assert rec.metadata.storage_meta.modules == ["m"]
    assert len(rec.data_keys("kvckpt")) == 3


def test_all_dtypes_have_names() -> None:
    for name in (
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
        "bool",
        "int8",
        "uint8",
        "int64",
        "complex64",
        "complex128",
    ):
        assert name in DTYPES


def test_keys_follow_the_schema() -> None:
    assert meta_key("p", "step-1") == "{p}/meta/step-1"
    assert meta_key("p", "step-1", 3) == "{p}/meta/step-1/rank/3"
    assert parse_meta_key("p", "{p}/meta/step-1") == ("step-1", None)
    assert parse_meta_key("p", "{p}/meta/step-1/rank/3") == ("step-1", 3)
    assert parse_meta_key("p", "p/data/x") is None
    assert data_prefix("p", "c", SAVE_ID) == f"p/data/c/{SAVE_ID}/"
    assert ItemLocation(1, 2, 10, 4).keys("p", "c", SAVE_ID) == [
        f"p/data/c/{SAVE_ID}/1/2/{i}" for i in range(3)
    ]


def test_part_ranges() -> None:
    assert part_ranges(0, 4) == [(0, 0)]
    assert part_ranges(4, 4) == [(0, 4)]
    assert part_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_newer_version_is_refused_with_upgrade_hint() -> None:
    with pytest.raises(UnsupportedFormatVersionError, match="upgrade kvckpt"):
        decode_metadata(encode(version=99), where="checkpoint 'c1'")


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"magic": "nope"}, "not kvckpt metadata"),
        ({"save_id": "xyz"}, "save_id"),
        ({"world_size": "2"}, "world_size"),
        ({"tensors": {"w": {"dtype": "evil", "size": [1], "chunks": []}}}, "unknown dtype"),
        ({"tensors": {"w": {"dtype": "float32", "size": [2], "chunks": [[[1], [5]]]}}}, "outside"),
        ({"items": [["w", [0, 0], 0, 0, 999, 1024]]}, "declares 999 bytes"),
        ({"items": [["ghost", None, 0, 0, 1, 1]]}, "not declared"),
        ({"items": [["w", [0, 0], -1, 0, 24, 1024]]}, "non-negative"),
        ({"items": [["w", [0, 0], 0, 0, 24, 0]]}, "part_bytes"),
        ({"items": [["opt.lr", None, 0, 0, 1 << 60, 1]]}, "parts"),
        ({"items": "x"}, "items"),
    ],
)
def test_malformed_metadata_is_rejected(overrides: dict, fragment: str) -> None:
    with pytest.raises(MetadataError) as info:
        decode_metadata(encode(**overrides), where="checkpoint 'c1'")
    assert fragment in str(info.value)
    assert "checkpoint 'c1'" in str(info.value)


def test_data_keys_without_a_full_decode() -> None:
    """The lean decode that deletions use names exactly the keys the full decode does (and
    refuses what it refuses among the fields it reads)."""
    md, locs = sample()
    locs[MetadataIndex("opt.lr")] = ItemLocation(0, 1, 100, 30)  # 4 parts
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    save_id, keys = decode_data_keys(raw, "pfx", "c1", where="checkpoint 'c1'")
    assert save_id == SAVE_ID
    assert keys == decode_metadata(raw, where="x").data_keys("pfx")
    assert len(keys) == 6 and keys[-1] == f"pfx/data/c1/{SAVE_ID}/0/1/3"
    for overrides, fragment in [
        ({"save_id": "../../x"}, "save_id"),
        ({"checkpoint_id": "a/b"}, "checkpoint_id"),
        # metadata planted under c1's key that names c2: deleting c1 must not delete c2's data
        ({"checkpoint_id": "c2"}, "names checkpoint 'c2', not 'c1'"),
        ({"items": [["w", [0, 0], -1, 0, 24, 1024]]}, "non-negative"),
        ({"items": [["w", [0, 0], 0, 0, 24, 0]]}, "part_bytes"),
        ({"version": 99}, "upgrade kvckpt"),
    ]:
        with pytest.raises(MetadataError, match=fragment):
            decode_data_keys(encode(**overrides), "pfx", "c1", where="checkpoint 'c1'")


class Boom:
    def __reduce__(self):
        return (print, ("pwned",))


@pytest.mark.parametrize(
    "raw",
    [
        pickle.dumps(Boom()),
        pickle.dumps({"magic": "kvckpt"}),
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        msgpack.packb(msgpack.ExtType(5, b"x")),
        encode()[:-7],
    ],
    ids=["pickle", "pickled-dict", "empty", "reserved-byte", "array", "ext-type", "truncated"],
)
def test_garbage_is_a_metadata_error(raw: bytes, capsys) -> None:
    with pytest.raises(MetadataError):
        decode_metadata(raw, where="checkpoint 'c1'")
    assert "pwned" not in capsys.readouterr().out


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_never_crash(raw: bytes) -> None:
    with contextlib.suppress(MetadataError):
        decode_metadata(raw, where="fuzz")


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.tuples(kids, kids)
        | st.dictionaries(st.text(max_size=5), kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_planner_data_round_trips(value: object) -> None:
    md, locs = sample()
    md.planner_data = value
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    assert decode_metadata(raw, where="x").metadata.planner_data == value


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "version",
                "world_size",
                "rank",
                "tensors",
                "objects",
                "items",
                "planner_data",
                "storage_meta",
                "total_bytes",
                "created_at",
                "checkpoint_id",
                "save_id",
            ]
        ),
        plain,
        max_size=4,
    )
)
def test_fuzz_fields_with_wrong_values(overrides: dict) -> None:
    with contextlib.suppress(MetadataError):
        decode_metadata(encode(**overrides), where="fuzz")
