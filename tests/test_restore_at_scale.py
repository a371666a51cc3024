"""Restore at scale: every byte from the nearest place, once (``kvckpt.TieredStorageReader``).

Real gloo ranks on simulated hosts (``KVCKPT_NODE``), one real LMDB store per host and a real
redis-server as the shared tier. Redis's own ``total_net_output_bytes`` counts what the shared
tier served, independently of kvckpt's own counters. Every case is checked bit-exact against
the state that was saved."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from kvckpt import list_checkpoints, open_store
from kvckpt.engines.lmdb import close_idle_environments
from kvckpt.testing import RedisServer
from tests._spawn import spawn

from . import _hosts

MIB = 4.0  # the state, all ranks together
#: metadata, listings and leases: what the shared tier serves besides data, per case
_OVERHEAD = 256 << 10


def _state_bytes() -> int:
    return sum(t.nbytes for t in _hosts.full_state(MIB).values() if hasattr(t, "nbytes"))


def _save(root: Path, redis_url: str, world: int, per_host: int) -> None:
    spawn(_hosts.save_worker, world, str(root), redis_url, per_host, MIB)
    close_idle_environments()


def _variant(saved: Path, root: Path, lost: list[int]) -> str:
    """A copy of the hosts' stores as saved, less the hosts in ``lost`` (replaced nodes). The
    copy keeps LMDB's data files sparse (a map of 1 GiB holds a few MiB)."""
    subprocess.run(["cp", "-a", "--sparse=always", str(saved), str(root)], check=True)
    for h in lost:
        shutil.rmtree(root / f"host{h}")
    return str(root)


def _restore(
    tmp: Path, redis_url: str, world: int, per_host: int, cases: list[tuple[str, str, str]]
) -> dict[str, list[dict]]:
    out = tmp / "out"
    out.mkdir(exist_ok=True)
    spawn(_hosts.restore_worker, world, cases, redis_url, per_host, MIB, str(out))
    results = {}
    for name, _, _ in cases:
        stats = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]
        assert all(s["exact"] for s in stats), (name, stats)
        results[name] = stats
    return results


def _shared(stats: list[dict]) -> int:
    return sum(s["shared"] for s in stats)


def test_restarts_of_four_hosts_read_each_byte_from_the_nearest_place(
    tmp_path: Path, redis_server: RedisServer, redis_url: str
) -> None:
    """4 ranks on 4 hosts, DDP and FSDP state: a plain restart, one host replaced, every local
    store lost, and a damaged local value."""
    saved = tmp_path / "saved"
    _save(saved, redis_url, world=4, per_host=1)
    damaged = _variant(saved, tmp_path / "damaged", [])
    store = open_store(f"lmdb://{damaged}/host1")
    key = next(k for k in store.scan("") if "/data/" in k and "shard" in k)
    size = store.value_sizes([key])[0]
    assert size
    store.put_many([(key, b"\xff" * size)])  # same length, wrong bytes
    store.close()
    close_idle_environments()
    cases = [
        ("plain-reader", _variant(saved, tmp_path / "plain", []), "reader"),
        ("plain-tiers", str(tmp_path / "plain"), "tiers"),
        ("plain-prefetch", str(tmp_path / "plain"), "prefetch"),
        ("plain-budget", str(tmp_path / "plain"), "budget"),
        ("one-replaced", _variant(saved, tmp_path / "one", [2]), "tiers"),
        ("one-prefetch", _variant(saved, tmp_path / "one-p", [2]), "prefetch"),
        ("all-lost", _variant(saved, tmp_path / "all", [0, 1, 2, 3]), "tiers"),
        ("damaged", damaged, "tiers"),
    ]
    got = _restore(tmp_path, redis_url, 4, 1, cases)
    state = _state_bytes()
    stored = list_checkpoints(redis_url)[0].total_bytes  # tensors and objects
    for name in ("plain-reader", "plain-tiers", "plain-prefetch", "plain-budget"):
        assert _shared(got[name]) == 0, name  # metadata aside
        assert got[name][0]["served"] < _OVERHEAD, name
        assert all(s["local"] > 0 and s["peers"] > 0 for s in got[name]), name
    # the exchange holds all it sends and receives at once, or one item at a time in steps
    largest = max(t.nbytes for t in _hosts.full_state(MIB).values() if hasattr(t, "nbytes"))
    assert max(s["peak_buffered"] for s in got["plain-reader"]) > largest
    assert 0 < max(s["peak_buffered"] for s in got["plain-budget"]) <= largest
    one = _shared(got["one-replaced"])
    assert 0 < one <= state / 4 * 1.05  # the replaced host's share
    assert got["one-replaced"][0]["served"] < one + _OVERHEAD
    # prefetch on the replaced host fetches its share alone; the restore then reads none
    assert _shared(got["one-prefetch"]) == 0
    assert one <= got["one-prefetch"][0]["served"] < one + _OVERHEAD
    # replicated items are read from Redis once, not once per rank
    assert _shared(got["all-lost"]) == stored
    assert got["all-lost"][0]["served"] < stored + _OVERHEAD
    assert sum(s["fallbacks"] for s in got["damaged"]) == 1
    assert 0 < _shared(got["damaged"]) <= size


