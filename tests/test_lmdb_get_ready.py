"""An LMDB store gets ready for the next save while training runs (``Engine.get_ready``).

After a save, the engine sizes its map once for every save ``keep_last`` keeps and faults the
next saves' pages in on a background thread, so the saves after the first neither remap nor
fault. These tests check the mechanics on a real tmpfs (timings belong to benchmarks/job.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter, latest_checkpoint
from kvckpt.engines import lmdb as lmdb_engine
from kvckpt.engines.lmdb import LMDBEngine, _SharedEnv, close_idle_environments

MIB = 1 << 20

pytestmark = pytest.mark.skipif(
    not lmdb_engine._populate_ok or not Path("/dev/shm").is_dir(), reason="needs Linux tmpfs"
)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvckpt-test-ready-", dir="/dev/shm"))
    if not lmdb_engine._on_tmpfs(str(d)):
        pytest.skip("/dev/shm is not a tmpfs here")
    try:
        yield d
    finally:
        close_idle_environments()
        subprocess.run(["rm", "-rf", str(d)], check=False)


def state(mib: int, value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((mib * MIB // 4,), value), "b": torch.arange(10.0) + value}


def shared_env(path: Path) -> _SharedEnv:
    return _SharedEnv._envs[(os.getpid(), os.path.realpath(path))]


def count_remaps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The map sizes of every remap from now on (each drops the process's page mappings)."""
    remaps: list[int] = []
    set_mapsize = _SharedEnv.set_mapsize
    monkeypatch.setattr(
        _SharedEnv, "set_mapsize", lambda self, size: (remaps.append(size), set_mapsize(self, size))
    )
    return remaps


def wait_populated(shared: _SharedEnv) -> None:
    if shared.populator is not None:
        shared.populator.join(60)
        assert not shared.populator.is_alive()


