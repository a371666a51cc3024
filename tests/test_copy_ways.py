"""The way a load copies (and, verified, hashes) each value: the native loop with ordinary or
non-temporal stores, pieces of a size, numpy's copy; chosen by timing the process's own values."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvckpt.engines import _copy_ways, base
from kvckpt.engines._copy_ways import (
    DEFAULT,
    MEMCPY,
    MIN_TIMED_BYTES,
    NATIVE,
    NATIVE_NO_PREFETCH,
    NATIVE_STREAM,
    NATIVE_STREAM_NO_PREFETCH,
    NATIVE_WAYS,
    PIECES,
    STREAM,
    STREAM_MIN_BYTES,
    TimedChoice,
)
from kvckpt.engines.base import DEFAULT_PART_BYTES

from ._cli import run

KIB = 1024


def test_candidates_take_turns_until_each_is_timed_then_the_fastest_median_stays() -> None:
    choice = TimedChoice((256 * KIB, 512 * KIB, 1024 * KIB), samples=3, run=1, min_timed=4096)
    cost = {256 * KIB: 3.0, 512 * KIB: 1.0, 1024 * KIB: 2.0}
    tried = []
    while choice.chosen is None:
        size = choice.trial(8192)
        assert size is not None
        tried.append(size)
        # One slow outlier for the fastest candidate: a median ignores it.
        slow = 100.0 if size == 512 * KIB and tried.count(size) == 1 else 1.0
        choice.record(size, 8192, cost[size] * slow)
    assert tried == [256 * KIB, 512 * KIB, 1024 * KIB] * 3
    assert choice.chosen == 512 * KIB
    assert choice.way() == 512 * KIB
    assert choice.trial(8192) is None  # chosen: nothing more is timed
    assert set(choice.medians()) == set(cost)


def test_each_candidate_times_a_run_of_values_so_both_copy_threads_run_it_at_once() -> None:
    choice = TimedChoice((256 * KIB, 512 * KIB), samples=4, run=2, min_timed=4096)
    tried = []
    while (size := choice.trial(8192)) is not None:
        tried.append(size)
        choice.record(size, 8192, 1.0 if size == 512 * KIB else 2.0)
    assert tried == [256 * KIB] * 2 + [512 * KIB] * 2 + [256 * KIB] * 2 + [512 * KIB] * 2
    assert choice.chosen == 512 * KIB
    with pytest.raises(ValueError, match="run"):
        TimedChoice((64 * KIB,), run=0)


def test_small_values_are_not_timed_and_use_the_default() -> None:
    choice = TimedChoice((256 * KIB, 512 * KIB), samples=1, default=384 * KIB, min_timed=4096)
    assert choice.trial(4095) is None
    assert choice.way() == 384 * KIB
    assert choice.chosen is None


def test_one_candidate_is_chosen_from_the_start_and_bad_settings_are_refused() -> None:
    assert TimedChoice((64 * KIB,)).chosen == 64 * KIB
    with pytest.raises(ValueError, match="candidate"):
        TimedChoice(())
    with pytest.raises(ValueError, match="sample"):
        TimedChoice((64 * KIB,), samples=0)


def test_records_after_the_choice_change_nothing() -> None:
    choice = TimedChoice((1 * KIB, 2 * KIB), samples=1, min_timed=1)
    choice.record(1 * KIB, 10, 1.0)
    choice.record(2 * KIB, 10, 2.0)
    assert choice.chosen == 1 * KIB
    choice.record(2 * KIB, 10, 0.0)
    assert choice.chosen == 1 * KIB


def test_threads_timing_at_once_agree_on_one_choice() -> None:
    choice = TimedChoice((1 * KIB, 2 * KIB, 4 * KIB), samples=50, min_timed=1)

    def work() -> None:
        while (size := choice.trial(100)) is not None:
            choice.record(size, 100, float(size))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert choice.chosen == 1 * KIB


@pytest.mark.parametrize("piece", [*PIECES, DEFAULT, 3000])
def test_copy_and_hash_gives_the_same_bytes_and_digest_with_every_piece_size(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", TimedChoice((piece,)))
    src = np.random.default_rng(0).integers(0, 256, 5 * 1024 * KIB + 123, dtype=np.uint8)
    dest = np.zeros_like(src)
    digest = base.copy_and_hash(memoryview(dest), memoryview(src), xxhash.xxh3_64())
    assert digest == xxhash.xxh3_64_intdigest(src.tobytes())
    assert np.array_equal(dest, src)


def test_copy_and_hash_times_values_for_the_process_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = TimedChoice((256 * KIB, 512 * KIB), samples=2, run=2, min_timed=1024 * KIB)
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", choice)
    src = np.ones(1024 * KIB, dtype=np.uint8)
    for _ in range(4):
        base.copy_and_hash(memoryview(np.empty_like(src)), memoryview(src), xxhash.xxh3_64())
    assert choice.chosen in (256 * KIB, 512 * KIB)
    assert set(choice.medians()) == {256 * KIB, 512 * KIB}  # both timed, twice each


def test_copies_beside_other_work_are_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that runs beside another kind of work (a new LMDB store's first save, whose
    other thread writes through the file) uses the way without timing it for the choice."""
    choice = TimedChoice((256 * KIB, 512 * KIB), samples=1, run=1, min_timed=1024 * KIB)
    plain = TimedChoice((MEMCPY, STREAM), samples=1, run=1, default=MEMCPY, min_timed=1 << 20)
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", choice)
    monkeypatch.setattr(_copy_ways, "COPY_WAY", plain)
    src = np.random.default_rng(7).integers(0, 256, 2 << 20, dtype=np.uint8)
    dest = np.zeros_like(src)
    digest = base.copy_and_hash(memoryview(dest), memoryview(src), xxhash.xxh3_64(), timed=False)
    assert digest == xxhash.xxh3_64_intdigest(src.tobytes()) and np.array_equal(dest, src)
    base.copy_into(memoryview(np.zeros_like(src)), memoryview(src), timed=False)
    assert choice.medians() == {} and plain.medians() == {}