def test_a_new_world_size_reads_the_surviving_stores(
    tmp_path: Path, redis_server: RedisServer, redis_url: str
) -> None:
    """Saved by 2 ranks on 2 hosts; restored by 4 ranks on the same 2 hosts (the stores hold
    every item: nothing from Redis), and by 1 rank on host 0 (host 1's share from Redis)."""
    saved = tmp_path / "saved"
    _save(saved, redis_url, world=2, per_host=1)
    cases = [("doubled", str(saved), "tiers"), ("doubled-budget", str(saved), "budget")]
    got = _restore(tmp_path, redis_url, 4, 2, cases)
    doubled = got["doubled"]
    assert _shared(doubled) == 0
    assert _shared(got["doubled-budget"]) == 0  # relayed within a node, a step at a time
    largest = max(t.nbytes for t in _hosts.full_state(MIB).values() if hasattr(t, "nbytes"))
    assert 0 < max(s["peak_buffered"] for s in got["doubled-budget"]) <= largest
    assert doubled[0]["served"] < _OVERHEAD
    # an item a host lacks crosses into it once, then passes between its two ranks
    for host in (0, 1):
        ranks = doubled[2 * host : 2 * host + 2]
        crossed = sum(s["from_other_nodes"] for s in ranks)
        assert 0 < crossed <= _state_bytes() / 4 * 1.15  # half the replicated half, once
        assert sum(s["peers"] for s in ranks) > crossed
    halved = _restore(tmp_path, redis_url, 1, 1, [("halved", str(saved), "tiers")])["halved"]
    assert 0 < _shared(halved) <= _state_bytes() / 2 * 1.05


def test_an_error_while_applying_an_exchanged_item_fails_every_rank_never_hangs(
    tmp_path: Path, redis_server: RedisServer, redis_url: str
) -> None:
    """4 ranks on 4 hosts, an exchange of many steps (a budget under one item); one rank's
    planner refuses a replicated tensor that other ranks send it. Every rank's load fails,
    with that rank's error, within the deadline: none waits on a step the others left."""
    saved = tmp_path / "saved"
    _save(saved, redis_url, world=4, per_host=1)
    out = tmp_path / "out"
    out.mkdir()
    spawn(_hosts.refusing_restore_worker, 4, str(saved), redis_url, "rep2", str(out))
    for rank in range(4):
        raised = json.loads((out / f"refused.rank{rank}.json").read_text())["raised"]
        assert "this planner refuses 'rep2'" in raised, (rank, raised)


def test_a_load_over_a_subgroup_exchanges_by_the_subgroup_ranks(
    tmp_path: Path, redis_server: RedisServer, redis_url: str
) -> None:
    """Ranks 1 and 2 of 3 load over a subgroup: each replicated item is read from Redis once
    and sent to the other, addressed by its rank in the subgroup; a reader not told of the
    subgroup fails with an error that says to pass it."""
    import torch
    import torch.distributed.checkpoint as dcp

    from kvckpt import KVStorageWriter
    from tests import _dist

    state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=KVStorageWriter(redis_url), checkpoint_id="whole")
    out = tmp_path / "out"
    out.mkdir()
    spawn(_dist.subgroup_restore_worker, 3, redis_url, str(out))
    for rank in (1, 2):
        got = json.loads((out / f"sub.rank{rank}.json").read_text())
        assert got["exact"], (rank, got)
        assert "pass the group dcp.load runs over" in got["raised"], (rank, got)
    assert sum(json.loads((out / f"sub.rank{r}.json").read_text())["peers"] for r in (1, 2)) > 0
