"""A hostile store: metadata that decodes but lies, and values cut short. Loading must end in an
exception or in a load that read only what it was told to, never a crash or runaway memory."""

from __future__ import annotations

import tempfile

import msgpack
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvckpt import KVStorageReader, KVStorageWriter, open_store
from kvckpt.keys import meta_key

_STORE = tempfile.mkdtemp(prefix="kvckpt-hostile-")
URL = f"lmdb://{_STORE}"
SD = {
    "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
    "b": torch.ones(3),
    "o": {"lr": 0.1},
}
dcp.save(SD, storage_writer=KVStorageWriter(URL, checksums=True), checkpoint_id="base")
ENGINE = open_store(URL)
BASE = msgpack.unpackb(ENGINE.get(meta_key(ENGINE.prefix, "base")), strict_map_key=False)

ints = st.one_of(st.integers(-5, 40), st.sampled_from([2**31, 2**63 - 1, 2**64 - 1, -(2**63)]))


@st.composite
def lies(draw):
    doc = msgpack.unpackb(msgpack.packb(BASE), strict_map_key=False)
    doc["checkpoint_id"] = "lie"
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["item", "chunk", "dtype", "size", "value"]))
        if what == "item":
            item = draw(st.sampled_from(doc["items"]))
            item[draw(st.integers(1, 6))] = draw(
                st.one_of(ints, st.none(), st.lists(ints, max_size=3))
            )
        elif what == "chunk":
            chunk = doc["tensors"]["w"]["chunks"][0]
            chunk[draw(st.integers(0, 1))] = draw(st.lists(ints, max_size=3))
        elif what == "dtype":
            doc["tensors"][draw(st.sampled_from(["w", "b"]))]["dtype"] = draw(
                st.sampled_from(["float64", "bool", "int8", "complex128", "float8_e4m3fn", "x"])
            )
        elif what == "size":
            doc["tensors"]["w"]["size"] = draw(st.lists(ints, max_size=3))
        else:
            doc["truncate"] = draw(st.integers(0, 90))
    return doc


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lies())
def test_lying_metadata_and_short_values_fail_cleanly(doc: dict) -> None:
    truncate = doc.pop("truncate", None)
    cid = "lie"
    ENGINE.transact([], lambda _: {meta_key(ENGINE.prefix, cid): msgpack.packb(doc)})
    keys = [k for k in ENGINE.scan(f"{ENGINE.prefix}/data/base/")]
    if truncate is not None:
        for key in keys:
            ENGINE.put_many(
                [(key.replace("/base/", f"/{cid}/"), (ENGINE.get(key) or b"")[:truncate])]
            )
    else:
        for key in keys:
            ENGINE.put_many([(key.replace("/base/", f"/{cid}/"), ENGINE.get(key) or b"")])
    target = {"w": torch.zeros(4, 6), "b": torch.zeros(3), "o": {"lr": 0.0}}
    try:
        dcp.load(target, storage_reader=KVStorageReader(URL, verify=True), checkpoint_id=cid)
    except BaseException as e:  # DCP wraps errors in CheckpointException (a BaseException)
        if isinstance(e, KeyboardInterrupt | MemoryError | SystemExit):
            raise
    ENGINE.delete_prefix(f"{ENGINE.prefix}/data/{cid}/")


def test_unmodified_copy_loads() -> None:
    """The fuzz above starts from a valid checkpoint: make sure that copy really loads."""
    doc = msgpack.unpackb(msgpack.packb(BASE), strict_map_key=False)
    doc["checkpoint_id"] = "copy"
    ENGINE.transact([], lambda _: {meta_key(ENGINE.prefix, "copy"): msgpack.packb(doc)})
    for key in list(ENGINE.scan(f"{ENGINE.prefix}/data/base/")):
        ENGINE.put_many([(key.replace("/base/", "/copy/"), ENGINE.get(key) or b"")])
    target = {"w": torch.zeros(4, 6), "b": torch.zeros(3), "o": {"lr": 0.0}}
    dcp.load(target, storage_reader=KVStorageReader(URL, verify=True), checkpoint_id="copy")
    assert torch.equal(target["w"], SD["w"]) and target["o"]["lr"] == 0.1


def test_item_offsets_that_only_compare_equal_are_never_used() -> None:
    """An item's offsets written as floats or bools (0.0 == 0 == False) find their chunk, but
    the index the reader builds holds the chunk's own int offsets."""
    from kvckpt.format import decode_metadata

    doc = msgpack.unpackb(msgpack.packb(BASE), strict_map_key=False)
    for item in doc["items"]:
        if item[1] is not None:
            item[1] = [0.0 if i % 2 else False for i in range(len(item[1]))]
    record = decode_metadata(msgpack.packb(doc), where="test")
    offsets = [i.offset for i in record.locations if i.offset is not None]
    assert offsets and all(type(o) is int for off in offsets for o in off)