def test_copies_into_a_store_choose_their_way_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's copies into a store's memory time ``SAVE_COPY_HASH_WAY`` / ``SAVE_COPY_WAY``,
    a load's copies out of it ``COPY_HASH_WAY`` / ``COPY_WAY``: the fastest way can differ."""
    choices = {
        name: TimedChoice((256 * KIB, 512 * KIB), samples=1, run=1, min_timed=1024 * KIB)
        for name in ("COPY_HASH_WAY", "SAVE_COPY_HASH_WAY")
    } | {
        name: TimedChoice((MEMCPY, STREAM), samples=1, run=1, default=MEMCPY, min_timed=1 << 20)
        for name in ("COPY_WAY", "SAVE_COPY_WAY")
    }
    for name, choice in choices.items():
        monkeypatch.setattr(_copy_ways, name, choice)
    src = np.random.default_rng(8).integers(0, 256, 2 << 20, dtype=np.uint8)
    base.copy_and_hash(
        memoryview(np.zeros_like(src)), memoryview(src), xxhash.xxh3_64(), True, True
    )
    base.copy_into(memoryview(np.zeros_like(src)), memoryview(src), True, into_store=True)
    assert choices["SAVE_COPY_HASH_WAY"].medians() and choices["SAVE_COPY_WAY"].medians()
    assert not choices["COPY_HASH_WAY"].medians() and not choices["COPY_WAY"].medians()


