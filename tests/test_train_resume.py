"""examples/train_resume.py under torchrun: SIGKILL one rank mid-run, let torchrun restart the
job, and check it resumes from the latest checkpoint with losses bit-identical to a run that
was never interrupted (including the steps it computes twice)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvckpt.testing import torchrun_command

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_resume.py"
STEPS, EVERY, KILL_AT = 12, 3, 8


def run(events: Path, *store_args: str, kill: bool) -> list[dict]:
    cmd = torchrun_command(
        EXAMPLE,
        *store_args,
        "--steps",
        str(STEPS),
        "--every",
        str(EVERY),
        "--events",
        str(events),
        max_restarts=1,
    )
    if kill:
        cmd += ["--kill-at-step", str(KILL_AT), "--kill-rank", "1"]
    done = subprocess.run(
        cmd,
        cwd=events.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    # kept beside the events: a job that restarted and finished shows here why it restarted
    (events.parent / "torchrun.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in events.read_text().splitlines()]


def losses(events: list[dict]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in events:
        if e["event"] == "loss":
            out.setdefault(e["step"], set()).add(e["loss"])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, set[str]]:
    tmp = tmp_path_factory.mktemp("reference")
    events = run(tmp / "events.jsonl", "--store", f"lmdb://{tmp / 'store'}", kill=False)
    assert not any(e["event"] == "resume" for e in events)
    return losses(events)


@pytest.mark.parametrize(
    "kind",
    ["lmdb", "redis", "tiered, local store lost", "tiered, local store lost, no prefetch"],
)
def test_kill_one_rank_and_resume_bit_exact(
    kind: str, reference: dict[int, set[str]], tmp_path: Path, redis_url: str
) -> None:
    local = tmp_path / "local"
    if kind == "lmdb":
        args = ["--store", f"lmdb://{local}"]
    elif kind == "redis":
        args = ["--store", redis_url]
    else:  # the restarted job runs on a "new node": its local store is gone
        args = ["--store", f"lmdb://{local}", "--store", redis_url, "--wipe-on-restart", str(local)]
        if kind.endswith("no prefetch"):
            args.append("--no-prefetch")
        else:  # this machine's cores all have a rank: by itself, prefetch() would not copy
            args.append("--force-prefetch")
    events = run(tmp_path / "events.jsonl", *args, kill=True)

    resumes = [e for e in events if e["event"] == "resume"]
    output = (tmp_path / "torchrun.log").read_text()
    assert len(resumes) == 1 and resumes[0]["attempt"] == 1, output[-6000:]
    assert resumes[0]["checkpoint"] in {f"step-{s}" for s in range(EVERY, KILL_AT + 1, EVERY)}
    # Tiers.prefetch() brought the newest checkpoint from Redis into the new node's local store
    # while the job started; without it, the restore reads Redis.
    assert resumes[0]["tier"] == (1 if kind.endswith("no prefetch") else 0)
    assert any(e["event"] == "done" and e["step"] == STEPS for e in events)

    # Every step's loss, before the kill, after it, and recomputed in between, is the same
    # float as in the uninterrupted run.
    got = losses(events)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert values == reference[step], f"step {step}: {values} != {reference[step]}"
