"""Format 2: data keys named by each item's MetadataIndex; format 1 checkpoints (fixtures
written by kvckpt 0.1) keep loading, listing, verifying, exporting, copying and being deleted.
Real LMDB environments and a real redis-server."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    MetadataError,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.copying import copy_checkpoint
from kvckpt.dcp_files import export_checkpoint
from kvckpt.engines.base import DEFAULT_PART_BYTES
from kvckpt.format import (
    FORMAT_VERSION,
    MAX_PARTS,
    MAX_RANKS,
    decode_data_keys,
    decode_metadata,
    encode_metadata,
)
from kvckpt.keys import ITEM_NAME, MAX_ITEM_NAME, ItemLocation, index_name, item_name, spare_key
from kvckpt.verify import read_items, verify
from tests.fixtures.make_format1 import state
from tests.test_dcp import assert_bit_equal, zeros_like_sd
from tests.test_format import SAVE_ID, sample

FIXTURE = Path(__file__).parent / "fixtures" / "format1.msgpack"

# -- item names -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fqn", "offsets", "name"),
    [
        (
            "model.layers.0.attention.wq.weight",
            (4096, 0),
            "model.layers.0.attention.wq.weight@4096,0",
        ),
        ("optimizer.state.lr", None, "optimizer.state.lr"),
        ("step", (), "step@"),
        ("a/b", None, "a%2Fb"),
        ("{tag}*?[x]", (0,), "%7Btag%7D%2A%3F%5Bx%5D@0"),
        ("at@home,1+2", None, "at%40home%2C1%2B2"),
        ("tab\tnew\nline sp", None, "tab%09new%0Aline%20sp"),
        ("poids_é", (1, 2), "poids_%C3%A9@1,2"),
        ("100%", None, "100%25"),
        ("x~y-z_w.v", None, "x~y-z_w.v"),
    ],
)
def test_item_names_are_readable_and_escaped(fqn: str, offsets: tuple | None, name: str) -> None:
    assert item_name(fqn, offsets) == name
    assert ITEM_NAME.fullmatch(name)


def test_long_names_keep_a_readable_head_and_a_hash() -> None:
    long = "decoder.layers.mlp.linear_fc1." * 10
    a = item_name(long + "weight", (0, 0))
    b = item_name(long + "weight", (0, 8))  # differs only after the head
    c = item_name(long + "bias", (0, 0))
    assert len({a, b, c}) == 3
    for name in (a, b, c):
        assert len(name) == MAX_ITEM_NAME and ITEM_NAME.fullmatch(name)
        assert name.startswith("decoder.layers.mlp.") and re.search(r"\+[0-9a-f]{16}$", name)
    # an escape is never cut in two
    escaped = item_name("é" * 100, None)
    head = escaped.rsplit("+", 1)[0]
    assert re.fullmatch(r"(%[0-9A-F]{2})+", head)
    assert len(escaped) <= MAX_ITEM_NAME


def test_names_never_collide() -> None:
    """Object vs tensor, escaped vs raw, hashed vs unhashed: all distinct."""
    cases = [
        ("a", None),
        ("a", ()),
        ("a", (0,)),
        ("a@", None),
        ("a@0", None),
        ("a%40", None),
        ("a/b", None),
        ("a%2Fb", None),
        ("a" * 200, None),
        ("a" * 201, None),
        ("a" * 103 + "+0000000000000000", None),
        ("a", (0, 1)),
        ("a", (0,)),
        ("a", (1,)),
    ]
    names = {(fqn, offsets): item_name(fqn, offsets) for fqn, offsets in cases}
    assert len(set(names.values())) == len(names)


def test_longest_keys_fit_lmdb(tmp_path: Path) -> None:
    """The longest prefix, checkpoint id, rank and part number with a hashed name: at most 503
    bytes, under LMDB's 511 (FORMAT.md)."""
    loc = ItemLocation(MAX_RANKS - 1, 0, 2, 1, name=item_name("x" * 500, (0,) * 64))
    key = loc.keys("p" * 128, "c" * 200, SAVE_ID)[0][:-1] + str(MAX_PARTS - 1)
    assert len(key.encode()) == 503
    engine = open_store(f"lmdb://{tmp_path}/s?prefix={'p' * 128}")
    engine.put_many([(key, b"v")])
    assert engine.get(key) == b"v"
    engine.close()


