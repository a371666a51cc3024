"""The benchmark runs end to end at a tiny size (no timing is asserted anywhere in the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_smoke_run(tmp_path) -> None:
    out = tmp_path / "results"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/run.py",
            "--size-mib",
            "4",
            "--repeats",
            "1",
            "--small-tensors",
            "50",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    for case in (
        "dcp_fs_shm_save_t1",
        "raw_redis_get_into",
        "kv_lmdb_save_steady",
        "kv_lmdb_load",
        "kv_redis_save",
        "kv_redis_load",
        "small_kv_lmdb",
        "async_block_kv_lmdb",
    ):
        assert data[case]["gbps"] > 0, case
    assert {r["metric"] for r in data["ratios"]} >= {"LMDB load / DCP FileSystemReader shm"}
    assert (out / "results.md").read_text().startswith("| metric |")
    assert (out / "results.png").stat().st_size > 1000
