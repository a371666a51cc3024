"""Restore at scale: where each byte of a restore comes from, in bytes and seconds.

N simulated hosts on this machine: gloo ranks with ``KVCKPT_NODE=host<h>`` (``--ranks-per-host``
consecutive ranks per host), each host with its own node-local LMDB store ``<root>/host<h>``,
and a real redis-server (started here) as the shared tier. Per number of hosts and kind of state
(``ddp``: replicated plain tensors; ``fsdp``: DTensors sharded on dim 0 over every rank), the
state is saved once with ``kvckpt.Tiers([local, redis])`` (the background copies waited for),
then restored with ``Tiers.restore`` in these cases:

- ``plain``: a plain restart, every host's store survives;
- ``one-replaced`` / ``two-replaced``: the last one / two hosts' stores are gone;
- ``all-lost``: every host's store is gone (Redis alone holds the checkpoint);
- ``halved``: N/2 hosts (0..N/2-1, with their stores) restore; the others left the job;
- ``doubled``: the same N hosts with twice the ranks per host.

Each case is followed, in turn, by its baseline: the same ranks restoring the same checkpoint
from Redis alone (``KVStorageReader``). Per rank: bytes from the node's own store, from other
ranks, from the shared tier (kvckpt's ``RestoreStats``) and bytes sent; Redis's own
``total_net_output_bytes`` (what the shared tier served, exactly, metadata included); the
restore's wall time; and whether the restored state is bit-exact. After the world-N cases, a
ring exchange over the same gloo group measures what the exchange between ranks costs here.

With ``--peers K,...`` (default ``1,2``) and ``--peer-hosts`` (default ``4,8``), the same state
is also saved twice with ``Tiers([local, redis], peers=K, shared_every=1000)``: the first save
reaches Redis, the second (the newest) only the nodes' stores and their K peers'. Per save:
the bytes Redis took in (its ``total_net_input_bytes``, exact), the bytes the peers took in
(``kvckpt.events``' ``peer`` events), and the seconds a save blocked and until its copies were
done. Then ``plain``, ``one-replaced`` and ``two-replaced`` restore the newest with
``Tiers(peers=K)``, counted as above (no baseline: Redis does not hold it).

    python benchmarks/restore_scale.py --out docs/benchmark          # 2, 4, 8 hosts, 64 MiB
    python benchmarks/restore_scale.py --hosts 2 --mib 2 --kinds ddp --cases plain

Check ``/proc/loadavg`` first: the machine must be otherwise idle (each case records it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import cpu_name, markdown_table, write_report  # noqa: E402

from kvckpt import KVStorageReader, Tiers, events  # noqa: E402
from kvckpt.engines.lmdb import close_idle_environments  # noqa: E402
from kvckpt.testing import RedisServer, free_port  # noqa: E402

MIB = 1 << 20
CASES = ("plain", "one-replaced", "two-replaced", "all-lost", "halved", "doubled")
PEER_CASES = ("plain", "one-replaced", "two-replaced")
KINDS = ("ddp", "fsdp")
TENSORS = 8  # the state is this many fp32 tensors of equal size


# -- the state ------------------------------------------------------------------------------------


@functools.cache
def full_state(mib: float) -> dict[str, torch.Tensor]:
    """The whole state, ``mib`` MiB of seeded random fp32 tensors, 256 columns each (never
    changed in place: every rank state is a copy)."""
    g = torch.Generator().manual_seed(11)
    rows = max(16, int(mib * MIB / TENSORS / 4 / 256))
    return {f"layer{i}.weight": torch.randn(rows, 256, generator=g) for i in range(TENSORS)}


def full_state_bytes(mib: float) -> int:
    return sum(t.nbytes for t in full_state(mib).values())


def rank_state(kind: str, world: int, mib: float, zeros: bool = False) -> dict[str, Any]:
    """This rank's state dict: the whole tensors (``ddp``), or DTensor shards (``fsdp``)."""
    full = full_state(mib)
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    if kind == "ddp":
        return {k: v.clone() for k, v in full.items()} if not zeros else full
    mesh = init_device_mesh("cpu", (world,))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}


def local_tensor(value: Any) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


# -- the ranks ------------------------------------------------------------------------------------


