"""Every save, copy, prefetch and restore reports its phases: through ``kvckpt.events``
subscribers, Python logging, and Prometheus metrics served over real HTTP."""

from __future__ import annotations

import logging
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, Tiers, events

MIB = 1 << 20


def state(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((MIB // 4,), value), "b": torch.full((1024,), value)}


NBYTES = MIB + 4096


@pytest.fixture
def seen() -> list[events.Event]:
    got: list[events.Event] = []
    stop = events.subscribe(got.append)
    yield got
    stop()


def phases(got: list[events.Event]) -> list[tuple[str, str, int | None]]:
    return [(e.operation, e.phase, e.tier) for e in got]


def test_a_save_and_a_load_report_their_phases(
    lmdb_url: str, seen: list[events.Event], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="kvckpt.events"):
        dcp.save(state(), storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="s")
        out = {k: torch.zeros_like(v) for k, v in state().items()}
        dcp.load(out, storage_reader=KVStorageReader(lmdb_url), checkpoint_id="s")
    assert phases(seen) == [
        ("save", "plan", None),
        ("save", "write", None),
        ("save", "commit", None),
        ("restore", "read", None),
    ]
    write, commit, read = seen[1], seen[2], seen[3]
    assert write.nbytes == commit.nbytes == read.nbytes == NBYTES
    assert all(e.checkpoint_id == "s" and e.store.startswith("lmdb://") for e in seen)
    assert all(e.seconds >= 0 for e in seen) and write.rank == 0
    logged = [r.kvckpt_event for r in caplog.records if hasattr(r, "kvckpt_event")]
    assert [(d["operation"], d["phase"]) for d in logged] == [(o, p) for o, p, _ in phases(seen)]
    assert logged[1]["nbytes"] == NBYTES


def test_tiers_report_copies_to_each_tier_prefetch_and_restore(
    tmp_path: Path, redis_url: str, seen: list[events.Event]
) -> None:
    tiers = Tiers([f"lmdb://{tmp_path / 'node'}", redis_url])
    dcp.save(state(), storage_writer=tiers.writer(), checkpoint_id="step-1")
    tiers.wait()
    got = sorted(phases(seen), key=str)
    assert got == sorted(
        [
            ("save", "plan", 0),
            ("save", "write", 0),
            ("save", "commit", 0),
            ("copy", "write", 1),
            ("copy", "commit", 1),
        ],
        key=str,
    )
    copied = [e for e in seen if e.operation == "copy"]
    assert all(e.nbytes == NBYTES and e.store.startswith("redis://") for e in copied)
    tiers.close()
    seen.clear()
    # A replaced node: its local store is empty; prefetch brings the checkpoint from Redis.
    node = Tiers([f"lmdb://{tmp_path / 'new-node'}", redis_url])
    future = node.prefetch(force=True)
    assert future is not None
    future.result()
    out = {k: torch.zeros_like(v) for k, v in state().items()}
    assert node.restore(out) is not None
    assert phases(seen)[0] == ("prefetch", "copy", 1) and seen[0].nbytes == NBYTES
    assert ("restore", "choose", 0) in phases(seen)
    (read,) = [e for e in seen if e.phase == "read"]
    assert read.nbytes == NBYTES and read.checkpoint_id == "step-1"
    node.close()


def test_a_failing_subscriber_never_fails_a_save(
    lmdb_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: events.Event) -> None:
        raise RuntimeError("subscriber bug")

    stop = events.subscribe(broken)
    try:
        dcp.save(state(), storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="s")
    finally:
        stop()
    assert "subscriber bug" in caplog.text
    assert KVStorageReader(lmdb_url, checkpoint_id="s").read_record().total_bytes == NBYTES


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_prometheus_metrics_are_served_during_and_after_a_real_save(
    tmp_path: Path, redis_url: str
) -> None:
    from kvckpt import metrics

    served = metrics.serve(0, addr="127.0.0.1")
    scrapes: list[str] = []
    stop = threading.Event()

    def keep_scraping() -> None:
        while not stop.is_set():
            scrapes.append(scrape(served.port))

    scraper = threading.Thread(target=keep_scraping, daemon=True)
    scraper.start()
    try:
        tiers = Tiers([f"lmdb://{tmp_path / 'node'}", redis_url])
        for step in (1, 2):
            dcp.save(
                state(float(step)), storage_writer=tiers.writer(), checkpoint_id=f"step-{step}"
            )
        tiers.close()
        stop.set()
        scraper.join()
        text = scrape(served.port)
    finally:
        stop.set()
        served.close()
    assert len(scrapes) > 1  # the endpoint answered while the saves ran
    values = samples(text)
    write = ("save", "write", "0")
    assert values["kvckpt_phase_seconds_count", write] == 2
    assert values["kvckpt_phase_bytes_total", write] == 2 * NBYTES
    copy = ("copy", "commit", "1")
    assert values["kvckpt_phase_bytes_total", copy] == 2 * NBYTES
    assert values["kvckpt_last_end_timestamp_seconds", copy] > 0


def samples(text: str) -> dict[tuple[str, tuple[str, str, str]], float]:
    """Each sample of a scrape by (name, (operation, phase, tier)), parsed as Prometheus does."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, (s.labels["operation"], s.labels["phase"], s.labels["tier"])): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "operation" in s.labels
    }
