"""One run of ``benchmarks/run.py``'s cases: the state dict, the stores and the Redis server
every section shares, each section in the order it runs, and the results each records.

The sections: DCP's FileSystemWriter/Reader on /dev/shm and on disk and torch.save/load
(timed in blocks); LMDB's own put and get; saves into a new LMDB store; the same in processes
of their own, with glibc's default memcpy and with non-temporal stores (``store_mode.py``);
every 1 GiB save with its baselines, taking turns; LMDB's steady saves with checksums and
without; LMDB and Redis loads; 10,000 small tensors; ``dcp.async_save`` blocking time; peak
anonymous RSS.
"""

from __future__ import annotations

import argparse
import functools
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import store_mode
import torch
import torch.distributed.checkpoint as dcp
from baselines import NewFileWrites, RawRedis, raw_lmdb_put_steady
from store_mode import new_store_save_times, steady_save
from timing import Cases, peak_anon_rss_delta, rounds_for, settle, take_turns, timed
from workload import MIB, check, make_state_dict, nbytes, tensor_parts, zero, zeros_like

import kvckpt
from kvckpt import KVStorageReader, KVStorageWriter
from kvckpt.engines._pages import mount_of
from kvckpt.engines.lmdb import close_idle_environments
from kvckpt.testing import RedisServer

#: A redis-server whose allocator takes transparent huge pages for its memory: jemalloc asks
#: for them (``thp:always``, read from ``JE_MALLOC_CONF`` where Redis is built with its own
#: jemalloc, from ``MALLOC_CONF`` where it links the system's), and Redis leaves them on for
#: itself (``disable-thp no``; by default it turns them off where the kernel's setting is
#: ``always``). A new value's memory then faults in 2 MiB at a time, not 4 KiB.
HUGE_PAGES_ENV = {"MALLOC_CONF": "thp:always", "JE_MALLOC_CONF": "thp:always"}
HUGE_PAGES_ARGS = ("--disable-thp", "no")
#: An LMDB part size above glibc's non-temporal threshold on current server CPUs (glibc
#: derives it from the CPU's cache sizes): LMDB's copy of a part that large writes around the
#: cache instead of reading each destination line first.
BIG_LMDB_PARTS = "256MiB"


def huge_page_bytes(pid: int) -> int:
    """Bytes of process ``pid``'s anonymous memory in transparent huge pages (0 where the
    kernel reports none)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def huge_tmpfs_option(directory: str) -> str:
    """The ``huge=`` option of the tmpfs ``directory`` lies on (``always`` or ``within_size``);
    exits naming the problem where it is not on one."""
    mnt, fstype, options = mount_of(directory)
    huge = [o.removeprefix("huge=") for o in options if o.startswith("huge=")]
    if fstype != "tmpfs" or not huge or huge[0] not in ("always", "within_size"):
        raise SystemExit(
            f"--huge-tmpfs {directory}: not on a tmpfs of huge pages ({fstype or 'no mount'} at "
            f"{mnt or '?'}, options {','.join(options) or '-'}). Mount one, as root: "
            "mount -t tmpfs -o size=8g,huge=within_size tmpfs DIR"
        )
    return f"huge={huge[0]}"


def shmem_huge_bytes() -> int:
    """Bytes of tmpfs and shared memory the kernel holds in huge pages (``ShmemHugePages``)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