def test_the_default_parts_are_timed() -> None:
    """A load of values split at the engines' default size times its pieces: the choice is
    made on every such load, not only on values of some larger size."""
    assert DEFAULT_PART_BYTES >= MIN_TIMED_BYTES
    assert all(-(-DEFAULT_PART_BYTES // c) >= 2 for c in PIECES)  # two pieces or more


def test_a_sent_value_is_hashed_piece_by_piece_after_each_piece_is_handed_on() -> None:
    """``hashed_pieces`` (a Redis save's inline hashing) hands each piece on before hashing
    it, so the socket's copy is the first to read it from memory, and the digest is the whole
    value's once the pieces are consumed."""
    value = memoryview(np.arange(5 * base._HASH_PIECE // 2, dtype=np.uint8))
    hasher = xxhash.xxh3_64()
    seen = []
    for piece in base.hashed_pieces(value, hasher):
        seen.append(hasher.intdigest())  # the hash as it stands when the piece is handed on
        assert piece.nbytes <= base._HASH_PIECE
    assert seen[0] == xxhash.xxh3_64().intdigest()  # nothing hashed before the first send
    assert seen[1] == xxhash.xxh3_64(value[: base._HASH_PIECE]).intdigest()
    assert len(seen) == 3 and hasher.intdigest() == xxhash.xxh3_64_intdigest(value)


def native_or_skip() -> Callable[[memoryview, memoryview], int]:
    if _copy_ways.NATIVE_COPY_HASH is None:
        pytest.skip("the native copy-and-hash is not built here")
    return _copy_ways.NATIVE_COPY_HASH


def test_the_native_loop_is_built_and_a_candidate_where_a_compiler_is() -> None:
    """An install where a C compiler and Python's headers are (CI's, a developer's) builds the
    native loop; the process then times it against the pieces."""
    if sysconfig.get_config_var("CC") is None or shutil.which("gcc") is None:
        pytest.skip("no C compiler here: kvckpt installs without the native loop")
    assert _copy_ways.NATIVE_COPY_HASH is not None, (
        "kvckpt.engines._copy_hash is not built: reinstall with `pip install -e .`"
    )
    native = (NATIVE, NATIVE_STREAM, NATIVE_NO_PREFETCH, NATIVE_STREAM_NO_PREFETCH)
    assert (*native, *PIECES) == _copy_ways.CANDIDATES
    assert (MEMCPY, STREAM) == _copy_ways.COPY_CANDIDATES


@settings(max_examples=60, deadline=None)
@given(
    n=st.one_of(
        st.integers(0, 300),
        st.integers(900, 5000),
        st.sampled_from([1024 * k + d for k in (1, 8, 9, 64) for d in (-1, 0, 1, 64)]),
        st.integers(0, 3 << 20),
    ),
    offset=st.integers(0, 63),
    dest_offset=st.integers(0, 63),
    stream=st.booleans(),
    prefetch=st.booleans(),
)
def test_the_native_loop_copies_and_gives_xxh3_of_any_length_and_alignment(
    n: int, offset: int, dest_offset: int, stream: bool, prefetch: bool
) -> None:
    """With ordinary stores and with non-temporal ones, whose aligned middle and unaligned ends
    of each block take different paths; prefetching the source ahead or not."""
    native = native_or_skip()
    src = np.random.default_rng(n).integers(0, 256, n + 64, dtype=np.uint8)[offset : offset + n]
    dest = np.zeros(n + 64, dtype=np.uint8)[dest_offset : dest_offset + n]
    digest = native(memoryview(dest), memoryview(src), stream, prefetch)
    assert digest == xxhash.xxh3_64_intdigest(src)
    assert np.array_equal(dest, src)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3 << 20), offset=st.integers(0, 63), dest_offset=st.integers(0, 63))
def test_the_native_streaming_copy_copies_any_length_and_alignment(
    n: int, offset: int, dest_offset: int
) -> None:
    native_or_skip()
    stream_copy = _copy_ways.NATIVE_STREAM_COPY
    assert stream_copy is not None
    src = np.random.default_rng(n).integers(0, 256, n + 64, dtype=np.uint8)[offset : offset + n]
    out = np.zeros(n + 128, dtype=np.uint8)
    stream_copy(out[dest_offset : dest_offset + n].data, src.data)
    assert np.array_equal(out[dest_offset : dest_offset + n], src)
    assert not out[:dest_offset].any() and not out[dest_offset + n :].any()  # nothing beyond


def test_the_native_loop_refuses_buffers_it_cannot_fill() -> None:
    native = native_or_skip()
    src = memoryview(bytes(100))
    with pytest.raises(ValueError, match="destination holds 99 bytes, source 100"):
        native(memoryview(bytearray(99)), src)
    with pytest.raises(TypeError, match="read-write"):
        native(memoryview(bytes(100)), src)


def test_the_native_loop_refuses_overlapping_buffers() -> None:
    native = native_or_skip()
    buf = np.zeros(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        native(buf[10:60].data, buf[:50].data)
    stream_copy = _copy_ways.NATIVE_STREAM_COPY
    assert stream_copy is not None
    with pytest.raises(ValueError, match="stream_copy: the buffers overlap"):
        stream_copy(buf[10:60].data, buf[:50].data)
    with pytest.raises(ValueError, match="stream_copy: destination holds 99 bytes, source 100"):
        stream_copy(memoryview(bytearray(99)), memoryview(bytes(100)))
    assert native(buf[50:].data, buf[:50].data) == xxhash.xxh3_64_intdigest(bytes(50))


def test_the_native_loop_is_timed_with_the_pieces_and_other_hashers_wait_for_the_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fresh xxh3 hasher (the format's checksum) times every candidate, the native loop
    included; a hasher the loop cannot stand for is copied untimed, so the loop's turns are
    never lost and the choice is made."""
    native_or_skip()
    choice = TimedChoice((NATIVE, 1024 * KIB), samples=2, run=2, min_timed=1024 * KIB)
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", choice)
    src = np.random.default_rng(4).integers(0, 256, 2048 * KIB, dtype=np.uint8)
    other = xxhash.xxh3_64(seed=1)
    base.copy_and_hash(memoryview(np.empty_like(src)), memoryview(src), other)
    assert choice.medians() == {}  # not timed
    for _ in range(4):
        base.copy_and_hash(memoryview(np.empty_like(src)), memoryview(src), xxhash.xxh3_64())
    assert set(choice.medians()) == {NATIVE, 1024 * KIB} and choice.chosen is not None


def test_the_version_says_when_the_native_loop_is_not_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kvckpt.engines._copy_hash", None)  # import fails
    native, stream_copy, status = _copy_ways._load_native()
    assert native is None and stream_copy is None
    assert status.startswith("not built (no C compiler at install)")


def test_the_native_loop_runs_on_threads_at_once() -> None:
    native = native_or_skip()
    src = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    dests = [np.zeros_like(src) for _ in range(4)]
    digests: list[int] = []
    threads = [
        threading.Thread(target=lambda d=d: digests.append(native(memoryview(d), memoryview(src))))
        for d in dests
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert digests == [xxhash.xxh3_64_intdigest(src)] * 4
    assert all(np.array_equal(d, src) for d in dests)


@pytest.mark.parametrize(
    "make",
    [
        lambda: xxhash.xxh3_64(b"already fed"),  # not fresh: the digest covers both
        lambda: xxhash.xxh3_64(seed=7),  # another seed
        lambda: xxhash.xxh64(),  # another hash
    ],
)
def test_copy_and_hash_falls_back_to_pieces_for_a_hasher_the_native_loop_cannot_stand_for(
    make: Callable[[], base.Hasher], monkeypatch: pytest.MonkeyPatch
) -> None:
    choice = TimedChoice((NATIVE,))
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", choice)
    src = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
    dest = np.zeros_like(src)
    expected = make()
    expected.update(memoryview(src))
    assert base.copy_and_hash(memoryview(dest), memoryview(src), make()) == expected.intdigest()
    assert np.array_equal(dest, src)


@pytest.mark.parametrize("way", list(NATIVE_WAYS))
def test_copy_and_hash_uses_the_native_loop_once_chosen(
    way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each way of the loop runs it with its own stores and prefetch."""
    native_or_skip()
    calls = []
    real = _copy_ways.NATIVE_COPY_HASH
    assert real is not None

    def counted(
        dest: memoryview, src: memoryview, stream: bool = False, prefetch: bool = True
    ) -> int:
        calls.append((src.nbytes, stream, prefetch))
        return real(dest, src, stream, prefetch)

    monkeypatch.setattr(_copy_ways, "NATIVE_COPY_HASH", counted)
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", TimedChoice((way,)))
    src = np.random.default_rng(3).integers(0, 256, 5 << 20, dtype=np.uint8)
    dest = np.zeros_like(src)
    digest = base.copy_and_hash(memoryview(dest), memoryview(src), xxhash.xxh3_64())
    assert digest == xxhash.xxh3_64_intdigest(src)
    assert calls == [(5 << 20, *NATIVE_WAYS[way])]
    assert np.array_equal(dest, src)


def test_the_native_loop_is_timed_beside_the_pieces_and_can_be_turned_off() -> None:
    """``KVCKPT_NATIVE_COPY_HASH=0`` leaves only the pieces to choose from, and
    ``kvckpt --version`` says so."""
    code = (
        "from kvckpt.engines import _copy_ways as c;"
        "print(c.NATIVE_COPY_HASH is None, c.NATIVE_STREAM_COPY is None, c.CANDIDATES,"
        " c.COPY_CANDIDATES)"
    )
    env = {**os.environ, "KVCKPT_NATIVE_COPY_HASH": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"True True {PIECES} ('memcpy',)"
    version = subprocess.run(
        [sys.executable, "-m", "kvckpt", "--version"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "native copy-and-hash: turned off (KVCKPT_NATIVE_COPY_HASH=0)" in version


def test_the_version_says_whether_the_native_loop_is_used() -> None:
    native_or_skip()
    result = run("--version")
    assert result.returncode == 0
    assert "native copy-and-hash: built (" in result.stdout


@pytest.mark.parametrize("size", [STREAM_MIN_BYTES - 1, 5 << 20])
def test_the_streaming_way_writes_large_values_with_non_temporal_stores_and_small_ones_not(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``native-stream`` and ``stream`` stream only values of ``STREAM_MIN_BYTES`` or more:
    a smaller value fits the cache, where its next reader finds it."""
    native_or_skip()
    real_hash, real_copy = _copy_ways.NATIVE_COPY_HASH, _copy_ways.NATIVE_STREAM_COPY
    assert real_hash is not None and real_copy is not None
    streamed: list[bool] = []

    def counted_hash(
        dest: memoryview, src: memoryview, stream: bool = False, prefetch: bool = True
    ) -> int:
        streamed.append(stream)
        return real_hash(dest, src, stream, prefetch)

    def counted_copy(dest: memoryview, src: memoryview) -> None:
        streamed.append(True)
        real_copy(dest, src)

    monkeypatch.setattr(_copy_ways, "NATIVE_COPY_HASH", counted_hash)
    monkeypatch.setattr(_copy_ways, "NATIVE_STREAM_COPY", counted_copy)
    monkeypatch.setattr(_copy_ways, "COPY_HASH_WAY", TimedChoice((NATIVE_STREAM,)))
    monkeypatch.setattr(_copy_ways, "COPY_WAY", TimedChoice((STREAM,)))
    src = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    dest = np.zeros_like(src)
    assert base.copy_and_hash(memoryview(dest), memoryview(src), xxhash.xxh3_64()) == (
        xxhash.xxh3_64_intdigest(src)
    )
    assert np.array_equal(dest, src)
    dest[:] = 0
    base.copy_into(memoryview(dest), memoryview(src))
    assert np.array_equal(dest, src)
    large = size >= STREAM_MIN_BYTES
    assert streamed == ([True, True] if large else [False])


def test_unverified_copies_time_numpy_against_the_streaming_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native_or_skip()
    choice = TimedChoice((MEMCPY, STREAM), samples=2, run=2, default=MEMCPY, min_timed=1 << 20)
    monkeypatch.setattr(_copy_ways, "COPY_WAY", choice)
    src = np.random.default_rng(6).integers(0, 256, 2 << 20, dtype=np.uint8)
    for _ in range(4):
        dest = np.zeros_like(src)
        base.copy_into(memoryview(dest), memoryview(src))
        assert np.array_equal(dest, src)
    assert set(choice.medians()) == {MEMCPY, STREAM} and choice.chosen in (MEMCPY, STREAM)
