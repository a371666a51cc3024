"""The copy-and-hash piece size: chosen by timing the process's own verified values."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from kvckpt.engines import base
from kvckpt.engines._piece_choice import CANDIDATES, DEFAULT, MIN_TIMED_BYTES, PieceChoice
from kvckpt.engines.base import DEFAULT_PART_BYTES

KIB = 1024


def test_candidates_take_turns_until_each_is_timed_then_the_fastest_median_stays() -> None:
    choice = PieceChoice((256 * KIB, 512 * KIB, 1024 * KIB), samples=3, min_timed=4096)
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
    assert choice.piece() == 512 * KIB
    assert choice.trial(8192) is None  # chosen: nothing more is timed
    assert set(choice.medians()) == set(cost)


def test_small_values_are_not_timed_and_use_the_default() -> None:
    choice = PieceChoice((256 * KIB, 512 * KIB), samples=1, default=384 * KIB, min_timed=4096)
    assert choice.trial(4095) is None
    assert choice.piece() == 384 * KIB
    assert choice.chosen is None


def test_one_candidate_is_chosen_from_the_start_and_bad_settings_are_refused() -> None:
    assert PieceChoice((64 * KIB,)).chosen == 64 * KIB
    with pytest.raises(ValueError, match="candidate"):
        PieceChoice(())
    with pytest.raises(ValueError, match="sample"):
        PieceChoice((64 * KIB,), samples=0)


def test_records_after_the_choice_change_nothing() -> None:
    choice = PieceChoice((1 * KIB, 2 * KIB), samples=1, min_timed=1)
    choice.record(1 * KIB, 10, 1.0)
    choice.record(2 * KIB, 10, 2.0)
    assert choice.chosen == 1 * KIB
    choice.record(2 * KIB, 10, 0.0)
    assert choice.chosen == 1 * KIB


def test_threads_timing_at_once_agree_on_one_choice() -> None:
    choice = PieceChoice((1 * KIB, 2 * KIB, 4 * KIB), samples=50, min_timed=1)

    def work() -> None:
        while (size := choice.trial(100)) is not None:
            choice.record(size, 100, float(size))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert choice.chosen == 1 * KIB


@pytest.mark.parametrize("piece", [*CANDIDATES, DEFAULT, 3000])
def test_copy_and_hash_gives_the_same_bytes_and_digest_with_every_piece_size(
    piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base, "COPY_HASH_PIECE", PieceChoice((piece,)))
    src = np.random.default_rng(0).integers(0, 256, 5 * 1024 * KIB + 123, dtype=np.uint8)
    dest = np.zeros_like(src)
    digest = base.copy_and_hash(memoryview(dest), memoryview(src), xxhash.xxh3_64())
    assert digest == xxhash.xxh3_64_intdigest(src.tobytes())
    assert np.array_equal(dest, src)


def test_copy_and_hash_times_values_for_the_process_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = PieceChoice((256 * KIB, 512 * KIB), samples=2, min_timed=1024 * KIB)
    monkeypatch.setattr(base, "COPY_HASH_PIECE", choice)
    src = np.ones(1024 * KIB, dtype=np.uint8)
    for _ in range(4):
        base.copy_and_hash(memoryview(np.empty_like(src)), memoryview(src), xxhash.xxh3_64())
    assert choice.chosen in (256 * KIB, 512 * KIB)
    assert set(choice.medians()) == {256 * KIB, 512 * KIB}  # both timed, twice each


def test_the_default_parts_are_timed() -> None:
    """A load of values split at the engines' default size times its pieces: the choice is
    made on every such load, not only on values of some larger size."""
    assert DEFAULT_PART_BYTES >= MIN_TIMED_BYTES
    assert all(-(-DEFAULT_PART_BYTES // c) >= 2 for c in CANDIDATES)  # two pieces or more


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