def test_spares_of_format_2_keys_name_rank_item_and_part() -> None:
    key = f"p/data/c/{SAVE_ID}/3/model.w@0,0/2"
    assert spare_key("p", key) == "p/spare/3/model.w@0,0/2"


# -- the metadata -----------------------------------------------------------------------------


def named_sample() -> tuple:
    md, locs = sample()
    return md, {
        index: ItemLocation(
            loc.rank, loc.plan_position, loc.nbytes, loc.part_bytes, name=index_name(index)
        )
        for index, loc in locs.items()
    }


def test_format_2_round_trips_and_names_its_keys() -> None:
    md, locs = named_sample()
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    record = decode_metadata(raw, where="x")
    assert record.format_version == FORMAT_VERSION == 2
    assert record.locations == locs
    head = f"p/data/c1/{SAVE_ID}"
    assert sorted(record.data_keys("p")) == [
        f"{head}/0/opt.lr/0",
        f"{head}/0/w@0,0/0",
        f"{head}/1/w@2,0/0",
    ]
    assert decode_data_keys(raw, "p", "c1", where="x") == (SAVE_ID, record.data_keys("p"))


def test_format_1_locations_are_written_back_as_format_1() -> None:
    """Metadata rewritten in place (Megatron's removal of tensors) keeps its keys' format."""
    md, locs = sample()
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    doc = msgpack.unpackb(raw, strict_map_key=False, ext_hook=lambda c, d: d)
    assert doc["version"] == 1 and all(len(item) == 7 for item in doc["items"])
    record = decode_metadata(raw, where="x")
    assert record.format_version == 1
    assert f"p/data/c1/{SAVE_ID}/0/1/0" in record.data_keys("p")  # opt.lr: rank 0, n 1