def test_after_the_first_save_the_map_is_sized_once_and_later_saves_never_remap(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"lmdb://{shm_dir}/store"
    dcp.save(state(64, 0.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="s0")
    shared = shared_env(shm_dir / "store")
    wait_populated(shared)
    # Room for three saves (keep_last + 1) and slack, mapped in this process already.
    assert shared.env.info()["map_size"] >= 3 * 64 * MIB
    assert shared.populated >= 3 * 64 * MIB

    remaps = count_remaps(monkeypatch)
    for i in range(1, 7):
        writer = KVStorageWriter(url, keep_last=2)
        dcp.save(state(64, float(i)), storage_writer=writer, checkpoint_id=f"s{i}")
        wait_populated(shared)
    assert remaps == []
    assert lmdb_engine._populate_ok  # no fault-in failed on the way
    assert latest_checkpoint(url) == "s6"
    out = state(64, -1.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="s6"))
    assert torch.equal(out["w"], state(64, 6.0)["w"]) and torch.equal(out["b"], state(64, 6.0)["b"])


def test_a_new_store_is_sized_before_its_first_save_writes(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The map is sized for every save the store will hold before the first save writes: a
    remap after the write would drop the pages it just mapped, and a later save reusing them
    would fault every one in again."""
    steps: list[str] = []
    monkeypatch.setattr(LMDBEngine, "_put_batch", _record(steps, "write", LMDBEngine._put_batch))
    monkeypatch.setattr(_SharedEnv, "set_mapsize", _record(steps, "remap", _SharedEnv.set_mapsize))
    url = f"lmdb://{shm_dir}/store?map_size=64MiB"  # too small: the save grows it
    dcp.save(state(64, 0.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="s0")
    assert "write" in steps and "remap" not in steps[steps.index("write") :], steps
    assert "remap" in steps  # (it did grow, before the write)
    shared = shared_env(shm_dir / "store")
    assert shared.env.info()["map_size"] >= 3 * 64 * MIB


def test_without_keep_last_the_first_save_does_not_remap_after_it_writes(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no bound on what the store holds, the map is sized before the first save writes
    with room for the next save too: a remap after the write (before the commit) would cost
    the save its time and the next save its page mappings."""
    steps: list[str] = []
    monkeypatch.setattr(LMDBEngine, "_put_batch", _record(steps, "write", LMDBEngine._put_batch))
    monkeypatch.setattr(_SharedEnv, "set_mapsize", _record(steps, "remap", _SharedEnv.set_mapsize))
    url = f"lmdb://{shm_dir}/store?map_size=64MiB"
    dcp.save(state(64, 0.0), storage_writer=KVStorageWriter(url), checkpoint_id="s0")
    assert "write" in steps and "remap" not in steps[steps.index("write") :], steps
    shared = shared_env(shm_dir / "store")
    assert shared.env.info()["map_size"] >= 2 * 64 * MIB


def _record(steps: list[str], name: str, fn: object) -> object:
    def wrapper(*args: object, **kwargs: object) -> object:
        steps.append(name)
        return fn(*args, **kwargs)  # type: ignore[operator]

    return wrapper


def test_a_restarted_process_keeps_the_pages_the_store_got_ready(shm_dir: Path) -> None:
    """LMDB (writemap) truncates its data file to the map size it is opened with, and a map
    smaller than the used pages becomes just the used pages: a restart opening the store with
    the default map size would free every page ``get_ready`` allocated for the next saves,
    which would then allocate them again. The store opens at its file's size instead."""
    url = f"lmdb://{shm_dir}/store?map_size=64MiB"  # the save and get_ready grow it
    dcp.save(state(64, 1.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="a")
    wait_populated(shared_env(shm_dir / "store"))
    data = shm_dir / "store" / "data.mdb"
    before = os.stat(data)
    assert before.st_blocks * 512 >= 3 * 64 * MIB  # allocated past the used pages
    close_idle_environments()
    # a new process (a restarted job) opens the store with the URL's map size
    code = (
        "import torch, torch.distributed.checkpoint as dcp; from kvckpt import KVStorageReader;"
        "sd = {'w': torch.zeros(64 * 2**20 // 4), 'b': torch.zeros(10)};"
        f"dcp.load(sd, storage_reader=KVStorageReader({url!r}, checkpoint_id='a'));"
        "assert float(sd['w'][0]) == 1.0"
    )
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True)
    after = os.stat(data)
    assert after.st_size == before.st_size
    assert after.st_blocks == before.st_blocks


def test_a_remap_never_cuts_the_file_back(shm_dir: Path) -> None:
    """With writemap LMDB truncates the data file to the map size at every remap: a smaller map
    (adopting another process's committed size, or asking for less) would free the pages made
    ready for the next saves, and make a process with a larger map fault (SIGBUS) past the new
    end of the file. A remap never goes below the file's size."""
    url = f"lmdb://{shm_dir}/store?map_size=64MiB"
    dcp.save(state(64, 1.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="a")
    shared = shared_env(shm_dir / "store")
    wait_populated(shared)
    data = shm_dir / "store" / "data.mdb"
    before = os.stat(data)
    assert before.st_size > 2 * 64 * MIB  # room for the next saves, past the used pages
    shared.set_mapsize(64 * MIB)  # asks for less than the file holds
    shared.set_mapsize(0)  # adopts the committed size
    after = os.stat(data)
    assert after.st_size == before.st_size and after.st_blocks == before.st_blocks
    out = state(64, 0.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="a"))
    assert torch.equal(out["w"], state(64, 1.0)["w"])


def test_a_remap_stops_a_background_fault_in_and_forgets_what_was_mapped(shm_dir: Path) -> None:
    url = f"lmdb://{shm_dir}/store"
    dcp.save(state(8, 1.0), storage_writer=KVStorageWriter(url), checkpoint_id="a")
    shared = shared_env(shm_dir / "store")
    wait_populated(shared)
    assert shared.populated > 0
    generation = shared.generation
    shared.set_mapsize(shared.env.info()["map_size"] * 2)
    assert shared.populated == 0 and shared.generation > generation
    with shared.populating(generation) as current:
        assert not current  # a fault-in begun before the remap does nothing more
    out = state(8, 0.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="a"))
    assert torch.equal(out["w"], state(8, 1.0)["w"])


def test_closing_while_faulting_in_waits_for_it(shm_dir: Path) -> None:
    engine = LMDBEngine(str(shm_dir / "store"))
    engine.put_many([("k", b"v" * 1000)])
    engine.get_ready(512 * MIB, 3)  # ~1.6 GiB to fault in: still running when we close
    shared = engine._env
    populator = shared.populator
    engine.close()
    close_idle_environments()
    assert populator is None or not populator.is_alive()
    # The store is intact and opens again.
    assert LMDBEngine(str(shm_dir / "store"), create=False).get("k") == b"v" * 1000


def test_a_save_that_comes_during_a_fault_in_takes_it_over(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that needs pages the background fault-in has not reached yet stops it after its
    current piece and maps them in itself: two fault-ins of the same pages at once contend in
    the kernel and take several times longer than one. The fault-in goes on after the save."""
    active, most = [0], [0]
    lock = threading.Lock()
    populate = lmdb_engine._populate_write

    def slow_populate(*args: object, **kwargs: object) -> bool:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            time.sleep(0.05)  # a slow piece: the next save arrives while one is under way
            return populate(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(lmdb_engine, "_populate_write", slow_populate)
    monkeypatch.setattr(lmdb_engine, "_POPULATE_PIECE", 8 * MIB)
    url = f"lmdb://{shm_dir}/store"
    dcp.save(state(64, 0.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="s0")
    shared = shared_env(shm_dir / "store")
    assert shared.populator is not None and shared.populator.is_alive()
    dcp.save(state(64, 1.0), storage_writer=KVStorageWriter(url, keep_last=2), checkpoint_id="s1")
    assert most[0] == 1  # never two fault-ins at once
    wait_populated(shared)
    assert shared.populated >= 3 * 64 * MIB  # and the store still got ready for the third
    out = state(64, -1.0)
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="s1"))
    assert torch.equal(out["w"], state(64, 1.0)["w"])


def test_no_room_to_spare_means_no_fault_in(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LMDBEngine(str(shm_dir / "store"))
    engine.put_many([("k", b"v")])
    monkeypatch.setattr(LMDBEngine, "_free_bytes", lambda self: 10 * MIB)
    engine.get_ready(64 * MIB, 3)
    shared = engine._env
    assert shared.populator is None
    engine.close()


def test_only_tmpfs_stores_fault_in_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LMDBEngine(str(tmp_path / "store"))
    engine.put_many([("k", b"v")])
    monkeypatch.setattr(LMDBEngine, "_tmpfs", False)
    engine.get_ready(64 * MIB, 3)
    assert engine._env.populator is None
    engine.close()


FORK_WHILE_FAULTING_IN = """
import os, sys, torch, torch.distributed.checkpoint as dcp
from kvckpt import KVStorageWriter, latest_checkpoint
from kvckpt.engines.lmdb import LMDBEngine
url = "lmdb://" + sys.argv[1]
dcp.save({"w": torch.ones(1 << 20)}, storage_writer=KVStorageWriter(url), checkpoint_id="parent")
LMDBEngine(sys.argv[1]).get_ready(512 << 20, 3)   # a long background fault-in
pid = os.fork()
if pid == 0:  # e.g. Megatron's async checkpoint process: it opens the store and writes
    engine = LMDBEngine(sys.argv[1])
    engine.put_many([("child", b"x" * (8 << 20))])
    os._exit(0 if engine.get("child") == b"x" * (8 << 20) else 1)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), latest_checkpoint(url))