def _init(rank: int, world: int, port: int, ranks_per_host: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ["KVCKPT_NODE"] = f"host{rank // ranks_per_host}"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _finish() -> None:
    """All ranks done, the group torn down, and out without gloo's static destructors (which
    can abort after the interpreter finalized)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def host_url(root: str, rank: int, ranks_per_host: int) -> str:
    return f"lmdb://{root}/host{rank // ranks_per_host}"


def save_worker(
    rank: int,
    world: int,
    port: int,
    ranks_per_host: int,
    root: str,
    redis_url: str,
    kind: str,
    mib: float,
    checkpoint_id: str,
) -> None:
    _init(rank, world, port, ranks_per_host)
    tiers = Tiers([host_url(root, rank, ranks_per_host), redis_url])
    dcp.save(
        rank_state(kind, world, mib), storage_writer=tiers.writer(), checkpoint_id=checkpoint_id
    )
    tiers.close()  # the copies to Redis are done
    _finish()


def peer_save_worker(
    rank: int,
    world: int,
    port: int,
    ranks_per_host: int,
    root: str,
    redis_url: str,
    kind: str,
    mib: float,
    checkpoint_id: str,
    peers: int,
    out: str,
) -> None:
    """Two saves through ``Tiers(peers=K, shared_every=1000)``: the first reaches Redis, the
    second (``checkpoint_id``) only the peers. Writes this rank's records of both."""
    _init(rank, world, port, ranks_per_host)
    client = redis.Redis.from_url(redis_url)
    tiers = Tiers([host_url(root, rank, ranks_per_host), redis_url], peers=peers, shared_every=1000)
    received = [0]

    def count(event: events.Event) -> None:
        if (event.operation, event.phase) == ("peer", "copy"):
            received[0] += event.nbytes

    unsubscribe = events.subscribe(count)
    records = []
    for cid in (f"{checkpoint_id}-older", checkpoint_id):
        state = rank_state(kind, world, mib)
        dist.barrier()
        before, received[0] = int(client.info("stats")["total_net_input_bytes"]), 0
        dist.barrier()
        started = time.perf_counter()
        dcp.save(state, storage_writer=tiers.writer(), checkpoint_id=cid)
        blocking = time.perf_counter() - started
        tiers.wait()
        done = time.perf_counter() - started
        dist.barrier()
        into = int(client.info("stats")["total_net_input_bytes"]) - before
        records.append(
            {
                "save": cid,
                "rank": rank,
                "into_shared": into,  # the same on every rank: what Redis took in from all
                "to_peers": received[0],  # what this rank's node took in from its peers
                "blocking_s": blocking,
                "copies_done_s": done,
            }
        )
    unsubscribe()
    tiers.close()
    client.close()
    Path(out, f"save.rank{rank}.json").write_text(json.dumps(records))
    _finish()


def _served(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def restore_worker(
    rank: int,
    world: int,
    port: int,
    ranks_per_host: int,
    cases: list[tuple[str, str]],
    redis_url: str,
    kind: str,
    mib: float,
    checkpoint_id: str,
    repeats: int,
    probe_mib: float,
    out: str,
    peers: int = 0,
) -> None:
    """Restore each case (name, root of its hosts' stores), then its baseline (Redis alone;
    none with ``peers``: Redis does not hold the newest), ``repeats`` rounds; then, if
    ``probe_mib``, the ring exchange. Writes this rank's records."""
    _init(rank, world, port, ranks_per_host)
    client = redis.Redis.from_url(redis_url)
    want = rank_state(kind, world, mib)
    records: list[dict[str, Any]] = []
    for rep in range(repeats):
        for name, root in cases:
            for mode in ("tiered",) if peers else ("tiered", "baseline"):
                state = rank_state(kind, world, mib, zeros=True)
                dist.barrier()
                load, before = _loadavg(), _served(client)
                dist.barrier()
                started = time.perf_counter()
                stats = None
                if mode == "tiered":
                    tiers = Tiers([host_url(root, rank, ranks_per_host), redis_url], peers=peers)
                    restored = tiers.restore(state)
                    assert restored is not None
                    # with peers, more lost nodes than K covers restore the older save
                    assert restored.checkpoint_id in (checkpoint_id, f"{checkpoint_id}-older")
                    stats = tiers.last_restore_stats
                    assert stats is not None
                else:
                    reader = KVStorageReader(redis_url, checkpoint_id=checkpoint_id)
                    dcp.load(state, storage_reader=reader)
                seconds = time.perf_counter() - started
                dist.barrier()
                served = _served(client) - before
                if mode == "tiered":
                    tiers.close()
                exact = all(
                    torch.equal(local_tensor(state[k]), local_tensor(want[k])) for k in want
                )
                records.append(
                    {
                        "case": name,
                        "mode": mode,
                        "restored": None if stats is None else restored.checkpoint_id,
                        "repeat": rep,
                        "rank": rank,
                        "exact": exact,
                        "seconds": seconds,
                        "read_seconds": None if stats is None else stats.seconds,
                        "local": 0 if stats is None else stats.local,
                        "shared": None if stats is None else sum(stats.shared.values()),
                        "peers": 0 if stats is None else stats.peers,
                        "sent": 0 if stats is None else stats.sent,
                        "fallbacks": 0 if stats is None else stats.fallbacks,
                        "served": served,  # the same on every rank: what Redis sent to all
                        "loadavg": load,
                    }
                )
                close_idle_environments()
    probe: dict[str, Any] | None = None
    if probe_mib and world > 1:
        probe = _ring_exchange(rank, world, int(probe_mib * MIB))
    client.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"records": records, "probe": probe}))
    _finish()


