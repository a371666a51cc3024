"""The engine contract as checks: what kvckpt relies on from every engine, runnable against any.

kvckpt's own tests run each check against real LMDB and a real redis-server; a third-party
engine runs the same ones from its tests (CONTRIBUTING.md shows a whole engine that passes):

    import pytest
    from kvckpt.testing.engine_checks import ENGINE_CHECKS

    @pytest.mark.parametrize("check", ENGINE_CHECKS)
    def test_my_engine(check):
        check(lambda: MyEngine(...))   # a fresh, empty store each time it is called

Each check takes a function that opens the store (and may call it again, for a second handle
on the same store) and raises ``AssertionError`` where the engine breaks the contract.
"""

from __future__ import annotations

import pickle
import random
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..engines.base import Engine
from ..format import checksum, new_checksum

Opener = Callable[[], Engine]


def read_values(engine: Engine, keys: list[str]) -> list[bytes | None]:
    """Each key's value through ``get_many``, copied out (None: missing)."""
    out: list[bytes | None] = [b"unset"] * len(keys)

    def consume(i: int, view: memoryview | None) -> None:
        out[i] = None if view is None else bytes(view)

    engine.get_many(keys, consume)
    return out


def check_put_get_scan_delete(open_engine: Opener) -> None:
    """Values of every size come back byte for byte; missing keys read as None; ``scan`` lists
    a prefix; ``delete`` counts what existed."""
    engine = open_engine()
    values = {f"t/a/{i}": bytes([i % 256]) * (i * 37) for i in range(200)}
    values["t/big"] = b"\x07" * (3 << 20)
    engine.put_many((k, memoryview(v)) for k, v in values.items())
    keys = sorted(values)
    assert read_values(engine, [*keys, "t/missing"]) == [*(values[k] for k in keys), None]
    assert sorted(engine.scan("t/a/")) == sorted(k for k in values if k.startswith("t/a/"))
    assert engine.get("t/a/3") == values["t/a/3"]
    assert engine.get("nope") is None
    assert engine.delete(["t/a/1", "t/a/2", "nope"]) == 2
    assert engine.delete_prefix("t/") == len(values) - 2
    assert list(engine.scan("t/")) == []


def check_borrow_lends_each_value(open_engine: Opener) -> None:
    """``borrow`` gives each value (None for a missing key) for the length of its block."""
    engine = open_engine()
    values = {"b/small": b"xyz", "b/big": bytes(range(256)) * 4096}
    engine.put_many((k, memoryview(v)) for k, v in values.items())
    with engine.borrow(["b/big", "b/missing", "b/small"]) as views:
        assert [None if v is None else bytes(v) for v in views] == [
            values["b/big"],
            None,
            values["b/small"],
        ]


def check_scan_prefix_is_literal(open_engine: Opener) -> None:
    """A prefix is a literal string, never a glob pattern."""
    engine = open_engine()
    engine.put_many([("g/a*b/1", b"x"), ("g/aXb/1", b"y"), ("g/a?b/1", b"z")])
    assert sorted(engine.scan("g/a*b/")) == ["g/a*b/1"]
    assert sorted(engine.scan("g/a?b/")) == ["g/a?b/1"]