"""


def test_a_process_forked_during_a_fault_in_can_save(shm_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_FAULTING_IN, str(shm_dir / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "parent"]


def test_get_ready_is_a_no_op_for_other_engines() -> None:
    """The base hook returns at once, touching nothing: a Redis engine on a port nobody
    listens on does not even try to connect."""
    from kvckpt.engines.redis import RedisEngine

    threads = threading.active_count()
    engine = RedisEngine.from_url("redis://127.0.0.1:1/0")
    assert engine.get_ready(1 << 30, 3) is None
    assert engine._client_obj is None and threading.active_count() == threads


def test_a_copy_into_a_new_store_makes_room_once_for_all_its_batches(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy between stores (``Tiers.prefetch``, replica copies) arrives in small batches; the
    destination reserves room for all of them first, so no batch grows the map or allocates
    its pages on its own."""
    from kvckpt import copying

    src_url, dst_url = f"lmdb://{shm_dir}/src", f"lmdb://{shm_dir}/dst"
    sd = {f"t{i}": torch.full((24 * MIB // 4,), float(i)) for i in range(4)}  # 96 MiB
    dcp.save(sd, storage_writer=KVStorageWriter(src_url), checkpoint_id="c")
    src, dst = LMDBEngine.from_url(src_url), LMDBEngine.from_url(dst_url)
    record = KVStorageReader(src, checkpoint_id="c").read_record()

    remaps = count_remaps(monkeypatch)
    reserved: list[int] = []
    reserve = LMDBEngine.reserve
    monkeypatch.setattr(
        LMDBEngine, "reserve", lambda self, n: (reserved.append(n), reserve(self, n))
    )
    monkeypatch.setattr(copying, "_COPY_BATCH", 16 * MIB)  # several batches
    locations = list(record.locations.values())
    copying.copy_values(src, [dst], "c", record.save_id, locations, lambda: None)

    assert reserved == [sum(loc.nbytes for loc in locations)]
    assert len(remaps) <= 1  # at most the one growth, before the first batch
    assert shared_env(shm_dir / "dst").populated >= 96 * MIB
    for loc in locations:
        for key in loc.keys(dst.prefix, "c", record.save_id):
            assert dst.get(key) is not None


def test_a_job_gets_the_store_ready_before_its_first_save(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVStorageWriter.get_ready(state_dict)`` at the start of a job: the map is sized and the
    pages of the saves keep_last holds are allocated in the background, so the first save
    neither remaps nor allocates."""
    url = f"lmdb://{shm_dir}/store"
    sd = {"model": state(32, 1.0), "optim": {"state": {0: {"m": torch.ones(8 * MIB // 4)}}}}
    size = 32 * MIB + 40 + 8 * MIB
    writer = KVStorageWriter(url, keep_last=2)
    writer.get_ready(sd)  # returns at once; the work is on a background thread
    shared = shared_env(shm_dir / "store")
    wait_populated(shared)
    assert shared.env.info()["map_size"] >= 3 * size
    assert shared.populated >= 3 * size

    remaps = count_remaps(monkeypatch)
    populates: list[int] = []
    populate = lmdb_engine._populate_write
    monkeypatch.setattr(
        lmdb_engine,
        "_populate_write",
        lambda *a, **k: (populates.append(a[2]), populate(*a, **k))[1],
    )
    dcp.save(sd, storage_writer=writer, checkpoint_id="first")
    wait_populated(shared)
    assert remaps == [] and populates == []
    out = {"model": state(32, 0.0), "optim": {"state": {0: {"m": torch.zeros(8 * MIB // 4)}}}}
    dcp.load(out, storage_reader=KVStorageReader(url, checkpoint_id="first"))
    assert torch.equal(out["model"]["w"], sd["model"]["w"])
    assert torch.equal(out["optim"]["state"][0]["m"], sd["optim"]["state"][0]["m"])


def test_a_sole_saver_makes_room_for_its_own_saves_alone(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node-local store makes room for every rank of the node (torchrun's
    ``LOCAL_WORLD_SIZE``), each of which saves its share into it; a writer that saves alone
    (``sole_saver``: one rank saves the whole state, as the Lightning callback does) makes room
    for its own saves only, and allocates none for ranks that never write there."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    sd = state(32, 1.0)
    populated = {}
    for sole in (True, False):
        url = f"lmdb://{shm_dir}/{sole}"
        KVStorageWriter(url, keep_last=1, sole_saver=sole).get_ready(sd)
        shared = shared_env(shm_dir / str(sole))
        wait_populated(shared)
        populated[sole] = shared.populated
    # two saves held (keep_last=1), and slack; four ranks' two saves each by default
    assert 2 * 32 * MIB <= populated[True] < 4 * 2 * 32 * MIB <= populated[False]


def test_tiers_get_the_local_tier_ready(shm_dir: Path, redis_url: str) -> None:
    from kvckpt import Tiers

    tiers = Tiers([f"lmdb://{shm_dir}/local", redis_url], keep_last=1)
    try:
        tiers.get_ready(state(16, 1.0))
        shared = shared_env(shm_dir / "local")
        wait_populated(shared)
        assert shared.populated >= 2 * 16 * MIB
    finally:
        tiers.close()


def test_a_remap_does_not_wait_for_a_reader_that_keeps_reading(shm_dir: Path) -> None:
    """A background copy reads batch after batch, each in a short read transaction. A remap
    waits for the transaction in progress, not for the copy: while it waits, no new read
    begins."""
    engine = LMDBEngine(str(shm_dir / "store"))
    engine.put_many([("k", b"v" * 1000)])
    shared = engine._env
    stop, reading = threading.Event(), threading.Event()

    def copy() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            with shared.reading():
                reading.set()
                time.sleep(0.01)

    copier = threading.Thread(target=copy)
    copier.start()
    try:
        assert reading.wait(10)
        shared.set_mapsize(shared.env.info()["map_size"] * 2)
        assert copier.is_alive()  # the remap came in between the reads
    finally:
        stop.set()
        copier.join(70)
    assert engine.get("k") == b"v" * 1000
    engine.close()


def test_a_thread_holding_a_read_can_read_again_while_a_remap_waits(shm_dir: Path) -> None:
    engine = LMDBEngine(str(shm_dir / "store"))
    engine.put_many([("k", b"v" * 1000)])
    shared = engine._env
    remapped = threading.Event()

    def remap() -> None:
        shared.set_mapsize(shared.env.info()["map_size"] * 2)
        remapped.set()

    with shared.reading():
        remapper = threading.Thread(target=remap)
        remapper.start()
        deadline = time.monotonic() + 10
        while shared._remaps == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert shared._remaps == 1 and not remapped.is_set()
        with shared.reading():  # nested: not held off by the waiting remap
            pass
    remapper.join(10)
    assert remapped.is_set()
    assert engine.get("k") == b"v" * 1000
    engine.close()


def test_the_map_keeps_room_for_the_file_to_grow(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """get_ready's first estimate can be low (plain tensors count as replicated over the
    ranks); the first save's real size then sizes the map with room for LMDB to extend the
    file where freed runs are too short, so that no remap comes in the steady state."""
    monkeypatch.setattr(LMDBEngine, "_populate_upto", lambda *a: None)  # sizes only
    engine = LMDBEngine(str(shm_dir / "store"))
    engine.put_many([("k", b"v" * 1000)])
    engine.get_ready(384 * MIB, 3)  # the estimate before the first save: half the real size
    engine.get_ready(768 * MIB, 3)  # after it: three saves and slack, 2.4 GiB
    target = 3 * 768 * MIB + 768 * MIB // 8 + 64 * MIB
    assert engine._env.env.info()["map_size"] * 2 >= 3 * target
    engine.close()
