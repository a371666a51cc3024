"""LMDB engine: a per-node, memory-mapped store that needs no server.

Why LMDB: readers run on MVCC snapshots and never block the writer; values are read straight
out of the memory map (zero copy); a write transaction makes the metadata commit atomic; freed
pages are reused, so repeated saves into a warm store overwrite memory that is already mapped.

The map grows on demand: before a batch is written the map is enlarged to fit it, and a
``MapFullError`` that still happens is answered by doubling the map and retrying, so it never
reaches the user. LMDB forbids opening one environment twice in a process, so environments are
shared per (process, path) and reference-counted; each open checks that the directory still
holds the data file the shared environment maps (a wiped directory is not read from the old
mapping). Only writers create a store: an engine opened with ``create=False`` (every read-only
caller) fails with ``StoreNotFoundError`` where there is none.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lmdb

from ..errors import InvalidURLError, StoreFullError, StoreNotFoundError, StoreUnavailableError
from ..urls import (
    DEFAULT_PREFIX,
    parse_bool,
    parse_size,
    reject_unknown_options,
    split_options,
    take_option,
    validate_prefix,
)
from .base import BytesLike, Consumer, Engine, Hasher, Update, ValueCallback

#: The query options of an LMDB URL.
LMDB_OPTIONS = ("prefix", "map_size", "sync", "writemap", "part_bytes", "txn_bytes")

_MIB = 1 << 20
_GIB = 1 << 30
#: How many bytes one write transaction carries before it commits (bounds dirty pages);
#: URL option ``txn_bytes``.
_TXN_BYTES = 1 * _GIB
_DELETE_BATCH = 10_000
#: Environments kept open (mapped, pages warm) after the last engine using them let go.
_KEEP_IDLE = 8


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_populate_ok = sys.platform == "linux"
#: Threads that map pages in at once: the kernel allocates, zeroes and maps each page, and
#: several threads do that in parallel (on a tmpfs, two threads take about half the time).
_POPULATE_THREADS = 4
_POPULATE_MIN_PIECE = 64 * _MIB
#: A background fault-in (``get_ready``) maps this much at a time, checking between pieces
#: whether a save needs to remap.
_POPULATE_PIECE = 256 * _MIB


def _page_up(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _ranks_on_node() -> int:
    """How many ranks of this job share the node's store (torchrun's ``LOCAL_WORLD_SIZE``)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _populate_write(data_file: str, offset: int, length: int, threads: int = 0) -> bool:
    """Map ``length`` bytes of LMDB's writable memory map at ``offset`` into this process's
    page tables with ``madvise(MADV_POPULATE_WRITE)`` (split over a few threads) instead of
    one fault per page as LMDB writes. Where the file has holes there (a tmpfs file not
    ``fallocate``d), this allocates the pages too, and a filesystem without room makes it fail
    with EFAULT, not SIGBUS. True if every page is allocated and mapped; False if not (other
    systems, old kernels, no room, anything off), and then LMDB's writes fault pages in.
    ``threads``: how many threads share the work (0: as many as pay off here)."""
    global _populate_ok
    if not _populate_ok:
        return False
    real = os.path.realpath(data_file)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if line.rstrip().endswith(real) and "rw" in line.split()[1]:
                    start_s, end_s = line.split()[0].split("-")
                    start, end = int(start_s, 16), int(end_s, 16)
                    break
            else:
                return False
        length = min(length, end - start - offset)
        if length <= 0:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        n = threads or max(1, min(_POPULATE_THREADS, _cpus(), length // _POPULATE_MIN_PIECE))
        page = mmap.PAGESIZE
        piece = -(-length // n // page) * page
        errnos: list[int] = []

        def populate(at: int, size: int) -> None:
            if size > 0 and libc.madvise(start + at, size, _MADV_POPULATE_WRITE) != 0:
                errnos.append(ctypes.get_errno())

        pieces = [(offset + i * piece, min(piece, length - i * piece)) for i in range(n)]
        workers = [threading.Thread(target=populate, args=p, daemon=True) for p in pieces[1:]]
        for t in workers:
            t.start()
        populate(*pieces[0])
        for t in workers:
            t.join()
        if errnos:
            _populate_ok = not {errno.EINVAL, errno.ENOSYS} & set(errnos)
            return False
        return True
    except (OSError, ValueError, AttributeError):
        _populate_ok = False
        return False


def _on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs (where ``fallocate`` is the expensive part: it
    allocates and zeroes every page, in one thread)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                under = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if under and len(mnt) >= len(best):  # the innermost mount holding the path
                    best, fstype = mnt, fields[2]
    except OSError:
        return False
    return fstype == "tmpfs"


def _data_file_identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the store's data file, None if there is none. While an environment
    is open it holds the file open, so no other file can get the same inode number: a
    different identity means the file was removed or replaced since."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _SharedEnv:
    """One open ``lmdb.Environment`` per (pid, real path), shared by every engine using it."""

    _lock = threading.Lock()
    _envs: dict[tuple[int, str], _SharedEnv] = {}
    _idle: OrderedDict[tuple[int, str], None] = OrderedDict()

    def __init__(self, path: str, map_size: int, sync: bool, writemap: bool) -> None:
        self.writemap = writemap
        self.data_file = os.path.join(path, "data.mdb")
        self.env = lmdb.open(
            path,
            map_size=self._not_below_the_file(map_size),
            subdir=True,
            max_readers=1024,
            writemap=writemap,
            sync=sync,
            metasync=sync,
            readahead=False,
            lock=True,
        )
        self.identity = _data_file_identity(path)
        self.refs = 0
        # Serializes this process's writers.
        self.write_lock = threading.Lock()
        # set_mapsize remaps the file: no read transaction of this process may be open then,
        # or its zero-copy views would point at unmapped memory. Readers count themselves here,
        # and so does a background fault-in (``get_ready``) while it works on the mapping.
        self._readers = 0
        self._populating = 0
        self._cond = threading.Condition()
        #: The first ``populated`` bytes of the file are mapped in this process's page tables
        #: (``MADV_POPULATE_WRITE``): writes there fault nothing. A remap resets it to 0.
        self.populated = 0
        #: Bumped by every remap and by close: a background fault-in started before it stops.
        self.generation = 0
        self.populator: threading.Thread | None = None

    @contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def populating(self, generation: int) -> Iterator[bool]:
        """Hold off remaps while a background fault-in works on the mapping; yields False (do
        nothing) if the map was remapped or closed since ``generation``."""
        with self._cond:
            if generation != self.generation:
                yield False
                return
            self._populating += 1
        try:
            yield True
        finally:
            with self._cond:
                self._populating -= 1
                self._cond.notify_all()

    def _not_below_the_file(self, size: int) -> int:
        """A map size that never shrinks the data file. With writemap, LMDB truncates the file
        to the map size whenever it maps it (open, ``set_mapsize``), and a map below the used
        pages becomes exactly the used pages. That would free the pages a store got ready for
        its next saves (``get_ready``) at a restart that opened with the default map size, and
        the next saves would allocate them all over again. Worse, another process of
        the node with a larger map (it grew the map and has not committed yet) would get SIGBUS
        writing past the new end of the file. Size 0 (adopt the size another process committed)
        becomes the file's size where that is larger than this process's map: a writemap
        process that grew the map made the file that long, so it is at least the size
        committed, and the file is not cut back to a committed size that is smaller."""
        if not self.writemap:
            return size
        try:
            length = os.path.getsize(self.data_file)
        except OSError:
            return size
        if size == 0:  # (only ever asked of an open environment)
            return length if length > self.env.info()["map_size"] else 0
        return max(size, length)

    def set_mapsize(self, size: int) -> None:
        with self._cond:
            self.generation += 1  # a background fault-in stops after its current piece
            self._cond.wait_for(lambda: self._readers == 0 and self._populating == 0)
            self.env.set_mapsize(self._not_below_the_file(size))
            # A remap is a new mapping: none of its pages are in the page tables yet.
            self.populated = 0

    def close(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.wait_for(lambda: self._populating == 0)
        with contextlib.suppress(lmdb.Error):
            self.env.close()

    @classmethod
    def acquire(cls, path: str, create: bool, **kwargs: Any) -> _SharedEnv:
        """The shared environment of ``path``, opened (and, with ``create``, the directory
        made) if this process has none, or none that maps the data file there now."""
        key = (os.getpid(), os.path.realpath(path))
        with cls._lock:
            shared = cls._envs.get(key)
            identity = _data_file_identity(path)
            if shared is not None and shared.identity != identity:
                # The directory or its data file was removed or replaced (a wipe, an
                # operator's rm -rf) since this process opened it: the environment maps the
                # old file. Nobody gets it again; it closes now if unused, else once its last
                # user lets go (``release``).
                del cls._envs[key]
                cls._idle.pop(key, None)
                if shared.refs == 0:
                    shared.close()
                shared = None
            if shared is None:
                if create:
                    os.makedirs(path, exist_ok=True)
                elif identity is None:
                    raise StoreNotFoundError(
                        f"no LMDB store at {path}: "
                        + (
                            "the directory holds no data.mdb"
                            if os.path.isdir(path)
                            else "the directory does not exist"
                        )
                        + ". Check the path in the URL; only a save creates a store."
                    )
                cls._close_inherited(key)
                shared = cls._envs[key] = cls(path, **kwargs)
                shared.env.reader_check()  # clear slots of readers that died (SIGKILL)
            cls._idle.pop(key, None)
            shared.refs += 1
            return shared

    @classmethod
    def _close_inherited(cls, key: tuple[int, str]) -> None:
        """In a forked child (e.g. Megatron's async checkpoint process), close the parent's
        handle of this environment: LMDB forbids using it after fork, and py-lmdb refuses to
        open an environment that is "already open in this process". Closing the child's copy
        leaves the parent's handle, locks and reader slots alone, *unless* one of the parent's
        threads was inside a transaction at the fork: closing would then end the child's copy
        of that transaction in the shared lock file, unprotecting the parent's read snapshot
        (or its write lock). That case is refused instead."""
        for other in [k for k in cls._envs if k[1] == key[1] and k[0] != key[0]]:
            inherited = cls._envs[other]
            if inherited._readers or inherited.write_lock.locked():
                raise StoreUnavailableError(
                    f"LMDB store {key[1]} was in use by another thread when this process was "
                    "forked from it, so this process cannot open it safely. Fork (e.g. start "
                    "an async save) when no load or save of that store is running, or use the "
                    "spawn start method."
                )
            with contextlib.suppress(lmdb.Error):
                cls._envs.pop(other).env.close()
            cls._idle.pop(other, None)

    @classmethod
    def release(cls, path: str, shared: _SharedEnv) -> None:
        """Drop one reference. An environment nobody uses stays open (up to ``_KEEP_IDLE`` of
        them): reopening would unmap the map and fault every page in again on the next load.
        One that was replaced (its files were removed) closes with its last user."""
        key = (os.getpid(), os.path.realpath(path))
        with cls._lock:
            shared.refs -= 1
            if shared.refs > 0:
                return
            if cls._envs.get(key) is not shared:
                shared.close()
                return
            cls._idle[key] = None
            while len(cls._idle) > _KEEP_IDLE:
                oldest = next(iter(cls._idle))
                del cls._idle[oldest]
                cls._envs.pop(oldest).close()

    @classmethod
    def close_idle(cls, path: str | None = None) -> None:
        """Close every environment no engine is using, or only ``path``'s."""
        real = None if path is None else os.path.realpath(path)
        with cls._lock:
            for key in list(cls._idle):
                if real is None or key[1] == real:
                    del cls._idle[key]
                    cls._envs.pop(key).close()


class LMDBEngine(Engine):
    """``lmdb:///abs/dir[?prefix=NAME&map_size=1GiB&sync=1&writemap=1&part_bytes=1GiB
    &txn_bytes=1GiB]``"""

    shared = False
    zero_copy_reads = True

    def __init__(
        self,
        path: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        map_size: int = 1 * _GIB,
        sync: bool = True,
        writemap: bool = True,
        part_bytes: int = 1 * _GIB,
        txn_bytes: int = _TXN_BYTES,
        create: bool = True,
    ) -> None:
        if not os.path.isabs(path):
            raise InvalidURLError(
                f"LMDB path {path!r} is not absolute: write lmdb:///absolute/dir "
                "(three slashes), e.g. lmdb:///dev/shm/ckpt"
            )
        self.path = path
        self._prefix = validate_prefix(prefix)
        self._options = dict(map_size=map_size, sync=sync, writemap=writemap)
        self.max_value_bytes = part_bytes
        self.txn_bytes = txn_bytes
        #: False for read-only callers: a missing store is an error, never created
        self.create = create
        self._shared: _SharedEnv | None = None
        self._pid = os.getpid()

    @classmethod
    def from_url(cls, url: str, *, create: bool = True) -> LMDBEngine:
        parts, opts = split_options(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidURLError(
                f"LMDB URL {url!r} names a host ({parts.netloc!r}); LMDB is local: write "
                f"lmdb:///absolute/dir"
            )
        kwargs = dict(
            prefix=take_option(opts, "prefix", url, validate_prefix, DEFAULT_PREFIX),
            map_size=take_option(opts, "map_size", url, parse_size, 1 * _GIB),
            sync=take_option(opts, "sync", url, parse_bool, True),
            writemap=take_option(opts, "writemap", url, parse_bool, True),
            part_bytes=take_option(opts, "part_bytes", url, parse_size, 1 * _GIB),
            txn_bytes=take_option(opts, "txn_bytes", url, parse_size, _TXN_BYTES),
        )
        reject_unknown_options(opts, url, "LMDB URL", LMDB_OPTIONS)
        if not parts.path:
            raise InvalidURLError(
                f"LMDB URL {url!r} names no directory: write lmdb:///absolute/dir"
            )
        return cls(parts.path, create=create, **kwargs)

    @property
    def url(self) -> str:
        return f"lmdb://{self.path}?prefix={self._prefix}"

    @property
    def prefix(self) -> str:
        return self._prefix

    def __reduce__(self) -> Any:
        return (
            _rebuild,
            (
                self.path,
                self._prefix,
                self._options,
                self.max_value_bytes,
                self.txn_bytes,
                self.create,
            ),
        )

    # -- environment ----------------------------------------------------------------------

    @property
    def _env(self) -> _SharedEnv:
        if self._shared is None or self._pid != os.getpid():
            try:
                self._shared = _SharedEnv.acquire(self.path, self.create, **self._options)
            except StoreNotFoundError:  # an OSError too (FileNotFoundError): it says it all
                raise
            except (OSError, lmdb.Error) as e:
                raise StoreUnavailableError(
                    f"cannot open LMDB environment at {self.path}: {e}. Check that the "
                    "directory is writable and on a local filesystem (e.g. /dev/shm)."
                ) from e
            self._pid = os.getpid()
        return self._shared

    def close(self) -> None:
        if self._shared is not None and self._pid == os.getpid():
            _SharedEnv.release(self.path, self._shared)
        self._shared = None

    def __del__(self) -> None:
        # No module globals here (contextlib, say): at interpreter exit they may be None
        # already, and the AttributeError would be printed as "Exception ignored in".
        try:  # noqa: SIM105 (see above)
            self.close()
        except Exception:
            pass

    @staticmethod
    def _space(shared: _SharedEnv) -> tuple[int, int, int]:
        """(end of the used part of the file, bytes of free pages LMDB can reuse, map size).
        Free pages are estimated from the page counts LMDB reports."""
        env = shared.env
        info, stat = env.info(), env.stat()
        psize = stat["psize"]
        used = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"] + 2
        end = (info["last_pgno"] + 1) * psize
        free = max(0, info["last_pgno"] + 1 - used) * psize
        return end, free, info["map_size"]

    def _grow(self, shared: _SharedEnv, needed: int) -> None:
        """Enlarge the map so at least ``needed`` more bytes fit (caller holds write_lock)."""
        end, free, map_size = self._space(shared)
        want = end + max(0, needed - free) + needed // 8 + 64 * _MIB
        if want > map_size:
            # Generous: a remap drops this process's page mappings, so every page the next
            # saves reuse would fault in again. The map is virtual; the file stays sparse.
            new = max(2 * want, 2 * map_size)
            shared.set_mapsize(-(-new // _GIB) * _GIB if new > _GIB else new)

    def reserve(self, nbytes: int) -> None:
        """Grow the map and allocate the pages for ``nbytes`` in one step (see
        ``_preallocate``): a copy into a new store arrives in 64 MiB batches, and allocating
        batch by batch on one thread costs several times more than all of it at once on two."""
        if nbytes <= 0:
            return
        shared = self._env
        with shared.write_lock:
            self._grow(shared, nbytes)
            if self._tmpfs:  # elsewhere the pages would be page cache to write back: per batch
                self._preallocate(shared, nbytes)

    def get_ready(self, nbytes: int, copies: int | None) -> None:
        """Make the next save of about ``nbytes`` write into memory that is already allocated and
        mapped, by doing now, on a background thread while training runs, what that save would
        otherwise do on its own path: fault pages in.

        After the first save, the map is sized for every save the store will hold
        (``copies * nbytes``, times the ranks of this node) in one step, so later saves never
        remap (a remap drops every page from the process's page tables: a save after it took
        3x its steady time re-faulting pages that were already there). Then the pages up to
        that size, plus some room for LMDB to grow into when it cannot find a long enough run
        of freed pages, are mapped in with ``MADV_POPULATE_WRITE``, 256 MiB at a time; pages
        already mapped cost nothing. Only on a tmpfs with room to spare (where a new page costs
        a host allocation and zeroing); elsewhere the save's own ``_preallocate`` does it.
        """
        if not (self._options["writemap"] and self._tmpfs and _populate_ok and nbytes > 0):
            return
        shared = self._env
        node = nbytes * _ranks_on_node()
        slack = node // 8 + 64 * _MIB
        with shared.write_lock:
            end, free, map_size = self._space(shared)
            if copies is None:
                target = end + max(0, node - free) + slack
            else:
                target = max(copies * node, end) + slack
            if target > map_size:
                # One step, with room: each remap costs every later save its page mappings.
                shared.set_mapsize(-(-2 * target // _GIB) * _GIB)
            target = _page_up(min(target, shared.env.info()["map_size"]))
            if shared.populated >= target:
                return
            room = self._free_bytes()
            if room is None or room < 2 * max(0, target - end):
                return  # no room to spare: leave the last of the filesystem to the saves
            if shared.populator is not None and shared.populator.is_alive():
                return  # one at a time; the next save's get_ready carries on
            shared.populator = threading.Thread(
                target=self._populate_upto,
                args=(shared, target, shared.generation),
                name="kvckpt-lmdb-get-ready",
                daemon=True,
            )
            shared.populator.start()

    def _populate_upto(self, shared: _SharedEnv, target: int, generation: int) -> None:
        data_file = os.path.join(self.path, "data.mdb")
        while shared.populated < target:
            at = shared.populated
            size = min(_POPULATE_PIECE, target - at)
            with shared.populating(generation) as current:
                if not current or not _populate_write(data_file, at, size):
                    return
                shared.populated = max(shared.populated, at + size)

    def _preallocate(self, shared: _SharedEnv, nbytes: int) -> None:
        """Allocate, in the kernel, the file pages LMDB will take from the end of the file.

        Writing through the memory map into pages that do not exist yet costs a page fault per
        4 KiB page (on a VM, far slower than the copy itself); ``fallocate`` creates them in one
        call and ``MADV_POPULATE_WRITE`` maps them. Only the shortfall beyond the free pages
        LMDB can reuse is allocated, so a store in steady state (old checkpoints deleted, pages
        reused) allocates nothing. On a tmpfs with room to spare, ``fallocate`` is skipped: there
        it allocates and zeroes every page in one thread, while ``MADV_POPULATE_WRITE`` split
        over a few threads allocates and maps them at once, in less time.

        It is also what keeps a full filesystem from killing the process: with ``writemap``,
        LMDB stores into the map directly, and touching a page the filesystem has no room for
        raises SIGBUS. Allocating first turns that into ENOSPC (``fallocate``) or EFAULT
        (``MADV_POPULATE_WRITE``, after which ``fallocate`` runs and reports it), and a clear
        error, before LMDB writes anything.
        """
        if not self._options["writemap"]:
            return
        start, free, map_size = self._space(shared)
        # The values plus LMDB's own pages (branch pages, page headers, the free list).
        length = min(nbytes + nbytes // 16 + _MIB - free, map_size - start)
        if length <= 0 or shared.populated >= start + length:
            return  # enough free pages, or get_ready mapped these in already
        data_file = os.path.join(self.path, "data.mdb")
        big = nbytes >= _POPULATE_MIN_PIECE
        # Mapping a few used pages too (a new store's first two) lets ``populated`` count
        # from the start of the file, so that later writes there know they fault nothing.
        begin = shared.populated if start - shared.populated <= _MIB else start
        # (with room to spare, so that the last room on a filesystem goes through fallocate,
        # which fails without leaving pages allocated)
        if (
            big
            and self._tmpfs
            and (self._free_bytes() or 0) >= 2 * length
            and _populate_write(data_file, begin, start + length - begin)
        ):
            if shared.populated >= begin:  # (madvise maps whole pages)
                shared.populated = max(shared.populated, _page_up(start + length))
            return
        try:
            fd = os.open(data_file, os.O_RDWR)
            try:
                os.posix_fallocate(fd, start, length)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._full(nbytes) from None
            return  # filesystems without fallocate: LMDB faults the pages in itself
        if big:
            _populate_write(data_file, start, length)

    @functools.cached_property
    def _tmpfs(self) -> bool:
        return _on_tmpfs(self.path)

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _full(self, nbytes: int) -> StoreFullError:
        free = self._free_bytes()
        room = "" if free is None else f"; the filesystem has {free} bytes free"
        return StoreFullError(
            f"no space left for {nbytes} more bytes in the LMDB store at {self.path}{room}. "
            "Nothing committed was touched. Delete old checkpoints (`kvckpt gc URL "
            "--keep-last N`, or keep_last= on the writer), or put the store on a bigger "
            "filesystem."
        )

    def _write(self, apply: Any, nbytes: int) -> Any:
        """Run ``apply(txn)`` in one write transaction, growing the map until it fits."""
        shared = self._env
        with shared.write_lock:
            self._grow(shared, nbytes)
            self._preallocate(shared, nbytes)
            for _attempt in range(32):
                try:
                    with shared.env.begin(write=True) as txn:
                        return apply(txn)
                except lmdb.MapFullError:
                    shared.set_mapsize(2 * shared.env.info()["map_size"])
                except lmdb.MapResizedError:
                    # Another process grew the map: adopt its size and retry.
                    shared.set_mapsize(0)
                except lmdb.Error as e:
                    # Without writemap a full filesystem surfaces as an I/O error at commit;
                    # the transaction is aborted, so the store is as it was.
                    if self._nearly_full(nbytes):
                        raise self._full(nbytes) from None
                    raise StoreUnavailableError(
                        f"writing to the LMDB store at {self.path} failed: {e}"
                    ) from e
            raise StoreUnavailableError(f"LMDB map at {self.path} could not grow enough")

    def _nearly_full(self, nbytes: int) -> bool:
        free = self._free_bytes()
        return free is not None and free < nbytes + nbytes // 16 + _MIB

    @contextmanager
    def _read_txn(self) -> Iterator[lmdb.Transaction]:
        shared = self._env
        for _attempt in range(3):
            with shared.reading():
                try:
                    txn = shared.env.begin(buffers=True)
                except lmdb.MapResizedError:
                    txn = None  # another process grew the map; adopt its size below
                if txn is not None:
                    with txn:
                        yield txn
                    return
            shared.set_mapsize(0)
        raise StoreUnavailableError(f"LMDB map at {self.path} keeps being resized")

    # -- Engine interface ---------------------------------------------------------------------

    def put_many(
        self,
        items: Iterable[tuple[str, BytesLike]],
        *,
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
        spare_of: Callable[[str], str] | None = None,
    ) -> None:
        # neither hashes_while_writing nor reuses_values: on_value, hasher, spare_of unused
        batch: list[tuple[bytes, BytesLike]] = []
        size = 0
        for key, value in items:
            batch.append((key.encode(), value))
            size += memoryview(value).nbytes
            if size >= self.txn_bytes:
                self._put_batch(batch, size)
                batch, size = [], 0
        if batch:
            self._put_batch(batch, size)

    def _put_batch(self, batch: list[tuple[bytes, BytesLike]], size: int) -> None:
        def apply(txn: lmdb.Transaction) -> None:
            for k, v in batch:
                txn.put(k, v)

        self._write(apply, size + 64 * len(batch))

    def get_many(self, keys: Sequence[str], consume: Consumer) -> None:
        with self._read_txn() as txn:
            for i, key in enumerate(keys):
                # a view of the map: read transactions are begun with buffers=True
                consume(i, txn.get(key.encode()))  # type: ignore[arg-type]

    @contextmanager
    def borrow(self, keys: Sequence[str]) -> Iterator[list[memoryview | None]]:
        with self._read_txn() as txn:
            yield [txn.get(key.encode()) for key in keys]  # type: ignore[misc]

    def get(self, key: str) -> bytes | None:
        with self._read_txn() as txn:
            value = txn.get(key.encode())
            return None if value is None else bytes(value)

    def scan(self, prefix: str) -> Iterator[str]:
        start = prefix.encode()
        keys: list[str] = []
        with self._read_txn() as txn:
            cursor = txn.cursor()
            if cursor.set_range(start):
                for key in cursor.iternext(keys=True, values=False):
                    key = bytes(key)
                    if not key.startswith(start):
                        break
                    keys.append(key.decode())
        return iter(keys)

    def delete(self, keys: Iterable[str]) -> int:
        deleted = 0
        batch: list[bytes] = []

        def apply(txn: lmdb.Transaction) -> int:
            return sum(1 for k in batch if txn.delete(k))

        for key in keys:
            batch.append(key.encode())
            if len(batch) >= _DELETE_BATCH:
                deleted += self._write(apply, 0)
                batch = []
        if batch:
            deleted += self._write(apply, 0)
        return deleted

    def transact(self, watch: Sequence[str], update: Update) -> None:
        def apply(txn: lmdb.Transaction) -> None:
            current = [txn.get(k.encode()) for k in watch]
            writes = update([None if v is None else bytes(v) for v in current])
            for k, v in writes.items():
                if v is None:
                    txn.delete(k.encode())
                else:
                    txn.put(k.encode(), v)

        self._write(apply, 1 * _MIB)


def _reset_lock_after_fork() -> None:
    # Another thread of the parent may have held it at fork; the child has only this thread.
    _SharedEnv._lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_after_fork)


def close_idle_environments(path: str | None = None) -> None:
    """Unmap and close every LMDB environment no engine in this process is using (kvckpt
    keeps a few open so repeated loads and saves find their pages already mapped), or only the
    one at ``path``: before deleting a store's directory, whose memory stays allocated while
    it is mapped, without unmapping the stores still in use (which would make their next save
    or load fault every page in again)."""
    _SharedEnv.close_idle(path)


def _rebuild(
    path: str,
    prefix: str,
    options: dict[str, Any],
    part_bytes: int,
    txn_bytes: int,
    create: bool = True,
) -> LMDBEngine:
    return LMDBEngine(
        path, prefix=prefix, part_bytes=part_bytes, txn_bytes=txn_bytes, create=create, **options
    )