def check_transact_is_read_modify_write(open_engine: Opener) -> None:
    """``transact`` from several threads at once loses no update, and writes None as delete."""
    engine = open_engine()

    def bump(current: list[bytes | None]) -> dict[str, bytes | None]:
        n = int(current[0] or 0)
        return {"counter": str(n + 1).encode(), "gone": None}

    engine.put_many([("gone", b"1")])
    threads = [
        threading.Thread(target=lambda: [engine.transact(["counter"], bump) for _ in range(20)])
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.get("counter") == b"80"
    assert engine.get("gone") is None


def check_pickles_to_the_same_store(open_engine: Opener) -> None:
    """An engine pickles (``dcp.async_save`` with a process, Megatron's async workers) into
    one that opens the same store."""
    engine = open_engine()
    engine.put_many([("p/1", b"abc")])
    clone = pickle.loads(pickle.dumps(engine))
    assert clone.get("p/1") == b"abc"
    assert clone.url == engine.url


def check_get_into_hashes_each_value(open_engine: Opener) -> None:
    """``get_into`` fills the caller's buffers, reports sizes (None: missing), and with a hasher
    passes each whole value's checksum to ``on_value``; a buffer of the wrong size is not
    filled and not reported."""
    rng = random.Random(7)
    values = {
        "h/empty": b"",
        "h/small": rng.randbytes(100),
        "h/odd": rng.randbytes((3 << 20) + 12345),
    }
    engine = open_engine()
    engine.put_many(values.items())
    keys = ["h/small", "h/missing", "h/odd", "h/empty", "h/small"]
    bufs = [memoryview(bytearray(len(values.get(k, b"?")))) for k in keys]
    bufs[4] = memoryview(bytearray(3))
    seen: dict[int, int | None] = {}
    sizes = engine.get_into(keys, bufs, seen.__setitem__, new_checksum)
    assert sizes == [100, None, len(values["h/odd"]), 0, 100]
    assert seen == {i: checksum(values[keys[i]]) for i in (0, 2, 3)}
    assert bytes(bufs[2]) == values["h/odd"]
    seen.clear()
    engine.get_into(keys[:1], bufs[:1], seen.__setitem__)
    assert seen == {0: None}


def check_put_many_hashes_if_it_says_so(open_engine: Opener) -> None:
    """An engine with ``hashes_while_writing`` reports each value's checksum by its position;
    one without it is never asked to (the writer hashes for it)."""
    engine = open_engine()
    if not engine.hashes_while_writing:
        return
    rng = random.Random(11)
    values = [
        ("w/empty", b""),
        ("w/small", rng.randbytes(100)),
        ("w/edge", rng.randbytes(64 * 1024)),
        ("w/odd", rng.randbytes((3 << 20) + 12345)),
        ("w/small2", rng.randbytes(7)),
    ]
    seen: dict[int, int | None] = {}
    engine.put_many(iter(values), on_value=seen.__setitem__, hasher=new_checksum)
    assert seen == {i: checksum(v) for i, (_, v) in enumerate(values)}
    assert read_values(engine, [k for k, _ in values]) == [v for _, v in values]


def check_a_checkpoint_round_trip(open_engine: Opener) -> None:
    """Through kvckpt itself: save with DCP, list, verify, load bit-exact, export, delete."""
    from .. import KVStorageReader, KVStorageWriter, delete_checkpoint, list_checkpoints
    from ..dcp_files import export_checkpoint
    from ..verify import verify

    state: dict[str, Any] = {
        "w": torch.randn(64, 33),
        "b": torch.arange(10, dtype=torch.bfloat16),
        "extra": {"step": 7, "note": "x"},
    }
    engine = open_engine()
    dcp.save(state, storage_writer=KVStorageWriter(engine), checkpoint_id="c-1")
    assert [i.checkpoint_id for i in list_checkpoints(engine)] == ["c-1"]
    assert verify(engine, "c-1").ok
    out: dict[str, Any] = {
        "w": torch.zeros(64, 33),
        "b": torch.zeros(10, dtype=torch.bfloat16),
        "extra": {"step": 0, "note": ""},
    }
    dcp.load(out, storage_reader=KVStorageReader(engine), checkpoint_id="c-1")
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["extra"] == state["extra"]
    with tempfile.TemporaryDirectory() as tmp:
        export_checkpoint(engine, "c-1", f"{tmp}/c-1")
    delete_checkpoint(engine, "c-1")
    assert list_checkpoints(engine) == []
    assert list(engine.scan(f"{engine.prefix}/data/")) == []


#: Every check, in the order a failing engine is easiest to debug in.
ENGINE_CHECKS = [
    check_borrow_lends_each_value,
    check_put_get_scan_delete,
    check_scan_prefix_is_literal,
    check_transact_is_read_modify_write,
    check_pickles_to_the_same_store,
    check_get_into_hashes_each_value,
    check_put_many_hashes_if_it_says_so,
    check_a_checkpoint_round_trip,
]
