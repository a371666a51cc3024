"""Peer copies (``Tiers(peers=K)``) on simulated hosts: real gloo ranks, one LMDB store per
host, a real redis-server as the shared tier, and replaced nodes made for real (their stores
deleted before the restart)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from kvckpt import Tiers, open_store
from kvckpt.catalog import PEER, read_index
from kvckpt.keys import data_prefix
from kvckpt.placement import Topology, covered
from kvckpt.testing import RedisServer, free_port
from tests import _peers
from tests._cli import run
from tests._spawn import spawn


def test_the_ring_keeps_every_share_through_any_k_lost_nodes() -> None:
    for count in (2, 3, 4, 5, 8):
        for per_node in (1, 2, 3):
            topology = Topology(tuple(f"n{r // per_node}" for r in range(count * per_node)))
            order = topology.order
            for peers in range(1, count):
                for first in range(count):
                    lost = [order[(first + j) % count] for j in range(peers)]
                    assert covered(topology, peers, lost), (count, per_node, peers, lost)
                # K + 1 consecutive nodes hold all the copies of one share
                if peers < count - 1:
                    assert not covered(topology, peers, order[: peers + 1])
            # each rank sends to one rank per target node, and every send is received once
            for peers in range(1, count):
                pairs = {
                    (r, to) for r in range(len(topology.nodes)) for to in topology.sends(r, peers)
                }
                back = {
                    (src, r)
                    for r in range(len(topology.nodes))
                    for src in topology.receives(r, peers)
                }
                assert pairs == back


def test_uneven_nodes_spread_the_copies_over_the_targets_ranks() -> None:
    topology = Topology(("a", "a", "a", "b", "c", "c"))
    assert topology.targets("a", 1) == ["b"]
    assert topology.sends(0, 1) == [3] and topology.sends(2, 1) == [3]
    assert topology.targets("b", 2) == ["c", "a"]
    assert topology.sends(3, 2) == [4, 0]
    assert sorted(topology.receives(4, 1)) == [3]


def _case(root: Path, name: str, lost: list[int]) -> tuple[str, str]:
    """A copy of the hosts' stores with the ``lost`` hosts' stores gone (replaced nodes)."""
    case = root.parent / name
    # sparse: an LMDB file is as long as its map, which holds far more than was written
    subprocess.run(["cp", "-r", "--sparse=always", str(root), str(case)], check=True)
    for host in lost:
        shutil.rmtree(case / f"host{host}")
    return name, str(case)


def _results(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("peers", [1, 2])
def test_replaced_nodes_restore_the_newest_checkpoint_from_their_peers(
    tmp_path: Path, server: Callable[..., RedisServer], peers: int
) -> None:
    world, steps, shared_every = 4, 3, 3
    srv = server()
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(
        _peers.save_worker,
        world,
        str(root),
        srv.url(),
        1,
        peers,
        shared_every,
        steps,
        str(out),
    )
    # Only every 3rd checkpoint reaches the shared tier: the first, here. The others send it
    # nothing but the test's own INFO commands.
    into_shared = json.loads((out / "saves.json").read_text())["into_shared"]
    assert into_shared[0] > _peers.MIB * (1 << 20) and max(into_shared[1:]) < 4096, into_shared

    # keep_last=2 reaches the copies at once: no host keeps a peer's share of step-1 (its
    # own goes one save later, as without peers), and each keeps its peers' shares of the
    # two newest
    for host in range(world):
        engine = open_store(f"lmdb://{root / f'host{host}'}")
        kept = {k.split("/")[4] for k in engine.scan(data_prefix(engine.prefix, "step-1"))}
        assert kept <= {str(host)}, (host, kept)
        shares = {
            (e["checkpoint_id"], e["rank"])
            for e in read_index(engine).remote.values()
            if e.get("origin") == PEER
        }
        theirs = [(host - j) % world for j in range(1, peers + 1)]
        assert shares == {(f"step-{s}", r) for s in (2, 3) for r in theirs}, (host, shares)
        engine.close()
    shown = run("stats", f"lmdb://{root / 'host1'}", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [s["checkpoint_id"] for s in json.loads(shown.stdout)["peer_shares"]] == [
        "step-3",
        "step-2",
    ]
    assert "peer copies" in run("stats", f"lmdb://{root / 'host1'}").stdout

    cases = [_case(root, "restart", [])]
    cases += [_case(root, f"lost{h}", [h]) for h in range(world)]
    if peers == 1:
        cases.append(_case(root, "lost0-2", [0, 2]))  # not neighbours: each share survives
        cases.append(_case(root, "lost1-2", [1, 2]))  # host1's share lived on 1 and 2 only
    else:
        cases += [_case(root, "lost0-1", [0, 1]), _case(root, "lost1-3", [1, 3])]
    spawn(_peers.restore_worker, world, cases, srv.url(), 1, peers, str(out))

    for name, _ in cases:
        ranks = _results(out, name, world)
        assert all(r["exact"] for r in ranks), (name, ranks)
        if name == "lost1-2":  # more lost than one copy covers: the newest held whole
            assert {r["checkpoint_id"] for r in ranks} == {"step-1"}, (name, ranks)
            continue
        assert {r["checkpoint_id"] for r in ranks} == {f"step-{steps}"}, (name, ranks)
        assert sum(r["shared"] for r in ranks) == 0, (name, ranks)


def test_peers_without_a_shared_tier(tmp_path: Path) -> None:
    world = 3
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(_peers.save_worker, world, str(root), None, 1, 1, 1, 2, str(out))
    cases = [_case(root, "lost1", [1]), _case(root, "lost0", [0])]
    spawn(_peers.restore_worker, world, cases, None, 1, 1, str(out))
    for name, _ in cases:
        ranks = _results(out, name, world)
        assert all(r["exact"] and r["checkpoint_id"] == "step-2" for r in ranks), (name, ranks)


def test_one_node_has_no_peers_and_saves_as_without(tmp_path: Path) -> None:
    world = 2
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(_peers.save_worker, world, str(root), None, 2, 1, 1, 1, str(out))
    cases = [_case(root, "restart", [])]
    spawn(_peers.restore_worker, world, cases, None, 2, 1, str(out))
    ranks = _results(out, "restart", world)
    assert all(r["exact"] and r["checkpoint_id"] == "step-1" for r in ranks), ranks


def test_a_copy_damaged_on_the_way_is_kept_nowhere_and_never_restored(
    tmp_path: Path, server: Callable[..., RedisServer]
) -> None:
    world = 2
    srv = server()
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(_peers.damaged_copy_worker, world, str(root), srv.url(), str(out))
    for rank in range(world):
        reported = json.loads((out / f"damaged.rank{rank}.json").read_text())["reported"]
        assert "step-2" in reported and "checksum" in reported, reported
    # host1 keeps no copy of host0's share of step-2: losing host0 restores step-1, whole.
    cases = [_case(root, "lost0", [0])]
    spawn(_peers.restore_worker, world, cases, srv.url(), 1, 1, str(out))
    ranks = _results(out, "lost0", world)
    assert all(r["exact"] and r["checkpoint_id"] == "step-1" for r in ranks), ranks


def test_several_ranks_per_node_async_saves_and_a_failed_save_keep_the_copies_in_step(
    tmp_path: Path,
) -> None:
    world, per_host = 6, 2
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(_peers.async_and_failed_saves_worker, world, str(root), per_host, str(out))
    for rank in range(world):
        assert json.loads((out / f"saves.rank{rank}.json").read_text())["failed"], rank
    # host1 (ranks 2 and 3) replaced: its share of step-3 comes from host2, whole
    cases = [_case(root, "lost1", [1]), _case(root, "lost0", [0])]
    spawn(_peers.restore_worker, world, cases, None, per_host, 1, str(out))
    for name, _ in cases:
        ranks = _results(out, name, world)
        assert all(r["exact"] and r["checkpoint_id"] == "step-3" for r in ranks), (name, ranks)


def test_a_peer_killed_mid_copy_fails_the_copy_not_the_save_and_nothing_half_copied_restores(
    tmp_path: Path, server: Callable[..., RedisServer]
) -> None:
    world, victim = 3, 2
    srv = server()
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    context = mp.start_processes(
        _peers.killed_mid_copy_worker,
        args=(world, free_port(), str(root), srv.url(), victim, str(out)),
        nprocs=world,
        join=False,
        start_method="forkserver",  # as spawn() does (tests/_spawn.py)
    )
    for process in context.processes:
        process.join(timeout=120)
    codes = [p.exitcode for p in context.processes]
    for p in context.processes:
        if p.exitcode is None:
            p.kill()
    assert codes == [0, 0, -signal.SIGKILL], codes
    for rank in range(world):
        if rank != victim:
            reported = json.loads((out / f"killed.rank{rank}.json").read_text())["reported"]
            assert "step-2" in reported and "a peer gone" in reported, (rank, reported)
    # No host keeps any copy of step-2 (the copy failed for the whole job), so losing the
    # killed host restores step-1, whole; a plain restart still restores step-2 from the
    # hosts' own stores, where the save had committed before its copy began.
    for host in range(world):
        engine = open_store(f"lmdb://{root / f'host{host}'}")
        copies = [
            e for e in read_index(engine).remote.values()
            if e.get("origin") == PEER and e["checkpoint_id"] == "step-2"
        ]  # fmt: skip
        assert not copies, (host, copies)
        if host != victim:  # what had arrived of a copy that failed is gone
            ranks = {k.split("/")[4] for k in engine.scan(data_prefix(engine.prefix, "step-2"))}
            assert ranks == {str(host)}, (host, ranks)
        engine.close()
    cases = [_case(root, "restart", []), _case(root, "lost-killed", [victim])]
    spawn(_peers.restore_worker, world, cases, srv.url(), 1, 1, str(out))
    for name, step in (("restart", 2), ("lost-killed", 1)):
        ranks = _results(out, name, world)
        assert all(r["exact"] and r["checkpoint_id"] == f"step-{step}" for r in ranks), (
            name,
            ranks,
        )


def _damage(root: Path, host: int, checkpoint_id: str, rank: int) -> None:
    """Overwrite one of ``rank``'s values of a checkpoint in a host's store with wrong bytes
    of the same length (a copy damaged at rest)."""
    engine = open_store(f"lmdb://{root / f'host{host}'}")
    keys = [
        k for k in engine.scan(data_prefix(engine.prefix, checkpoint_id))
        if k.split("/")[4] == str(rank)
    ]  # fmt: skip
    sizes = engine.value_sizes(keys)
    key, size = max(zip(keys, sizes, strict=True), key=lambda pair: pair[1])
    engine.put_many([(key, b"\xa5" * size)])
    engine.close()


def test_a_damaged_copy_falls_back_to_the_next_holder(
    tmp_path: Path, server: Callable[..., RedisServer]
) -> None:
    """The newest save lives in the hosts' stores and their peers' (not in Redis). A damaged
    copy sends its items to another holder: another peer's copy, or a peer's copy of a
    host's own share; the restore stays on the newest save, bit-exact. With no holder left,
    it goes back to the newest save held whole."""
    world = 4
    srv = server()
    root, out = tmp_path / "hosts", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    spawn(_peers.save_worker, world, str(root), srv.url(), 1, 2, 1000, 2, str(out))
    # host1 replaced; host2's copy of its share damaged: host3 holds the other copy
    replaced = _case(root, "replaced", [1])
    _damage(Path(replaced[1]), 2, "step-2", 1)
    # a plain restart; host1's own value damaged: host2 and host3 hold copies of it
    own = _case(root, "own", [])
    _damage(Path(own[1]), 1, "step-2", 1)
    # host1 replaced, both copies of its share damaged: no store holds step-2 whole any
    # more, and the restore goes back to step-1 (in Redis, the 1st save), whole
    none = _case(root, "none", [1])
    _damage(Path(none[1]), 2, "step-2", 1)
    _damage(Path(none[1]), 3, "step-2", 1)
    spawn(_peers.restore_worker, world, [replaced, own, none], srv.url(), 1, 2, str(out))
    for name in ("replaced", "own"):
        ranks = _results(out, name, world)
        assert all(r["exact"] and r["checkpoint_id"] == "step-2" for r in ranks), (name, ranks)
        assert sum(r["shared"] for r in ranks) == 0, (name, ranks)
    ranks = _results(out, "none", world)
    assert all(r["exact"] and r["checkpoint_id"] == "step-1" for r in ranks), ranks


def test_the_map_is_sized_for_the_peer_shares_too(tmp_path: Path) -> None:
    """Each save a node's store holds brings K peers' shares: the LMDB map and the pages a
    save makes ready count them (``KVStorageWriter.get_ready``)."""
    tiers = Tiers([f"lmdb://{tmp_path / 'host0'}"], keep_last=2, peers=2)
    assert tiers.writer()._saves_held() == 3  # no other node: nothing to copy
    tiers.peer_copies._group = object()  # type: ignore[assignment]  # as where copies run
    tiers.peer_copies.topology = Topology(("a", "b", "c"))
    assert tiers.writer()._saves_held() == 3 * (1 + 2)
    tiers.peer_copies.topology = Topology(("a", "b"))  # one other node: one peer share
    assert tiers.writer()._saves_held() == 3 * (1 + 1)
    tiers.peer_copies._group = None
    tiers.close()