class Bench:
    """One benchmark run: the state dict, the stores and the Redis server every section
    shares, and the results table each section records into."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.reps = args, args.repeats
        huge_mount = (
            huge_tmpfs_option(args.huge_tmpfs) if getattr(args, "huge_tmpfs", None) else None
        )
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.shm = shm
        self.scratch = Path(tempfile.mkdtemp(prefix="kvckpt-bench-", dir=shm))
        self.disk = Path(tempfile.mkdtemp(prefix="kvckpt-bench-", dir=args.disk_dir))
        #: A tmpfs of huge pages (``--huge-tmpfs``), for the first saves, or None
        self.huge_tmpfs = (
            None
            if huge_mount is None
            else Path(tempfile.mkdtemp(prefix="kvckpt-bench-", dir=args.huge_tmpfs))
        )
        redis_dir = Path(tempfile.mkdtemp(prefix="kvckpt-bench-redis-"))
        unix_socket = redis_dir / "redis.sock"
        self.server = RedisServer(
            redis_dir, "--unixsocket", str(unix_socket), "--unixsocketperm", "700"
        )
        self.redis_url = self.server.url()
        self.unix_url = f"unix://{unix_socket}"
        self.client = self.server.client()
        self.results: dict[str, Any] = {}
        if huge_mount is not None:
            self.results["huge_tmpfs_mount"] = huge_mount
        self._seq = iter(range(10**9))
        #: Checkpoint ids that never repeat (saves with keep_last)
        self.ids = (f"c{i}" for i in range(10**9))
        self.sd = make_state_dict(args.size_mib * MIB)
        self.size = nbytes(self.sd)
        self.dest = zeros_like(self.sd)
        print(
            f"state dict: {len(self.sd)} tensors, {self.size / MIB:.0f} MiB; repeats: {self.reps}"
        )
        #: The LMDB store of steady saves (keep_last=1), which the LMDB loads read
        self.steady = f"lmdb://{self.fresh(self.scratch)}"

    def fresh(self, base: Path) -> Path:
        return base / f"d{next(self._seq)}"

    def record(self, name: str, times: list[float], size: int | None = None) -> None:
        size = self.size if size is None else size
        med = statistics.median(times)
        self.results[name] = {"median_s": med, "gbps": size / med / 1e9, "runs_s": times}
        print(
            f"  {name:<28} {size / med / 1e9:7.2f} GB/s  (median {med * 1e3:8.1f} ms)", flush=True
        )

    def record_turns(
        self,
        cases: Cases,
        size: int | None = None,
        after: Callable[[], Any] | None = None,
        repeats: int | None = None,
    ) -> None:
        for name, times in take_turns(cases, repeats or self.reps, after).items():
            self.record(name, times, size)

    def kv_save(self, url: str | Any, **options: Any) -> Callable[[], Any]:
        return lambda: dcp.save(
            self.sd, storage_writer=KVStorageWriter(url, **options), checkpoint_id="r"
        )

    def kv_load(self, url: str, **options: Any) -> Callable[[], Any]:
        return lambda: dcp.load(
            self.dest, storage_reader=KVStorageReader(url, **options), checkpoint_id="r"
        )

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.server.workdir, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)
        if self.huge_tmpfs is not None:
            shutil.rmtree(self.huge_tmpfs, ignore_errors=True)

    # -- the sections, in the order they run ---------------------------------------------

    def dcp_files(self) -> None:
        """DCP's FileSystemWriter / Reader on /dev/shm and on disk, and torch.save / load."""
        sd, dest, reps = self.sd, self.dest, self.reps
        for label, base in (("shm", self.shm), ("disk", self.disk)):
            for threads in (1, 2):
                paths: list[Path] = []
                self.record(
                    f"dcp_fs_{label}_save_t{threads}",
                    timed(
                        functools.partial(self.dcp_save, paths, threads),
                        reps,
                        setup=functools.partial(self.append_fresh, paths, base),
                        teardown=functools.partial(self.remove_last, paths),
                    ),
                )
            saved = self.fresh(base)
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(saved))
            self.record(
                f"dcp_fs_{label}_load",
                timed(functools.partial(self.dcp_load, saved), reps),
            )
            check(sd, dest)
            shutil.rmtree(saved)
        pt = self.scratch / "sd.pt"
        self.record("torch_save_shm", timed(lambda: torch.save(sd, pt), reps))
        self.record("torch_load_shm", timed(lambda: torch.load(pt, weights_only=True), reps))
        pt.unlink()

    def dcp_save(self, paths: list[Path], threads: int) -> None:
        dcp.save(self.sd, storage_writer=dcp.FileSystemWriter(paths[-1], thread_count=threads))

    def dcp_load(self, saved: Path) -> None:
        dcp.load(self.dest, storage_reader=dcp.FileSystemReader(saved))

    def append_fresh(self, paths: list[Path], base: Path) -> None:
        paths.append(self.fresh(base))

    @staticmethod
    def remove_last(paths: list[Path]) -> None:
        shutil.rmtree(paths[-1])

    def raw_lmdb(self) -> None:
        """LMDB's own put and get, with no kvckpt around them."""
        views = [(k, v) for k, v in tensor_parts(self.sd, 1 << 30)]
        envs: list[lmdb.Environment] = []

        def raw_put() -> None:
            with envs[-1].begin(write=True) as txn:
                for k, v in views:
                    txn.put(k, v)

        def new_env() -> None:
            path = self.fresh(self.scratch)
            envs.append(lmdb.open(str(path), map_size=4 * self.size + 64 * MIB, writemap=True))

        def close_env() -> None:
            path = envs[-1].path()
            envs[-1].close()
            shutil.rmtree(path)

        self.record(
            "raw_lmdb_put_new", timed(raw_put, self.reps, setup=new_env, teardown=close_env)
        )
        new_env()
        raw_put()
        dviews = [v for _, v in tensor_parts(self.dest, 1 << 30)]

        def raw_get() -> None:
            with envs[-1].begin(buffers=True) as txn:
                for (k, _), d in zip(views, dviews, strict=True):
                    torch.frombuffer(d, dtype=torch.uint8).copy_(
                        torch.frombuffer(txn.get(k), dtype=torch.uint8)
                    )

        self.record("raw_lmdb_get_copy", timed(raw_get, self.reps))
        close_env()

    def new_store_saves(self) -> None:
        """Ten saves into a new LMDB store with keep_last=2 and no ``get_ready`` call, as a job
        that never asks for it: after its first save the store gets the pages of the next ones
        ready by itself. Once back to back, once with 1 s between saves (the host idle during
        an accelerator's steps; 0.1 s in a run under 256 MiB). The ceiling is LMDB's own put of
        the same parts into a store that holds the two previous copies: one thread's memcpy in
        one write transaction."""
        apart = 1.0 if self.size >= 256 * MIB else 0.1
        for label, gap in (("back_to_back", 0.0), ("gap1", apart)):
            settle()
            times = new_store_save_times(self.sd, self.fresh(self.scratch), gap, self.ids)
            self.record(f"kv_lmdb_new_store_first_{label}", times[:1])
            self.record(f"kv_lmdb_new_store_later_{label}", times[1:])
        part = self.lmdb_part_bytes()
        self.record(
            "raw_lmdb_put_steady",
            raw_lmdb_put_steady(self.sd, self.fresh(self.scratch), part, max(self.reps, 5)),
        )

    def store_mode(self) -> None:
        """The same new-store saves and LMDB's own steady put, each in a process of its own,
        with glibc's default memcpy and with its non-temporal threshold at the part size
        (``GLIBC_TUNABLES``, read at a process's start), the two kinds of process taking turns.

        Below the threshold (three quarters of the shared cache the CPU reports), memcpy's
        stores read every destination line into the cache before writing it: three passes
        over memory per byte copied, where a non-temporal store makes two. The children also
        time steady saves with checksums and without, taking turns: hashing a part reads it
        once more, and what that costs depends on how much of memory's bandwidth the copy
        leaves. They also time glibc's memcpy of the same parts alone: the machine's copy."""
        runs = max(1, self.reps // 3)  # (3 at --repeats 9)
        gap = 1.0 if self.size >= 256 * MIB else 0.0  # (none in a smoke run)
        part = self.lmdb_part_bytes()
        found = store_mode.children(self.scratch, self.args.size_mib, self.reps, gap, part, runs)
        for name, timings in found.items():
            for key, times in timings.items():
                self.record(f"store_mode_{name}_{key}", times)

    def saves_taking_turns(self) -> None:
        """Every save that a ratio compares, taking turns with its baseline, one repeat of each
        per round: kvckpt into LMDB and Redis, the raw-socket SET, DCP's t=1 and t=2, and the
        two ways of writing the same bytes into new memory with nothing around them (the
        ceilings of a first save: ``baselines.NewFileWrites``).

        Cases that start from nothing free their previous data just before (a new LMDB store
        after deleting the previous one, FLUSHDB, a new DCP directory after deleting the
        previous one): on a VM whose fresh-memory timings drift, a figure timed in a block is
        not comparable with one timed minutes later. The steady cases are a training job's
        pattern, the previous checkpoint still there during a save: repeated saves with
        keep_last=1 into a live LMDB store and into Redis database 1, each writing a new
        checkpoint and then deleting the previous one, and DCP's counterpart (a new directory,
        then the previous one deleted, inside the timed save as keep_last's deletion is)."""
        sd, steady, redis_url, flush = self.sd, self.steady, self.redis_url, self.client.flushdb
        first = _FirstStores(self)
        dcp_dirs = _DcpDirs(self)
        steady_redis = self.server.url(db=1)
        # the same server on huge pages, for the save into an empty server
        huge = RedisServer(
            Path(tempfile.mkdtemp(prefix="kvckpt-bench-redis-")),
            *HUGE_PAGES_ARGS,
            env=HUGE_PAGES_ENV,
        )
        huge_client = huge.client()
        try:
            huge_url, flush_huge = huge.url(), huge_client.flushdb
            big_parts_path = self.fresh(self.scratch)
            big_parts = f"lmdb://{big_parts_path}?part_bytes={BIG_LMDB_PARTS}"
            for url in (steady, steady_redis, big_parts):
                for _ in range(2):  # warm up: freed pages exist to be reused
                    self.steady_save(url)()
            raw = RawRedis(self.server.port)
            items = tensor_parts(sd, self.redis_part_bytes())
            thread_hashing = kvckpt.open_store(redis_url)
            thread_hashing.hashes_while_writing = False
            lmdb_part = self.lmdb_part_bytes()
            writes = NewFileWrites(sd, self.scratch / "writes", lmdb_part)
            maps = NewFileWrites(sd, self.scratch / "maps", lmdb_part)
            dcp_dirs.save_keep1()
            cases: Cases = {
                "kv_lmdb_save_first": (first.save, first.next_store),
                "kv_lmdb_save_steady": (self.steady_save(steady), None),
                "kv_lmdb_save_steady_big_parts": (self.steady_save(big_parts), None),
                "dcp_fs_shm_save_t1_turns": (dcp_dirs.save(1), dcp_dirs.next_dir(1)),
                "dcp_fs_shm_save_t2_turns": (dcp_dirs.save(2), dcp_dirs.next_dir(2)),
                "raw_redis_set": (lambda: raw.set_many(items), flush),
                "kv_redis_save": (self.kv_save(redis_url), flush),
                "kv_redis_save_nosum": (self.kv_save(redis_url, checksums=False), flush),
                # checksums hashed on a worker thread while the engine sends (how engines
                # without hashes_while_writing hash)
                "kv_redis_save_sum_thread": (self.kv_save(thread_hashing), flush),
                "kv_redis_unix_save": (self.kv_save(self.unix_url), flush),
                "kv_redis_save_huge_pages": (self.kv_save(huge_url), flush_huge),
                "kv_redis_save_steady": (self.steady_save(steady_redis), None),
                "dcp_fs_shm_save_t1_keep1": (dcp_dirs.save_keep1, None),
                # writing into new memory with nothing around it, each way (baselines.py)
                "new_file_write_t2": (writes.write_t2, writes.next_files),
                "new_file_write_map_t2": (maps.write_map_t2, maps.next_files),
                "new_file_map_copy_t2": (maps.map_copy_t2, maps.next_files),
                "new_file_write_one_t2": (writes.write_one_file_t2, writes.next_files),
                "new_file_map_allocated_copy_t2": (maps.map_copy_t2, maps.next_allocated_files),
            }
            tmpfs = self.huge_tmpfs  # the first saves on a tmpfs of huge pages too
            huge_first = None if tmpfs is None else _FirstStores(self, tmpfs)
            huge_dcp = None if tmpfs is None else _DcpDirs(self, tmpfs)
            if huge_first is not None and huge_dcp is not None:
                cases["kv_lmdb_save_first_huge_tmpfs"] = (huge_first.save, huge_first.next_store)
                cases["dcp_fs_huge_tmpfs_save_t2_turns"] = (huge_dcp.save(2), huge_dcp.next_dir(2))
            self.record_turns(cases)
            if huge_first is not None and huge_dcp is not None:
                # how much of a first save's memory the tmpfs gave it in huge pages
                huge_dcp.drop()
                huge_first.next_store()  # (drops the last turn's store)
                before = shmem_huge_bytes()
                huge_first.save()
                self.results["huge_tmpfs_huge_pages_bytes"] = shmem_huge_bytes() - before
                huge_first.drop()
            writes.drop()
            maps.drop()
            first.drop()
            dcp_dirs.drop()
            self.client.flushall()
            close_idle_environments(str(big_parts_path))
            shutil.rmtree(big_parts_path, ignore_errors=True)
            assert huge.proc is not None
            self.kv_save(huge_url)()  # how much of a save's memory the server got in huge pages
            self.results["redis_huge_pages_bytes"] = huge_page_bytes(huge.proc.pid)
        finally:  # a server outlives this process unless stopped
            huge_client.close()
            huge.stop()
            shutil.rmtree(huge.workdir, ignore_errors=True)

    def save_checksums(self) -> None:
        """Steady saves with checksums (the default) and without, taking turns with each other
        alone, into the LMDB store and into Redis database 1, three times as many rounds as
        other cases: the checksum cost is a difference of milliseconds, which the other saves'
        fresh memory, taking turns in the same rounds, would drown. The cost is the median of
        the rounds' ratios, each of two saves made one after the other. (The Redis save into an
        empty server has its own pair in ``saves_taking_turns``.)"""
        steady_redis = self.server.url(db=1)
        for _ in range(2):  # warm up: values retired by keep_last exist to be reused
            self.steady_save(steady_redis)()
        for engine, url in (("lmdb", self.steady), ("redis", steady_redis)):
            self.record_turns(
                {
                    f"kv_{engine}_save_steady_sum": (self.steady_save(url), None),
                    f"kv_{engine}_save_steady_nosum": (
                        self.steady_save(url, checksums=False),
                        None,
                    ),
                },
                repeats=3 * self.reps,
            )
        self.client.flushall()

    def steady_save(self, url: str, **options: Any) -> Callable[[], Any]:
        return steady_save(self.sd, url, self.ids, **options)

    def redis_part_bytes(self) -> int:
        return int(kvckpt.open_store(self.redis_url).max_value_bytes)

    def lmdb_part_bytes(self) -> int:
        return int(kvckpt.open_store(self.steady).max_value_bytes)

    def lmdb_loads(self) -> None:
        """kvckpt LMDB loads of the steady store's latest checkpoint (saved with checksums, the
        default), checking them (the default) and not."""
        steady, dest = self.steady, self.dest
        latest = kvckpt.latest_checkpoint(steady)

        def load(**options: Any) -> Callable[[], Any]:
            reader = functools.partial(KVStorageReader, steady, **options)
            return lambda: dcp.load(dest, storage_reader=reader(), checkpoint_id=latest)

        self.record_turns(
            {
                "kv_lmdb_load": (load(), lambda: zero(dest)),
                "kv_lmdb_load_noverify": (load(verify=False), lambda: zero(dest)),
            },
            after=lambda: check(self.sd, dest),
            repeats=3 * self.reps,  # the checksum cost: a difference of a few milliseconds
        )
        close_idle_environments()
        shutil.rmtree(steady.removeprefix("lmdb://"))

    def redis_loads(self) -> None:
        """Redis loads: the raw-socket client and kvckpt over TCP and over a Unix socket (a
        Redis on the same node), taking turns."""
        raw, dest = RawRedis(self.server.port), self.dest
        part = self.redis_part_bytes()
        items = tensor_parts(self.sd, part)
        dest_items = [
            (k, d) for (k, _), (_, d) in zip(items, tensor_parts(dest, part), strict=True)
        ]
        raw.set_many(items)  # the raw client's keys and kvckpt's checkpoint, side by side
        self.kv_save(self.redis_url)()
        url = self.redis_url
        self.record_turns(
            {
                "raw_redis_get_into": (lambda: raw.get_into(dest_items), lambda: zero(dest)),
                "kv_redis_load": (self.kv_load(url), lambda: zero(dest)),
                "kv_redis_load_noverify": (self.kv_load(url, verify=False), lambda: zero(dest)),
                "kv_redis_unix_load": (self.kv_load(self.unix_url), lambda: zero(dest)),
            },
            after=lambda: check(self.sd, dest),
            repeats=3 * self.reps,  # the checksum cost, as for LMDB's loads
        )
        self.client.flushall()

    def small_tensors(self) -> None:
        """Many small tensors (10,000 by default): save + load wall time."""
        small = {f"p{i}": torch.rand(1024) for i in range(self.args.small_tensors)}
        small_dest = {k: torch.zeros_like(v) for k, v in small.items()}

        def round_trip(make_writer: Callable[[], Any], make_reader: Callable[[], Any]) -> None:
            dcp.save(small, storage_writer=make_writer(), checkpoint_id=None)
            dcp.load(small_dest, storage_reader=make_reader())

        def kv_round_trip(url: str) -> Callable[[], None]:
            return lambda: round_trip(
                lambda: KVStorageWriter(url, checkpoint_id="s"),
                lambda: KVStorageReader(url, checkpoint_id="s"),
            )

        small_dir: list[Path] = []

        def next_dir() -> None:
            zero(small_dest)
            small_dir.append(self.fresh(self.scratch))

        self.record_turns(
            {
                "small_dcp_fs_shm": (
                    lambda: round_trip(
                        lambda: dcp.FileSystemWriter(small_dir[-1]),
                        lambda: dcp.FileSystemReader(small_dir[-1]),
                    ),
                    next_dir,
                ),
                "small_kv_lmdb": (
                    kv_round_trip(f"lmdb://{self.fresh(self.scratch)}"),
                    lambda: zero(small_dest),
                ),
                "small_kv_redis": (kv_round_trip(self.redis_url), lambda: zero(small_dest)),
            },
            nbytes(small),
            after=lambda: check(small, small_dest),
        )
        self.client.flushall()

    def async_blocking(self) -> None:
        """``dcp.async_save``: time until the call returns (what training waits for).

        The writers take turns, one repeat each, each round starting one writer further along,
        so that drift in the machine's memory state (page cache, a growing store on /dev/shm,
        freed pages handed back to the hypervisor) falls on all of them alike. Staging is
        DCP's copy for every writer; the *_huge writers ask for huge pages on it
        (huge_pages=True, kvckpt/staging.py). Each save starts once the previous one's
        background work is done (``settle``). runs_s[0] is each writer's first save, but for
        the *_cached writers, whose first save allocates the copy they then keep."""
        writers = _AsyncWriters(self)
        # The copies the *_cached writers keep stay allocated from their first save on: made
        # before the rounds, so that the fresh memory they take falls on no other case's save.
        for name in writers.cases:
            if name.endswith("_cached"):
                self._async_save(writers, name)
        blocked: dict[str, list[float]] = {name: [] for name in writers.cases}
        names = list(writers.cases)
        for r in range(rounds_for(self.reps, len(names))):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                blocked[name].append(self._async_save(writers, name))
        writers.close()
        for name, times in blocked.items():
            self.record(name, times)
        self.client.flushall()

    def _async_save(self, writers: _AsyncWriters, name: str) -> float:
        """One ``dcp.async_save`` of writer ``name``, once the previous save's background work
        is done (``settle``), then its upload and the training steps between two saves; the
        seconds it blocked."""
        make_writer, after_save = writers.cases[name]
        writer = make_writer()
        settle()
        t0 = time.perf_counter()
        fut = dcp.async_save(
            self.sd,
            storage_writer=writer,
            checkpoint_id=None,
            async_stager=writers.stagers.get(name),
        )
        blocked = time.perf_counter() - t0
        done: Any = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or Future
        done.result()
        if after_save is not None:
            after_save()
        # The training steps between two saves. Without them the next save's staging races
        # DCP's worker thread, which still holds the previous staged copy for a moment after
        # the future resolves; whether that memory is free to be reused (warm pages) or not
        # (fresh pages, faulted in) decides the next staging time.
        del fut, done, writer
        gc.collect()
        time.sleep(0.25)
        return blocked

    def peak_rss(self) -> None:
        """Peak anonymous RSS above the state dict, one run each."""
        sd, dest, redis_url = self.sd, self.dest, self.redis_url
        rss_lmdb = f"lmdb://{self.fresh(self.scratch)}"
        rss = {
            "kv_lmdb_save": peak_anon_rss_delta(
                lambda: dcp.save(sd, storage_writer=KVStorageWriter(rss_lmdb), checkpoint_id="m")
            ),
            "kv_lmdb_load": peak_anon_rss_delta(
                lambda: dcp.load(dest, storage_reader=KVStorageReader(rss_lmdb), checkpoint_id="m")
            ),
            "kv_redis_save": peak_anon_rss_delta(
                lambda: dcp.save(sd, storage_writer=KVStorageWriter(redis_url), checkpoint_id="m")
            ),
            "kv_redis_load": peak_anon_rss_delta(
                lambda: dcp.load(dest, storage_reader=KVStorageReader(redis_url), checkpoint_id="m")
            ),
        }
        # the safetensors export of the LMDB checkpoint: one batch of at most the largest tensor
        from kvckpt import export_safetensors

        exported = self.fresh(self.scratch)
        rss["kv_safetensors_export"] = peak_anon_rss_delta(
            lambda: export_safetensors(rss_lmdb, "m", exported, prefix="")
        )
        shutil.rmtree(exported)
        self.results["largest_tensor_bytes"] = max(t.nbytes for t in sd.values())
        self.results["rss_delta_bytes"] = rss
        self.results["state_dict_bytes"] = self.size
        self.results["part_bytes_redis"] = self.redis_part_bytes()
        self.results["part_bytes_lmdb"] = self.lmdb_part_bytes()
        for k, v in rss.items():
            print(f"  peak anon RSS above state dict, {k:<14} {v / MIB:8.1f} MiB")


class _FirstStores:
    """The first save into a new LMDB store: each turn gets a new store, after the previous
    one is deleted."""

    def __init__(self, bench: Bench, root: Path | None = None) -> None:
        self.bench, self.urls = bench, list[str]()
        self.root = bench.scratch if root is None else root

    def drop(self) -> None:
        # closing only these stores: unmapping the steady store would make its next save
        # fault every page in again, which a training job's store never does
        for url in self.urls:
            close_idle_environments(url.removeprefix("lmdb://"))
            shutil.rmtree(url.removeprefix("lmdb://"), ignore_errors=True)
        self.urls.clear()

    def next_store(self) -> None:
        self.drop()
        self.urls.append(f"lmdb://{self.bench.fresh(self.root)}")

    def save(self) -> None:
        dcp.save(self.bench.sd, storage_writer=KVStorageWriter(self.urls[-1]), checkpoint_id="c")


class _DcpDirs:
    """DCP's saves that take turns: into a new directory (the previous one deleted just
    before), and keeping one (the previous one deleted after the save, inside the timing)."""

    def __init__(self, bench: Bench, root: Path | None = None) -> None:
        self.bench = bench
        self.root = bench.scratch if root is None else root
        self.turn_dirs: dict[int, list[Path]] = {1: [], 2: []}
        self.keep1_dirs: list[Path] = []

    def next_dir(self, threads: int) -> Callable[[], None]:
        def setup() -> None:
            for old in self.turn_dirs[threads]:
                shutil.rmtree(old, ignore_errors=True)
            self.turn_dirs[threads][:] = [self.bench.fresh(self.root)]

        return setup

    def save(self, threads: int) -> Callable[[], None]:
        return lambda: dcp.save(
            self.bench.sd,
            storage_writer=dcp.FileSystemWriter(self.turn_dirs[threads][-1], thread_count=threads),
        )

    def save_keep1(self) -> None:
        self.keep1_dirs.append(self.bench.fresh(self.bench.scratch))
        dcp.save(
            self.bench.sd, storage_writer=dcp.FileSystemWriter(self.keep1_dirs[-1], thread_count=1)
        )
        for old in self.keep1_dirs[:-1]:
            shutil.rmtree(old)
        del self.keep1_dirs[:-1]

    def drop(self) -> None:
        for old in (*(d for ds in self.turn_dirs.values() for d in ds), *self.keep1_dirs):
            shutil.rmtree(old, ignore_errors=True)


class _AsyncWriters:
    """The writers whose ``dcp.async_save`` blocking time is compared: (make a writer, what
    follows its save) by name, and the stagers some of them reuse."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.dirs: list[Path] = []
        lmdb_url = f"lmdb://{bench.fresh(bench.scratch)}"
        # Staging into one copy reused across saves (it stays in host memory between saves):
        # for DCP, a DefaultStager kept across saves (FileSystemWriter's own
        # cache_staged_state_dict=True pins its copy, which fails on a host without an
        # accelerator); for kvckpt, one writer kept across saves with cache_staged_state_dict.
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dcp_stager = DefaultStager(StagingOptions(False, False, False, False))
        self.stagers = {"async_block_dcp_fs_shm_cached": self.dcp_stager}
        cached = KVStorageWriter(lmdb_url, keep_last=1, cache_staged_state_dict=True)

        def reuse_cached() -> Any:
            cached.reset(next(bench.ids))
            return cached

        def kv(url: str, **options: Any) -> Callable[[], Any]:
            return lambda: KVStorageWriter(
                url, checkpoint_id=next(bench.ids), keep_last=1, **options
            )

        redis_url = bench.redis_url
        self.cases: Cases = {
            "async_block_dcp_fs_shm": (self.fs_writer, self.drop_old_dirs),
            "async_block_kv_lmdb": (kv(lmdb_url), None),
            "async_block_kv_redis": (kv(redis_url), None),
            "async_block_kv_lmdb_huge": (kv(lmdb_url, huge_pages=True), None),
            "async_block_kv_redis_huge": (kv(redis_url, huge_pages=True), None),
            "async_block_dcp_fs_shm_cached": (self.fs_writer, self.drop_old_dirs),
            "async_block_kv_lmdb_cached": (reuse_cached, None),
        }

    def fs_writer(self) -> Any:
        self.dirs.append(self.bench.fresh(self.bench.scratch))
        return dcp.FileSystemWriter(self.dirs[-1])

    def drop_old_dirs(self) -> None:
        # DCP's counterpart of keep_last=1, which frees a kvckpt store's previous checkpoint
        # during the save: the previous directory goes once the save is done (deleting it just
        # before the next DCP save would hand that save's staging copy the pages just freed,
        # warm, which no other writer gets)
        for old in self.dirs[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        del self.dirs[:-1]

    def close(self) -> None:
        self.dcp_stager.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    try:
        bench.dcp_files()
        bench.raw_lmdb()
        bench.new_store_saves()
        bench.store_mode()
        bench.saves_taking_turns()
        bench.save_checksums()
        bench.lmdb_loads()
        bench.redis_loads()
        bench.small_tensors()
        bench.async_blocking()
        bench.peak_rss()
    finally:
        bench.close()
    return bench.results


#: The ratios the report gives: (label, case, baseline, what is compared, target or note).