def _ring_exchange(rank: int, world: int, nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """Each rank sends ``nbytes`` to the next rank and receives as many from the previous one
    (``batch_isend_irecv``, as the restore's exchange does); the median of ``repeats``."""
    send = torch.full((nbytes,), rank % 251, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        times.append(time.perf_counter() - started)
    assert int(recv[0]) == (rank - 1) % world % 251
    return {"bytes": nbytes, "seconds": statistics.median(times)}


# -- the driver -----------------------------------------------------------------------------------


def _copy_stores(saved: Path, root: Path, hosts: range, lost: set[int]) -> str:
    """A copy of the saved hosts' stores, for ``hosts`` less ``lost`` (replaced nodes).

    ``cp --sparse=always``: an LMDB file is as large as its map (1 GiB by default) but holds
    only what was written, and a plain copy (``shutil.copytree``) would fill every hole."""
    root.mkdir(parents=True)
    for h in hosts:
        if h not in lost:
            subprocess.run(
                ["cp", "-r", "--sparse=always", str(saved / f"host{h}"), str(root / f"host{h}")],
                check=True,
            )
    return str(root)


def _spawn(worker: Any, world: int, *args: Any) -> None:
    mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)
    close_idle_environments()


def run_group(
    hosts: int, kind: str, args: argparse.Namespace, tmp: Path, redis_url: str
) -> dict[str, Any]:
    """Save once with ``hosts`` hosts, then every case and its baseline; the results by case."""
    rph = args.ranks_per_host
    checkpoint_id = f"{kind}-{hosts}hosts"
    group = tmp / checkpoint_id
    saved = group / "saved"
    _spawn(save_worker, hosts * rph, rph, str(saved), redis_url, kind, args.mib, checkpoint_id)
    # (world, ranks per host) -> cases, each (name, its stores' root)
    runs: dict[tuple[int, int], list[tuple[str, str]]] = {}
    every = range(hosts)
    for name in args.cases:
        lost: set[int] = set()
        if name == "halved":  # hosts N/2.. left the job
            if hosts < 2:
                continue
            world, per_host, lost = hosts // 2 * rph, rph, set(range(hosts // 2, hosts))
        elif name == "doubled":
            world, per_host, lost = hosts * rph * 2, rph * 2, set()
        else:
            world, per_host = hosts * rph, rph
            lost = {
                "plain": set(),
                "one-replaced": {hosts - 1},
                "two-replaced": set(range(max(0, hosts - 2), hosts)),
                "all-lost": set(every),
            }[name]
        root = _copy_stores(saved, group / name, every, lost)
        runs.setdefault((world, per_host), []).append((name, root))
    results: dict[str, Any] = {}
    for (world, per_host), cases in runs.items():
        out = group / f"out-{world}"
        out.mkdir()
        print(
            f"{hosts} hosts, {kind}: {world} ranks, {[c for c, _ in cases]} "
            f"(loadavg {_loadavg():.2f})",
            flush=True,
        )
        probe_mib = args.probe_mib if world == hosts * rph else 0
        _spawn(
            restore_worker,
            world,
            per_host,
            cases,
            redis_url,
            kind,
            args.mib,
            checkpoint_id,
            args.repeats,
            probe_mib,
            str(out),
        )
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
        for name, _ in cases:
            results[name] = {
                "ranks": world,
                "ranks_per_host": per_host,
                "records": [rec for r in ranks for rec in r["records"] if rec["case"] == name],
            }
        if probe_mib:
            results["probe"] = [r["probe"] for r in ranks]
    shutil.rmtree(group)
    redis.Redis.from_url(redis_url).flushall()
    return results


def run_peer_group(
    hosts: int, kind: str, peers: int, args: argparse.Namespace, tmp: Path, redis_url: str
) -> dict[str, Any]:
    """Save twice with ``Tiers(peers=K)``, then restore the newest in each of ``PEER_CASES``."""
    rph = args.ranks_per_host
    world = hosts * rph
    checkpoint_id = f"{kind}-{hosts}hosts-peers{peers}"
    group = tmp / checkpoint_id
    saved, out = group / "saved", group / "out"
    out.mkdir(parents=True)
    _spawn(
        peer_save_worker, world, rph, str(saved), redis_url, kind, args.mib, checkpoint_id,
        peers, str(out),
    )  # fmt: skip
    saves = [
        rec for r in range(world) for rec in json.loads((out / f"save.rank{r}.json").read_text())
    ]
    lost = {"plain": set(), "one-replaced": {hosts - 1}, "two-replaced": {hosts - 2, hosts - 1}}
    cases = [
        (name, _copy_stores(saved, group / name, range(hosts), lost[name])) for name in PEER_CASES
    ]
    print(
        f"{hosts} hosts, {kind}, peers={peers}: {world} ranks (loadavg {_loadavg():.2f})",
        flush=True,
    )
    _spawn(
        restore_worker, world, rph, cases, redis_url, kind, args.mib, checkpoint_id,
        args.repeats, 0, str(out), peers,
    )  # fmt: skip
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    results: dict[str, Any] = {"saves": saves}
    for name, _ in cases:
        results[name] = {
            "ranks": world,
            "ranks_per_host": rph,
            "records": [rec for r in ranks for rec in r["records"] if rec["case"] == name],
        }
    shutil.rmtree(group)
    redis.Redis.from_url(redis_url).flushall()
    return results


def _peer_rows(
    peer_results: dict[str, dict[str, Any]],
) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    rows, summaries = [], {}
    for key, group in peer_results.items():
        kind, hosts, peers = key.split("/")
        saves = group["saves"]
        per_save = {}
        for cid in sorted({r["save"] for r in saves}):
            mine = [r for r in saves if r["save"] == cid]
            per_save[cid] = {
                "into_shared": statistics.median(r["into_shared"] for r in mine),
                "to_peers": sum(r["to_peers"] for r in mine),
                "blocking_s_max": max(r["blocking_s"] for r in mine),
                "copies_done_s_max": max(r["copies_done_s"] for r in mine),
            }
        older, newest = sorted(per_save, key=lambda c: not c.endswith("-older"))
        first, last = per_save[older], per_save[newest]
        for name in PEER_CASES:
            t = summarize(group[name]["records"], "tiered")
            summaries[f"{key}/{name}"] = {"saves": per_save, "tiered": t}
            rows.append(
                (
                    hosts,
                    kind,
                    peers,
                    name,
                    group[name]["ranks"],
                    "newest"
                    if t["restored"] == [newest]
                    else "older"
                    if t["restored"] == [older]
                    else "MIXED",
                    f"{_mib(first['into_shared'])} / {_mib(last['into_shared'])}",
                    _mib(last["to_peers"]),
                    f"{last['blocking_s_max']:.2f} / {last['copies_done_s_max']:.2f}",
                    _mib(t["local_total"]),
                    _mib(t["peers_total"]),
                    _mib(t["shared_total"]),
                    _mib(t["served"]),
                    f"{t['seconds_median']:.2f} / {t['seconds_max']:.2f}",
                    "yes" if t["exact"] else "NO",
                )
            )
    return rows, summaries


def summarize(records: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Per-rank medians over the repeats, then median and max over the ranks."""
    mine = [r for r in records if r["mode"] == mode]
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in mine:
        by_rank.setdefault(r["rank"], []).append(r)

    def per_rank(key: str) -> list[float]:
        return [statistics.median(r[key] for r in recs) for recs in by_rank.values()]

    seconds = per_rank("seconds")
    out = {
        "exact": all(r["exact"] for r in mine),
        "restored": sorted({str(r.get("restored")) for r in mine}),
        "seconds_median": statistics.median(seconds),
        "seconds_max": max(seconds),
        "served": statistics.median(r["served"] for r in mine),
        "loadavg_max": max(r["loadavg"] for r in mine),
    }
    for key in ("local", "peers", "sent", "fallbacks"):
        values = per_rank(key)
        out[f"{key}_median"] = statistics.median(values)
        out[f"{key}_total"] = sum(values)
    if mode == "tiered":
        out["shared_total"] = sum(per_rank("shared"))
        out["read_seconds_max"] = max(per_rank("read_seconds"))
    return out


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hosts", default="2,4,8", help="numbers of simulated hosts (default 2,4,8)")
    ap.add_argument("--ranks-per-host", type=int, default=1)
    ap.add_argument("--mib", type=float, default=64, help="state size, all ranks together")
    ap.add_argument("--kinds", default=",".join(KINDS), help="ddp, fsdp or both")
    ap.add_argument("--cases", default=",".join(CASES), help=", ".join(CASES))
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every case, taking turns")
    ap.add_argument(
        "--probe-mib", type=float, default=16, help="MiB per rank of the ring exchange (0: none)"
    )
    ap.add_argument("--peers", default="1,2", help="Tiers(peers=K) cases (empty: none)")
    ap.add_argument("--peer-hosts", default="4,8", help="numbers of hosts of the peers cases")
    ap.add_argument("--root", default=None, help="where the host stores go (default /dev/shm)")
    ap.add_argument("--out", default="docs/benchmark")
    args = ap.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.cases = [c for c in args.cases.split(",") if c]
    for value, allowed in ((args.kinds, KINDS), (args.cases, CASES)):
        unknown = set(value) - set(allowed)
        if unknown:
            ap.error(f"unknown {sorted(unknown)}; choose from {', '.join(allowed)}")
    hosts_list = [int(h) for h in args.hosts.split(",")]
    base = args.root or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    tmp = Path(tempfile.mkdtemp(prefix="kvckpt-restore-scale-", dir=base))
    # the saved stores and every case's copy of them (each at most the state), at once
    need = 8 * len(CASES) * full_state_bytes(args.mib)
    if shutil.disk_usage(tmp).free < need:
        shutil.rmtree(tmp)
        ap.error(f"{tmp.parent} has less than {need / MIB:.0f} MiB free; pass --root elsewhere")
    started = time.monotonic()
    print(f"loadavg at the start: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    server = RedisServer(tmp / "redis")
    results: dict[str, dict[str, Any]] = {}
    peer_results: dict[str, dict[str, Any]] = {}
    peers_list = [int(k) for k in args.peers.split(",") if k]
    try:
        for hosts in hosts_list:
            for kind in args.kinds:
                results[f"{kind}/{hosts}"] = run_group(hosts, kind, args, tmp, server.url())
        for hosts in [int(h) for h in args.peer_hosts.split(",") if h]:
            for kind in args.kinds:
                for peers in peers_list:
                    if peers < hosts:
                        peer_results[f"{kind}/{hosts}/{peers}"] = run_peer_group(
                            hosts, kind, peers, args, tmp, server.url()
                        )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    state_bytes = full_state_bytes(args.mib)

    rows, summaries, costs = [], {}, []
    for key, group in results.items():
        kind, hosts_text = key.split("/")
        hosts = int(hosts_text)
        for name in CASES:
            if name not in group:
                continue
            case = group[name]
            tiered = summarize(case["records"], "tiered")
            base_ = summarize(case["records"], "baseline")
            summaries[f"{key}/{name}"] = {
                "kind": kind,
                "hosts": hosts,
                "case": name,
                "ranks": case["ranks"],
                "tiered": tiered,
                "baseline": base_,
            }
            rows.append(
                (
                    hosts,
                    kind,
                    name,
                    case["ranks"],
                    _mib(tiered["local_median"]),
                    _mib(tiered["peers_median"]),
                    _mib(tiered["sent_median"]),
                    _mib(tiered["shared_total"]),
                    _mib(tiered["served"]),
                    _mib(base_["served"]),
                    f"{tiered['served'] / base_['served']:.3f}",
                    f"{tiered['seconds_median']:.2f} / {tiered['seconds_max']:.2f}",
                    f"{base_['seconds_median']:.2f} / {base_['seconds_max']:.2f}",
                    "yes" if tiered["exact"] and base_["exact"] else "NO",
                )
            )
        # per-byte costs on this machine, all ranks together
        world = hosts * args.ranks_per_host
        cost: dict[str, Any] = {"hosts": hosts, "kind": kind, "ranks": world}
        if "plain" in group and kind == "fsdp":  # every byte local, no exchange
            t = summarize(group["plain"]["records"], "tiered")
            cost["local_read_gbps"] = t["local_total"] / t["read_seconds_max"] / 1e9
        for name in ("plain", "all-lost"):
            if name in group:
                b = summarize(group[name]["records"], "baseline")
                cost["redis_gbps"] = b["served"] / b["seconds_max"] / 1e9
                break
        if group.get("probe"):
            probe = group["probe"]
            cost["exchange_gbps"] = (
                sum(p["bytes"] for p in probe) / max(p["seconds"] for p in probe) / 1e9
            )
        costs.append(cost)

    header = (
        "hosts",
        "state",
        "case",
        "ranks",
        "local MiB/rank",
        "peers MiB/rank",
        "sent MiB/rank",
        "shared MiB (kvckpt)",
        "Redis served MiB",
        "baseline Redis MiB",
        "Redis / baseline",
        "s median / max",
        "baseline s median / max",
        "bit-exact",
    )
    table = markdown_table(header, rows)

    def gbps(c: dict[str, Any], key: str) -> str:
        return f"{c[key]:.2f}" if key in c else "-"

    cost_table = markdown_table(
        (
            "hosts",
            "state",
            "ranks",
            "local read GB/s (fsdp plain)",
            "Redis GB/s (baseline)",
            "gloo exchange GB/s",
        ),
        (
            (
                c["hosts"],
                c["kind"],
                c["ranks"],
                gbps(c, "local_read_gbps"),
                gbps(c, "redis_gbps"),
                gbps(c, "exchange_gbps"),
            )
            for c in costs
        ),
    )
    peer_rows, peer_summaries = _peer_rows(peer_results)
    peer_table = markdown_table(
        (
            "hosts",
            "state",
            "K",
            "case",
            "ranks",
            "restored",
            "into Redis MiB, 1st / newest save",
            "to peers MiB, newest save",
            "save s: blocking / copies done",
            "local MiB, all ranks",
            "from other ranks MiB, all ranks",
            "shared MiB (kvckpt)",
            "Redis served MiB",
            "restore s median / max",
            "bit-exact",
        ),
        peer_rows,
    )
    loads = [s[m]["loadavg_max"] for s in summaries.values() for m in ("tiered", "baseline")]
    loads += [s["tiered"]["loadavg_max"] for s in peer_summaries.values()]
    minutes = (time.monotonic() - started) / 60
    machine = (
        f"{platform.machine()} {cpu_name()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, "
        f"torch {torch.__version__}; every host, rank and the redis-server on this one machine "
        f"(loopback); {state_bytes / MIB:.0f} MiB of state, {args.ranks_per_host} rank(s) per "
        f"host, {args.repeats} round(s); highest 1-min loadavg at a restore {max(loads):.2f}; "
        f"{minutes:.1f} min"
    )
    command = "python benchmarks/restore_scale.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    write_report(
        args.out,
        "restore_scale",
        f"{table}\n\nPer-byte costs here (all ranks together):\n\n{cost_table}"
        + (
            f"\n\nWith peers (Tiers(peers=K, shared_every=1000)): per save, what Redis and the "
            f"peers took in; per restore of the newest, where each rank's bytes came "
            f"from:\n\n{peer_table}"
            if peer_rows
            else ""
        ),
        machine,
        {
            "command": command,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "args": vars(args),
            "state_bytes": state_bytes,
            "cases": summaries,
            "peer_cases": peer_summaries,
            "costs": costs,
            "raw": results,
            "raw_peers": peer_results,
        },
    )
    inexact = [
        k for k, s in summaries.items() if not (s["tiered"]["exact"] and s["baseline"]["exact"])
    ]
    inexact += [
        k
        for k, s in peer_summaries.items()
        if not s["tiered"]["exact"] or len(s["tiered"]["restored"]) != 1
    ]
    if inexact:
        print(f"NOT bit-exact: {', '.join(inexact)}", file=sys.stderr)
    return 1 if inexact else 0


if __name__ == "__main__":
    sys.exit(main())