def test_one_checkpoint_never_mixes_formats_or_repeats_a_key() -> None:
    md, locs = named_sample()
    mixed = dict(locs)
    mixed[MetadataIndex("opt.lr")] = ItemLocation(0, 1, 100, 1 << 20)
    with pytest.raises(ValueError, match="format 1 keys and by format 2"):
        encode_metadata(md, mixed, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    same = dict(locs)
    same[MetadataIndex("opt.lr")] = ItemLocation(0, 1, 100, 1 << 20, name="w@0,0")
    with pytest.raises(ValueError, match="same data keys"):
        encode_metadata(md, same, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    bad = dict(locs)
    bad[MetadataIndex("opt.lr")] = ItemLocation(0, 1, 100, 1 << 20, name="opt/lr")
    with pytest.raises(ValueError, match="not an item name"):
        encode_metadata(md, bad, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)


def _v2(**overrides: object) -> bytes:
    md, locs = named_sample()
    raw = encode_metadata(md, locs, checkpoint_id="c1", save_id=SAVE_ID, world_size=2)
    doc = msgpack.unpackb(raw, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    doc.update(overrides)
    return msgpack.packb(doc, use_bin_type=True)


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([["w", [0, 0], 0, 0, 24, 1024, None]], "should be [fqn"),  # no name in format 2
        ([["w", [0, 0], 0, 0, 24, 1024, None, "../x"]], "name '../x'"),
        ([["w", [0, 0], 0, 0, 24, 1024, None, "a{b}"]], "name 'a{b}'"),
        ([["w", [0, 0], 0, 0, 24, 1024, None, "x" * 121]], "at most 120"),
        ([["w", [0, 0], 0, 0, 24, 1024, None, 5]], "name '5'"),
        ([[]], "should be [fqn"),
        (
            [
                ["w", [0, 0], 0, 0, 24, 1024, None, "same"],
                ["w", [2, 0], 0, 1, 24, 1024, None, "same"],
            ],
            "same data keys",
        ),
    ],
)
def test_format_2_items_are_checked(items: list, fragment: str) -> None:
    with pytest.raises(MetadataError, match=re.escape(fragment)):
        decode_metadata(_v2(items=items), where="checkpoint 'c1'")
    if "same data keys" not in fragment:  # the lean decode checks the fields it reads
        with pytest.raises(MetadataError, match=re.escape(fragment)):
            decode_data_keys(_v2(items=items), "p", "c1", where="checkpoint 'c1'")


# -- saves and loads with awkward names, real stores ------------------------------------------


AWKWARD = {
    "layers/0 {attn}": {"w*?[0]": torch.arange(12.0).reshape(3, 4)},
    "poids_é": torch.ones(3, dtype=torch.bfloat16),
    "x" * 400: torch.full((2,), 7.0),  # a long fqn: a hashed name
    "y" * 400: torch.full((2,), 8.0),
    "meta": {"note@1": "kept", "step": 5},
    "scalar": torch.tensor(3.5),
}


def test_awkward_fqns_save_and_load_with_readable_keys(store_url: str) -> None:
    dcp.save(AWKWARD, storage_writer=KVStorageWriter(store_url), checkpoint_id="odd")
    out = zeros_like_sd(AWKWARD)
    dcp.load(out, storage_reader=KVStorageReader(store_url), checkpoint_id="odd")
    assert torch.equal(out["layers/0 {attn}"]["w*?[0]"], AWKWARD["layers/0 {attn}"]["w*?[0]"])
    assert torch.equal(out["poids_é"], AWKWARD["poids_é"])
    assert torch.equal(out["x" * 400], AWKWARD["x" * 400])
    assert torch.equal(out["y" * 400], AWKWARD["y" * 400])
    assert out["meta"] == {"note@1": "kept", "step": 5}, out["meta"]
    assert torch.equal(out["scalar"], AWKWARD["scalar"])

    engine = open_store(store_url)
    record = KVStorageReader(engine, checkpoint_id="odd").read_record()
    assert record.format_version == 2
    names = {key.split("/")[-2] for key in engine.scan(f"{engine.prefix}/data/odd/")}
    assert "layers%2F0%20%7Battn%7D.w%2A%3F%5B0%5D@0,0" in names
    assert "poids_%C3%A9@0" in names and "meta.note%401" in names and "scalar@" in names
    assert sum(1 for n in names if "+" in n) == 2
    assert all(ITEM_NAME.fullmatch(n) for n in names)
    assert verify(engine, "odd").ok


def test_cluster_data_keys_carry_no_hash_tag() -> None:
    """Braces in fqns are escaped, so Redis Cluster still spreads data keys over all slots."""
    name = item_name("{same}.w", (0,))
    assert "{" not in name and "}" not in name


# -- format 1 fixtures --------------------------------------------------------------------------


def restore_fixture(url: str) -> None:
    engine = open_store(url)
    engine.put_many(msgpack.unpackb(FIXTURE.read_bytes()).items())
    engine.close()


def full_state(step: int) -> dict:
    """Both ranks' state at ``step``, as one process loads it."""
    out = state(0, step)
    out["rank1.own"] = state(1, step)["rank1.own"]
    return out


@pytest.fixture
def format1_url(store_url: str) -> str:
    restore_fixture(store_url)
    return store_url


def test_format_1_checkpoints_load(format1_url: str) -> None:
    for step in (1, 2):
        want = full_state(step)
        out = zeros_like_sd(want)
        dcp.load(out, storage_reader=KVStorageReader(format1_url), checkpoint_id=f"step-{step}")
        assert_bit_equal(out, want)
    engine = open_store(format1_url)
    for rank in (0, 1):  # the rank-local save: each rank's own record
        record = KVStorageReader(engine, checkpoint_id="local").read_record(rank=rank)
        assert record.format_version == 1
        got = {index.fqn: bytes(view) for index, _, view in read_items(engine, record)}
        own = state(rank, 3)[f"rank{rank}.own"]
        assert got[f"rank{rank}.own"] == own.numpy().tobytes()


def test_format_1_checkpoints_list_verify_and_show_their_keys(format1_url: str) -> None:
    infos = {(i.checkpoint_id, i.rank_local) for i in list_checkpoints(format1_url)}
    assert infos == {("step-1", False), ("step-2", False), ("local", True)}
    assert latest_checkpoint(format1_url) in {"step-2", "local"}
    for cid in ("step-1", "step-2", "local"):
        report = verify(format1_url, cid)
        assert report.ok, report.problems
    shown = subprocess.run(
        [sys.executable, "-m", "kvckpt", "info", format1_url, "step-1", "--keys", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(shown.stdout)
    assert doc["format_version"] == 1
    embed = next(i for i in doc["write_items"] if i["fqn"] == "model.embed.weight")
    assert len(embed["keys"]) == 2 and re.search(r"/0/0/1$", embed["keys"][1])


def test_format_1_checkpoints_export_and_copy_as_format_2(format1_url: str, tmp_path: Path) -> None:
    want = full_state(1)
    directory = export_checkpoint(format1_url, "step-1", tmp_path / "dcp")
    out = zeros_like_sd(want)
    dcp.load(out, checkpoint_id=str(directory))
    assert_bit_equal(out, want)

    copied = copy_checkpoint(format1_url, "step-1", format1_url, "step-1-v2")
    assert copied.format_version == 2
    engine = open_store(format1_url)
    names = {key.split("/")[-2] for key in engine.scan(f"{engine.prefix}/data/step-1-v2/")}
    assert "model.embed.weight@0,0" in names and "extra.name" in names
    out = zeros_like_sd(want)
    dcp.load(out, storage_reader=KVStorageReader(format1_url), checkpoint_id="step-1-v2")
    assert_bit_equal(out, want)
    assert verify(format1_url, "step-1-v2").ok


def test_format_1_checkpoints_are_deleted_and_gcd(format1_url: str) -> None:
    engine = open_store(format1_url)
    before = set(engine.scan(f"{engine.prefix}/data/"))
    delete_checkpoint(format1_url, "step-1")
    left = set(engine.scan(f"{engine.prefix}/data/"))
    assert not any("/data/step-1/" in k for k in left) and len(left) == len(before) - 9
    gc(format1_url, keep_last=1)
    assert len(list_checkpoints(format1_url)) == 1
    remaining = set(engine.scan(f"{engine.prefix}/data/"))
    live = set()
    for info in list_checkpoints(format1_url):
        ranks = [0, 1] if info.rank_local else [None]
        for rank in ranks:
            record = KVStorageReader(engine, checkpoint_id=info.checkpoint_id).read_record(rank)
            live |= set(record.data_keys(engine.prefix))
    assert remaining == live  # gc left exactly the data of the checkpoints it kept


def test_a_new_save_over_a_format_1_checkpoint_replaces_its_keys(format1_url: str) -> None:
    engine = open_store(format1_url)
    old = set(engine.scan(f"{engine.prefix}/data/step-2/"))
    dcp.save(full_state(4), storage_writer=KVStorageWriter(format1_url), checkpoint_id="step-2")
    new = set(engine.scan(f"{engine.prefix}/data/step-2/"))
    assert not old & new
    assert KVStorageReader(engine, checkpoint_id="step-2").read_record().format_version == 2


def test_checkpoints_with_parts_of_another_size_load_beside_new_ones(tmp_path: Path) -> None:
    """A store that holds checkpoints saved with 4 MiB parts (LMDB's default in unreleased
    builds after 0.2.0) loads and verifies them as they are; new saves into it use the default
    part size."""
    url = f"lmdb://{tmp_path / 's'}"
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: several parts either way
    dcp.save(big, storage_writer=KVStorageWriter(url + "?part_bytes=4MiB"), checkpoint_id="old")
    dcp.save(big, storage_writer=KVStorageWriter(url), checkpoint_id="new")
    records = {cid: KVStorageReader(url, checkpoint_id=cid).read_record() for cid in ("old", "new")}
    parts = {cid: [loc.part_bytes for loc in r.locations.values()] for cid, r in records.items()}
    assert parts == {"old": [4 << 20], "new": [DEFAULT_PART_BYTES]}
    for cid in ("old", "new"):
        assert verify(url, cid).ok
        out = {"w": torch.zeros_like(big["w"])}
        dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id=cid)
        assert torch.equal(out["w"], big["w"])
