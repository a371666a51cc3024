"""The benchmark runs end to end at a tiny size (no timing is asserted anywhere in the tests)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_benchmark(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``benchmarks/<script>`` with this interpreter, from the repository root."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_benchmark_smoke_run(tmp_path, monkeypatch) -> None:
    out = tmp_path / "results"
    result = run_benchmark(
        "run.py",
        *("--size-mib", "4", "--repeats", "1", "--small-tensors", "50", "--smoke"),
        *("--out", str(out)),
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
        "kv_redis_save_steady",
        "dcp_fs_shm_save_t1_turns",
        "dcp_fs_shm_save_t2_turns",
        "kv_lmdb_save_first",
        "dcp_fs_shm_save_t1_keep1",
        "kv_redis_load",
        "small_kv_lmdb",
        "async_block_kv_lmdb",
        "async_block_kv_lmdb_cached",
        "async_block_dcp_fs_shm_cached",
        "store_mode_default_later",
        "store_mode_nt_raw_put",
        "store_mode_default_memcpy",
        "store_mode_nt_memcpy",
        "checksum_from_cache",
        "checksum_from_memory",
        "kv_redis_save_huge_pages",
        "kv_lmdb_save_steady_big_parts",
    ):
        assert data[case]["gbps"] > 0, case
    metrics = {r["metric"] for r in data["ratios"]}
    assert metrics >= set(targets(monkeypatch).TARGETS)  # every target row measured
    assert any("on huge pages / DCP FS shm t=1" in m for m in metrics)
    assert {r["better"] for r in data["ratios"]} == {"higher", "lower"}
    assert data["cpu"]
    report = (out / "results.md").read_text()
    assert report.startswith(f"- CPU: {data['cpu']}")
    assert data["part_bytes_lmdb"] > 0 and f"pieces ({data['part_bytes_lmdb']} bytes)" in report
    assert data["commit"] and f"at kvckpt commit {data['commit']}" in report
    assert "- memcpy, one thread" in report and " GB/s with glibc's default" in report
    assert "copy-and-hash, chosen by timing" in report
    assert "- the checksum (xxh3), one thread, from the CPU's cache: " in report
    assert ", from memory: " in report and "neither reads the piece from the cache" in report
    assert "adds at least" in report and "a load's two threads, sharing" in report
    assert "| metric | better | measured | target | pass | note |" in report
    assert (out / "results.png").stat().st_size > 1000


def targets(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/targets.py, imported as run.py imports it."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import targets

    return targets


def fabricated_results() -> dict:
    """A run's results with every case at 1 GB/s and 1 s (every ratio 1, every checksum cost
    0, no memory above the state dict); nothing measured."""
    case = {"median_s": 1.0, "gbps": 1.0, "runs_s": [1.0, 1.0, 1.0]}
    results = collections.defaultdict(lambda: dict(case))
    results.update(
        state_dict_bytes=1 << 30,
        part_bytes_redis=4 << 20,
        largest_tensor_bytes=128 << 20,
        rss_delta_bytes={
            k: 0
            for k in (
                "kv_lmdb_save",
                "kv_redis_save",
                "kv_lmdb_load",
                "kv_redis_load",
                "kv_safetensors_export",
            )
        },
    )
    return results


def test_check_names_every_target_not_met(monkeypatch) -> None:
    """run.py --check's logic, on fabricated results: each row short of its target is named
    with what it measured and the target, and only those; a target row not measured too."""
    t = targets(monkeypatch)
    results = fabricated_results()
    # every checksum pair timed (a pair gets its row only where a run timed it): reading a
    # case from the defaultdict puts it in the results
    for _, plain, summed in t.CHECKSUM_PAIRS:
        results[plain], results[summed] = results[plain], results[summed]
    rows = t.rows(results)
    assert set(t.TARGETS) <= {row.metric for row in rows}  # no target names a missing row
    steady = "LMDB save steady / DCP FS shm t=2, taking turns (speed-up)"
    first = "LMDB save first, new store / DCP FS shm t=2, taking turns (speed-up)"
    load = "LMDB load / DCP FileSystemReader shm (speed-up)"
    # every ratio 1: the speed-ups held to more than 1 fall short, the rest pass
    assert [line.split(":")[0] for line in t.failures(rows)] == [load, steady, first]
    results["kv_lmdb_load"] = {"median_s": 0.1, "gbps": 10.0, "runs_s": [1.0] * 3}  # 10x: met
    results["kv_lmdb_save_steady"] = {"median_s": 0.5, "gbps": 2.9, "runs_s": [0.5] * 3}  # 2.9x
    results["kv_redis_load"] = {"median_s": 1.2, "gbps": 0.8, "runs_s": [1.1, 1.2, 1.3]}
    results["async_block_kv_redis"] = {"median_s": 1.01, "gbps": 1.0, "runs_s": [1.01] * 3}
    results["rss_delta_bytes"]["kv_redis_load"] = 5 << 20  # over one 4 MiB part
    missed = t.failures(t.rows(results))
    assert missed == [
        "checksum cost, Redis load (extra time, fraction): measured 0.200, target <= 0.1",
        "async_save blocking: Redis / DCP default stager (time ratio): measured 1.010, target <= 1",
        f"{steady}: measured 2.900, target >= 3",
        f"{first}: measured 1.000, target >= 1.3",
        "peak anon RSS, Redis load / 1 part: measured 1.250, target <= 1",
    ]
    rows = [row for row in t.rows(results) if not row.metric.startswith("peak anon RSS")]
    assert "peak anon RSS, LMDB save / (10% of the state dict + 1 part): not measured" in "\n".join(
        t.failures(rows)
    )


def test_check_exits_1_naming_the_rows(tmp_path) -> None:
    """python benchmarks/run.py --from-json RESULTS --check: no benchmark runs; exit 1 and
    each target row not met on stdout, the report written with a target and a pass column."""
    published_run = Path(ROOT) / "docs/benchmark/intel-xeon-2026-11-27/results.json"
    published = json.loads(published_run.read_text())
    published["kv_redis_save"]["gbps"] = 0.5 * published["raw_redis_set"]["gbps"]
    (tmp_path / "in.json").write_text(json.dumps(published))
    out = tmp_path / "out"
    result = run_benchmark(
        "run.py",
        "--from-json",
        str(tmp_path / "in.json"),
        "--check",
        "--no-chart",
        "--out",
        str(out),
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    missed = [line for line in result.stdout.splitlines() if line.startswith("target not met: ")]
    assert (
        "target not met: Redis save / raw-socket SET (speed-up): measured 0.500, target >= 0.8"
        in missed
    )
    assert not any("LMDB load" in line for line in missed)  # 5.53x: met
    report = (out / "results.md").read_text()
    assert "| Redis save / raw-socket SET (speed-up) | higher | 0.500 | >= 0.8 | no |" in report
    assert (
        "| LMDB load / DCP FileSystemReader shm (speed-up) | higher | 5.53 | >= 5 | yes |" in report
    )
    assert report.startswith("- CPU: Intel Xeon")
    ok = run_benchmark(
        "run.py", "--from-json", str(out / "results.json"), "--no-chart", "--out", str(out)
    )
    assert ok.returncode == 0  # without --check, a report only


def test_job_benchmark_smoke_run(tmp_path) -> None:
    """benchmarks/job.py: every system saves into a new store with retention, taking turns."""
    out = tmp_path / "job"
    result = run_benchmark(
        "job.py",
        *(
            "--size-mib",
            "8",
            "--saves",
            "3",
            "--gap",
            "0",
            "--first-rounds",
            "1",
            "--out",
            str(out),
        ),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((out / "job.json").read_text())
    assert [sc["keep_last"] for sc in data["scenarios"]] == [2, 1]
    for scenario in data["scenarios"]:
        assert set(scenario["systems"]) == {
            "kvckpt LMDB",
            "kvckpt Redis",
            "kvckpt Tiers",
            "raw-socket SET",
            "DCP t=1",
            "DCP t=2",
        }
        assert all(len(r["times_s"]) == 3 for r in scenario["systems"].values())
    assert "LMDB p90 vs DCP t=2 p90" in (out / "job.md").read_text()


def test_redis_ceiling_smoke_run() -> None:
    result = run_benchmark(
        "redis_ceiling.py",
        *("--size-mib", "4", "--part-mib", "1", "--repeats", "1"),
        *("--io-threads", "1", "2", "--connections", "1", "2"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 8  # header + io-threads x connections x read-ahead (16, all)


def test_redis_ceiling_ranks_smoke_run() -> None:
    result = run_benchmark(
        "redis_ceiling.py",
        *("--ranks", "2", "--size-mib", "4", "--part-mib", "1", "--repeats", "1"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 4  # header + (1 rank, 2 ranks) x (touched, fresh)


def test_many_items_smoke_run(tmp_path) -> None:
    out = tmp_path / "results"
    result = run_benchmark(
        "many_items.py", *("--items", "300,600", "--repeats", "2", "--out", str(out))
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    doc = json.loads((out / "many_items.json").read_text())
    assert set(doc["results"]) == {"300", "600"}
    for cases in doc["results"].values():
        assert len(cases) == 3 and all(len(c["total"]) == 2 for c in cases.values())
    assert "decode / DCP unpickle" in (out / "many_items.md").read_text()


def test_first_load_smoke_run(tmp_path) -> None:
    out = tmp_path / "results"
    result = run_benchmark(
        "first_load.py", *("--size-mib", "4", "--rounds", "2", "--out", str(out))
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    doc = json.loads((out / "first_load.json").read_text())
    assert set(doc["results"]) == {"kvckpt LMDB, /dev/shm", "DCP FileSystemReader, /dev/shm"}
    assert all(len(c["first"]) == len(c["second"]) == 2 for c in doc["results"].values())
    assert "first load in a new process" in (out / "first_load.md").read_text()


def test_gpu_benchmark_without_a_gpu_says_so() -> None:
    import torch

    result = run_benchmark("gpu.py", "--size-mib", "4", "--repeats", "1")
    if torch.cuda.is_available():
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr


@pytest.mark.timeout(600)  # about ten short 2-rank training jobs on two cores
def test_goodput_smoke_run(tmp_path) -> None:
    """benchmarks/goodput.py end to end with a tiny state: the interval estimated and
    measured, time to first step, a run with one SIGKILL, the relaunch of a job that never
    checkpoints, all reported (no timing asserted). One economy and one system: the accel
    economy, whose runs take the paths of the cpu one but for the model trained
    (``test_every_economy_trains_with_arguments_the_example_takes``), and Tiers with peers,
    which takes the paths of every other kvckpt system (a node-local LMDB store, Redis, the
    peers' copies). Every run here is a 2-rank job of its own."""
    out = tmp_path / "results"
    result = run_benchmark(
        "goodput.py",
        *("--economy", "accel", "--accel-state-gib", "0.02", "--accel-step-seconds", "0.05"),
        *("--steps", "400", "--kills", "4"),
        *("--calibrate-saves", "1", "--calibrate-warmup", "1", "--calibrate-every", "3"),
        *("--verify-steps", "6", "--repeats", "1", "--systems", "tiers-peers"),
        *("--max-busy", "1", "--out", str(out)),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((out / "goodput.json").read_text())
    assert set(data["economies"]) == {"accel"}
    economy = data["economies"]["accel"]
    assert set(economy["failures"]) == {"tiers-peers"}
    chosen = economy["calibration"]["tiers-peers"]  # the interval measured before failures
    assert 1 <= len(chosen["verified"]) <= 3  # more only below half the limit
    assert economy["failures"]["tiers-peers"]["interval"] == chosen["interval"]
    assert chosen["in_flight_seconds"] > 0
    (failure,) = economy["failures"]["tiers-peers"]["failures"]
    assert failure["lost"] == pytest.approx(
        failure["relaunch"] + failure["restore"] + failure["recompute"]
    )
    (alone,) = economy["relaunch_alone"]["failures"]
    assert alone["relaunch"] > 0
    report = (out / "goodput.md").read_text()
    assert report.startswith("| system | accel: interval")
    assert "**accel (simulated)" in report
    assert (out / "goodput.png").stat().st_size > 1000


def test_every_economy_trains_with_arguments_the_example_takes(monkeypatch) -> None:
    """Each economy of benchmarks/goodput.py, at its defaults, as ``examples/train_resume.py``
    parses its arguments: what the smoke run above leaves to the accel economy alone."""
    goodput = _goodput_module(monkeypatch)
    from examples import train_resume

    found = goodput.economies(goodput.parser().parse_args([]))
    assert set(found) == {"accel", "cpu", "cuda"}
    for name, economy in found.items():
        # an argument the example does not take ends the parse (SystemExit)
        parsed = train_resume.parser().parse_args(
            [*economy.train_args, "--store", "lmdb:///dev/shm/x"]
        )
        assert parsed.economy == name, (name, economy.train_args)  # what trains
        assert economy.label.startswith(name), economy.label


def test_compare_smoke_run(tmp_path) -> None:
    """benchmarks/compare.py: two checkouts (here the same one twice) taking turns."""
    out = tmp_path / "results"
    result = run_benchmark(
        "compare.py",
        *("--old", ROOT, "--new", ROOT, "--rounds", "2", "--repeats", "1"),
        *("--small-tensors", "20", "--big-mib", "4", "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((out / "compare.json").read_text())
    assert set(data["times"]["old"]) == {
        f"{store}/{case}"
        for store in ("lmdb", "redis")
        for case in ("small_save", "small_load", "big_save", "big_load")
    }
    assert all(len(v) == 2 for v in data["times"]["new"].values())
    assert (out / "compare.md").read_text().startswith("| case |")


def _goodput_module(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/goodput.py, imported as a script's module."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its `report` import
    spec = importlib.util.spec_from_file_location(
        "goodput", os.path.join(ROOT, "benchmarks", "goodput.py")
    )
    goodput = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "goodput", goodput)  # its dataclasses look it up
    spec.loader.exec_module(goodput)
    return goodput


def test_goodput_interval_search(monkeypatch) -> None:
    """verify()'s search: up in proportion while above the limit, down while well under it (by
    half at most), done when the passing and failing intervals are within 10% or adjacent."""
    goodput = _goodput_module(monkeypatch)

    def search(measured: list[tuple[int, float]]) -> list[int | None]:
        tries: list[dict] = []
        out = []
        for interval, overhead in measured:
            tries.append({"interval": interval, "overhead": overhead})
            out.append(goodput.next_interval(tries, 0.05))
        return out

    assert search([(25, 0.071), (36, 0.053), (39, 0.043)]) == [36, 39, None]
    assert search([(6, 0.023), (3, 0.06), (4, 0.04)]) == [3, 4, None]
    assert search([(14, -0.034), (7, 0.01)]) == [7, 4]  # down by half at most
    assert search([(12, 0.049)]) == [None]  # 11 is within 10% of 12
    assert search([(1, -0.01)]) == [None]
    tries = [{"interval": 10, "overhead": 0.2}]
    assert goodput.next_interval(tries, 0.05, searching=False) == 40

    # A Tiers check's window starts once the shared tier holds keep_last + 1 copies.
    ev = [{"event": "loss", "step": s, "t": float(s)} for s in range(1, 41)]
    ev += [
        {"event": "copied", "step": s, "t": t, "tier": 1}
        for s, t in ((3, 13.5), (15, 23.2), (24, 26.0))
    ]
    ev += [{"event": "copied", "step": 2, "t": 2.5, "tier": "peers"}]  # not the shared tier's
    copied = goodput.copies(ev, "tiers")
    assert [e["step"] for e in copied] == [3, 15, 24]
    assert [e["step"] for e in goodput.copies(ev, "tiers-peers")] == [2]
    assert goodput.steady_start(copied, ev, 15, 1, 24, keep_last=1) == 24
    assert goodput.steady_start(copied, ev, 15, 4, 24, keep_last=1) == 24
    assert goodput.steady_start(copied, ev, 15, 1, 20, keep_last=1) == 20  # the window must fit
    assert goodput.steady_start(copied, ev, 15, 1, 24, keep_last=3) == 15  # not yet: nominal


def test_restore_scale_smoke_run(tmp_path) -> None:
    """benchmarks/restore_scale.py at its smallest: 2 hosts, a tiny DDP state, a plain restart
    and one replaced host, each with its Redis-only baseline; bit-exact, and the shared tier
    serves the replaced host's share only."""
    out = tmp_path / "results"
    result = run_benchmark(
        "restore_scale.py",
        *("--hosts", "2", "--mib", "1", "--kinds", "ddp", "--cases", "plain,one-replaced"),
        *("--probe-mib", "1", "--peers", "1", "--peer-hosts", "3"),
        *("--root", str(tmp_path), "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    data = json.loads((out / "restore_scale.json").read_text())
    state = data["state_bytes"]
    plain, one = data["cases"]["ddp/2/plain"], data["cases"]["ddp/2/one-replaced"]
    for case in (plain, one):
        assert case["ranks"] == 2
        assert case["tiered"]["exact"] and case["baseline"]["exact"]
        assert case["baseline"]["served"] >= 2 * state  # every rank reads all of it from Redis
    assert plain["tiered"]["shared_total"] == 0 and plain["tiered"]["peers_total"] > 0
    assert one["tiered"]["shared_total"] == state / 2  # host 1's share of the replicated items
    assert data["costs"][0]["exchange_gbps"] > 0
    assert (out / "restore_scale.md").read_text().startswith("| hosts | state | case |")
    # With peers=1 on 3 hosts: one replaced host restores the newest save with nothing from
    # the shared tier; two (neighbours) restore the older one, which Redis and the survivors
    # hold whole between them
    peers = data["peer_cases"]
    for name in ("plain", "one-replaced"):
        case = peers[f"ddp/3/1/{name}"]["tiered"]
        assert case["exact"] and case["restored"] == ["ddp-3hosts-peers1"], name
        assert case["shared_total"] == 0, name
    two = peers["ddp/3/1/two-replaced"]
    assert two["tiered"]["restored"] == ["ddp-3hosts-peers1-older"] and two["tiered"]["exact"]
    newest = two["saves"]["ddp-3hosts-peers1"]
    assert newest["into_shared"] < 4096 and newest["to_peers"] == state


def test_peer_memory_smoke_run(tmp_path) -> None:
    """benchmarks/peer_memory.py at its smallest: 2 hosts, a budget smaller than a host's share;
    the copy and the restore's exchange hold at most the budget and one item, bit-exact."""
    out = tmp_path / "results"
    result = run_benchmark(
        "peer_memory.py",
        *("--hosts", "2", "--mib", "4", "--kinds", "fsdp", "--budgets-mib", "0.25"),
        *("--root", str(tmp_path), "--out", str(out)),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    case = json.loads((out / "peer_memory.json").read_text())["cases"]["fsdp/262144"]
    assert case["exact"]
    for phase in ("copy", "restore"):
        assert 0 < case[phase]["exact"] <= case["target"], phase


def test_hosts_table_in_performance_md_is_the_published_runs() -> None:
    """docs/PERFORMANCE.md's table of every host measured is benchmarks/hosts.py's output for
    the directories its command names: the table is never typed by hand, and every run it
    lists is published."""
    page = (Path(ROOT) / "docs/PERFORMANCE.md").read_text()
    command = next(
        line for line in page.splitlines() if line.startswith("python benchmarks/hosts.py docs/")
    )
    result = run_benchmark("hosts.py", *command.split()[2:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() in page
    assert result.stdout.count("\n| ") == len(command.split()[2:])  # a row for each


def test_summary_of_each_vm_kind_in_performance_md_is_hosts_output() -> None:
    """The summary at the top of docs/PERFORMANCE.md is ``hosts.py --summary``'s output for the
    runs its command names, one row each, every one a published run listed in the full table,
    and one per CPU."""
    page = (Path(ROOT) / "docs/PERFORMANCE.md").read_text()
    lines = page.splitlines()
    command = next(line for line in lines if line.startswith("python benchmarks/hosts.py --"))
    full = next(line for line in lines if line.startswith("python benchmarks/hosts.py docs/"))
    runs = command.split()[3:]
    assert command.split()[2] == "--summary" and set(runs) <= set(full.split()[2:])
    result = run_benchmark("hosts.py", "--summary", *runs)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() in page
    rows = [line for line in result.stdout.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == len(runs)
    cpus = [row.split(", 20")[0] for row in rows]
    assert len(set(cpus)) == len(cpus) and all("family" in cpu for cpu in cpus)
    assert all(" - " not in row and "| - |" not in row for row in rows)  # every column found


def test_first_saves_on_a_tmpfs_of_huge_pages(monkeypatch, tmp_path) -> None:
    """``run.py --huge-tmpfs``: its rows where a run timed the first saves there (the mount's
    option and the huge pages a first save got in each note), none where it did not; and a
    directory that is not on a tmpfs of huge pages is refused, saying how to mount one."""
    t = targets(monkeypatch)
    results = fabricated_results()
    assert not any("tmpfs of huge pages" in row.metric for row in t.rows(results))
    results["kv_lmdb_save_first_huge_tmpfs"] = {"median_s": 0.5, "gbps": 2.0, "runs_s": [0.5]}
    results.update(huge_tmpfs_mount="huge=within_size", huge_tmpfs_huge_pages_bytes=1 << 30)
    huge = {r.metric: r for r in t.rows(results) if "tmpfs of huge pages" in r.metric}
    assert len(huge) == len(t.HUGE_TMPFS) == 4
    first = huge[
        "LMDB save first, new store, on a tmpfs of huge pages / on /dev/shm, taking turns "
        "(speed-up)"
    ]
    assert first.value == 2.0
    notes = {r.note for r in huge.values()} - {""}
    assert notes == {"tmpfs huge=within_size; 1024 MiB of a first save in huge pages"}

    # /proc: certainly no tmpfs of huge pages, wherever the tests run
    result = run_benchmark("run.py", "--huge-tmpfs", "/proc", "--out", str(tmp_path / "o"))
    assert result.returncode != 0
    assert "--huge-tmpfs /proc: not on a tmpfs of huge pages (proc at /proc" in result.stderr
    assert "huge=within_size" in result.stderr and not (tmp_path / "o").exists()
