"""LMDB engine: a per-node, memory-mapped store that needs no server.

Why LMDB: readers run on MVCC snapshots and never block the writer; values are read straight
out of the memory map (zero copy); a write transaction makes the metadata commit atomic; freed
pages are reused, so repeated saves into a warm store overwrite memory that is already mapped.

The map grows on demand: before a batch is written the map is enlarged to fit it, and a
``MapFullError`` that still happens is answered by doubling the map and retrying, so it never
reaches the user. Environments are shared per (process, path) (``_lmdb_env``), and on a tmpfs
the pages a save will write are mapped in before it writes (``_pages``). Only writers create a
store: an engine opened with ``create=False`` (every read-only
caller) fails with ``StoreNotFoundError`` where there is none.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lmdb

from ..errors import (
    InvalidURLError,
    ReadOnlyStoreError,
    StoreFullError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from ..urls import (
    DEFAULT_PREFIX,
    parse_bool,
    parse_size,
    reject_unknown_options,
    split_options,
    take_option,
    validate_prefix,
)
from . import _copy_ways, _lmdb_reserve
from ._lmdb_env import _SharedEnv
from ._pages import (
    _POPULATE_MIN_PIECE,
    _POPULATE_PIECE,
    _on_tmpfs,
    _page_up,
    _populate_ok,
    _populate_write,
    _ranks_on_node,
    address_of,
    file_offsets,
    map_in,
)
from ._parallel import HashesAlongside, fill, fill_new_pages
from .base import (
    DEFAULT_PART_BYTES,
    BytesLike,
    Consumer,
    Engine,
    Hasher,
    StoreUsage,
    Update,
    ValueCallback,
)

#: The query options of an LMDB URL.
LMDB_OPTIONS = (
    "prefix",
    "map_size",
    "sync",
    "writemap",
    "part_bytes",
    "txn_bytes",
    "read_lease",
)

_MIB = 1 << 20
_GIB = 1 << 30
#: How many bytes one write transaction carries before it commits (bounds dirty pages);
#: URL option ``txn_bytes``.
_TXN_BYTES = 1 * _GIB
_DELETE_BATCH = 10_000
#: Values this large are written into room reserved in the map (``_lmdb_reserve``), copied and
#: hashed by kvckpt on two threads; smaller ones go through LMDB's put.
_RESERVE_MIN_BYTES = 1 * _MIB


class LMDBEngine(Engine):
    """``lmdb:///abs/dir[?prefix=NAME&map_size=1GiB&sync=1&writemap=1&part_bytes=4194240
    &txn_bytes=1GiB&read_lease=1]``

    A save writes each part of 1 MiB or more into room LMDB reserves for it in the map
    (``_lmdb_reserve``, with ``writemap``): kvckpt copies and hashes it in one pass, the parts
    split over two threads, with the copy way timed on the process's first values. Smaller
    parts, and every part where reserving is not available, are one ``memcpy`` inside LMDB's
    put, hashed alongside on a second thread. glibc copies a part below its non-temporal
    threshold (three quarters of the CPU's shared cache) by reading each destination line into
    the cache before overwriting it; a job whose environment sets
    ``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x3fffc0`` (the default part's
    4194240 bytes) has those copies skip that read (docs/PERFORMANCE.md measures both).
    """

    shared = False
    zero_copy_reads = True
    checksums_by_default = True
    hashes_while_writing = True

    def __init__(
        self,
        path: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        map_size: int = 1 * _GIB,
        sync: bool = True,
        writemap: bool = True,
        part_bytes: int = DEFAULT_PART_BYTES,
        txn_bytes: int = _TXN_BYTES,
        create: bool = True,
        read_lease: bool = True,
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
        self.read_leases = read_lease
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
            part_bytes=take_option(opts, "part_bytes", url, parse_size, DEFAULT_PART_BYTES),
            txn_bytes=take_option(opts, "txn_bytes", url, parse_size, _TXN_BYTES),
            read_lease=take_option(opts, "read_lease", url, parse_bool, True),
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
                self.read_leases,
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

    def _writable_env(self) -> _SharedEnv:
        shared = self._env
        if shared.readonly is not None:
            raise ReadOnlyStoreError(
                f"the LMDB store at {self.path} is open read-only: {shared.readonly} (no write "
                "permission, or a read-only mount). Loads, ls, info, verify and export work; "
                "save, rm and gc need a user who can write the directory."
            )
        return shared

    def close(self) -> None:
        if self._shared is not None and self._pid == os.getpid():
            _SharedEnv.release(self.path, self._shared)
        self._shared = None

    def __del__(self) -> None:
        # No module globals here (contextlib, say): at interpreter exit they may be None
        # already, and the AttributeError would be printed as "Exception ignored in".
        try:
            if self._shared is not None and self._pid == os.getpid():
                _SharedEnv.release_from_finalizer(self.path, self._shared)
            self._shared = None
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
        shared = self._writable_env()
        with shared.write_lock:
            self._grow(shared, nbytes)
            if self._tmpfs:  # elsewhere the pages would be page cache to write back: per batch
                self._preallocate(shared, nbytes)

    def get_ready(self, nbytes: int, copies: int | None, node_ranks: int | None = None) -> None:
        """Make the next save of about ``nbytes`` write into memory that is already allocated and
        mapped, by doing now, on a background thread while training runs, what that save would
        otherwise do on its own path: fault pages in.

        The writer calls it before each save writes and after. Before the first save writes,
        the map is sized for every save the store will hold (``copies * nbytes``, times the
        ``node_ranks`` that save into it) in one step, so no save remaps (a remap drops every
        page from the process's page tables, and the save after it faults in again pages that
        were already there). The map keeps room for the file to grow by half again: where freed
        pages come in runs too short for a value, LMDB extends the file instead, and a remap in
        the steady state would also wait for a background copy's read transaction. The map is
        address space, not memory: the file stays sparse. Then the pages up to that size, plus some
        room for LMDB to grow into when it cannot find a long enough run of freed pages, are
        mapped in with ``MADV_POPULATE_WRITE``, 256 MiB at a time; pages already mapped cost
        nothing. A save that needs pages this thread has not reached yet stops it after its
        current piece and maps them itself (``_preallocate``); the next call goes on. Only on
        a tmpfs with room to spare (where a new page costs a host allocation and zeroing);
        elsewhere the save's own ``_preallocate`` does it.
        """
        if not (self._options["writemap"] and self._tmpfs and _populate_ok and nbytes > 0):
            return
        shared = self._env
        if shared.readonly is not None:
            return
        node = nbytes * (_ranks_on_node() if node_ranks is None else node_ranks)
        slack = node // 8 + 64 * _MIB
        with shared.write_lock:
            end, free, map_size = self._space(shared)
            if copies is None:
                target = end + max(0, node - free) + slack
            else:
                target = max(copies * node, end) + slack
            if 3 * target > 2 * map_size:
                # One step, with room: each remap costs every later save its page mappings.
                # With no bound on what the store holds (no keep_last), room for the next save
                # too: sized for this one alone, the call after its write would remap at once.
                sized_for = target if copies is not None else target + node
                shared.set_mapsize(-(-2 * sized_for // _GIB) * _GIB)
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

    def _preallocate(self, shared: _SharedEnv, nbytes: int, write_new: bool = False) -> bool:
        """Allocate, in the kernel, the file pages LMDB will take from the end of the file.

        Writing through the memory map into pages that do not exist yet costs a page fault per
        4 KiB page (on a VM, far slower than the copy itself); ``fallocate`` creates them in one
        call and ``MADV_POPULATE_WRITE`` maps them. Only the shortfall beyond the free pages
        LMDB can reuse is allocated, so a store in steady state (old checkpoints deleted, pages
        reused) allocates nothing. On a tmpfs with room to spare, ``fallocate`` is skipped:
        there it allocates every page on one thread (the file's lock) and leaves each to be
        zeroed when first mapped, while ``MADV_POPULATE_WRITE`` split over a few threads
        allocates, zeroes and maps them at once, in less time.

        It is also what keeps a full filesystem from killing the process: with ``writemap``,
        LMDB stores into the map directly, and touching a page the filesystem has no room for
        raises SIGBUS. Allocating first turns that into ENOSPC (``fallocate``) or EFAULT
        (``MADV_POPULATE_WRITE``, after which ``fallocate`` runs and reports it), and a clear
        error, before LMDB writes anything.

        ``write_new``: the save writes its values into reserved room itself. Then, on a tmpfs,
        a big save's new pages are allocated with ``fallocate`` and not mapped in: the save
        writes them through the file on one thread (``write()`` copies into a page without
        zeroing it or faulting) and maps in and copies on the other
        (``_parallel.fill_new_pages``), and this returns True.
        """
        if not self._options["writemap"]:
            return False
        start, free, map_size = self._space(shared)
        # The values plus LMDB's own pages (branch pages, page headers, the free list).
        length = min(nbytes + nbytes // 16 + _MIB - free, map_size - start)
        if length <= 0 or shared.populated >= start + length:
            return False  # enough free pages, or get_ready mapped these in already
        big = nbytes >= _POPULATE_MIN_PIECE
        if big:
            # This save maps in the pages it needs now, with every thread; get_ready goes on
            # with the rest after it.
            shared.stop_populating()
            if shared.populated >= start + length:
                return False
        write_new = write_new and big and self._tmpfs
        data_file = os.path.join(self.path, "data.mdb")
        # Mapping a few used pages too (a new store's first two) lets ``populated`` count
        # from the start of the file, so that later writes there know they fault nothing.
        begin = shared.populated if start - shared.populated <= _MIB else start
        # (with room to spare, so that the last room on a filesystem goes through fallocate,
        # which fails without leaving pages allocated)
        if (
            big
            and self._tmpfs
            and not write_new
            and (self._free_bytes() or 0) >= 2 * length
            and _populate_write(data_file, begin, start + length - begin)
        ):
            if shared.populated >= begin:  # (madvise maps whole pages)
                shared.populated = max(shared.populated, _page_up(start + length))
            return False
        try:
            fd = os.open(data_file, os.O_RDWR)
            try:
                os.posix_fallocate(fd, start, length)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._full(nbytes) from None
            return False  # filesystems without fallocate: LMDB faults the pages in itself
        if write_new:
            return True
        if big:
            _populate_write(data_file, start, length)
        return False

    @functools.cached_property
    def _tmpfs(self) -> bool:
        return _on_tmpfs(self.path)

    def usage(self) -> StoreUsage:
        shared = self._env
        end, free, _ = self._space(shared)
        used = end - free
        try:
            held = os.stat(shared.data_file).st_blocks * 512  # allocated, not the sparse length
        except OSError:
            held = end
        room = self._free_bytes()
        where = "tmpfs" if self._tmpfs else "filesystem"
        if room is None:
            return StoreUsage(used, None)
        return StoreUsage(used, held + room, f"its file and the {where}'s free space")

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

    def _write(self, apply: Any, nbytes: int, write_new: bool = False) -> Any:
        """Run ``apply(txn)`` in one write transaction, growing the map until it fits. With
        ``write_new`` (``_preallocate``), ``apply(txn, new_pages)``: whether the pages past the
        end of the file were left for it to create."""
        shared = self._writable_env()
        with shared.write_lock:
            self._grow(shared, nbytes)
            new_pages = self._preallocate(shared, nbytes, write_new)
            for _attempt in range(32):
                try:
                    with shared.env.begin(write=True) as txn:
                        return apply(txn, new_pages) if write_new else apply(txn)
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
        # not reuses_values (spare_of unused): LMDB reuses freed pages by itself
        hashes = None if on_value is None or hasher is None else HashesAlongside(hasher, on_value)
        batch: list[tuple[bytes, memoryview]] = []
        size = first = 0
        try:
            for key, value in items:
                view = memoryview(value)
                batch.append((key.encode(), view))
                size += view.nbytes
                if size >= self.txn_bytes:
                    self._put_batch(batch, size, first, hashes)
                    first += len(batch)
                    batch, size = [], 0
            if batch:
                self._put_batch(batch, size, first, hashes)
        finally:
            if hashes is not None:
                hashes.wait()

    def _put_batch(
        self,
        batch: list[tuple[bytes, memoryview]],
        size: int,
        first: int,
        hashes: HashesAlongside | None,
    ) -> None:
        def apply(txn: lmdb.Transaction, new_pages: bool = False) -> None:
            # (on a retry, values are hashed again: the last report counts)
            reserver = self._reserver(txn)
            reserved: list[tuple[int, memoryview]] = []
            for j, (k, v) in enumerate(batch):
                if reserver is not None and v.nbytes >= _RESERVE_MIN_BYTES:
                    reserved.append((j, reserver.room(k, v.nbytes)))
                    continue
                if hashes is not None:
                    hashes.alongside(first + j, v)
                txn.put(k, v)
            if reserved:
                self._fill_reserved(txn, batch, reserved, first, hashes, new_pages)

        # Values written into reserved room may create the store's new pages themselves, where
        # they are nearly all of the batch (LMDB's put faults each page it writes, one by one).
        large = sum(v.nbytes for _, v in batch if v.nbytes >= _RESERVE_MIN_BYTES)
        write_new = 8 * large >= 7 * size and self._reserver_usable()
        self._write(apply, size + 64 * len(batch), write_new=write_new)

    def _reserver(self, txn: lmdb.Transaction) -> _lmdb_reserve.Reserver | None:
        """Where kvckpt can write values into the map itself: with ``writemap``, where the
        pages LMDB reserves are the map's own."""
        if not self._reserver_usable():
            return None
        return _lmdb_reserve.reserver(self._env.env, txn)

    def _reserver_usable(self) -> bool:
        return bool(self._options["writemap"]) and _lmdb_reserve.usable()

    def _fill_reserved(
        self,
        txn: lmdb.Transaction,
        batch: list[tuple[bytes, memoryview]],
        reserved: list[tuple[int, memoryview]],
        first: int,
        hashes: HashesAlongside | None,
        new_pages: bool,
    ) -> None:
        """Copy each reserved value into its room in the map, hashing it in the same pass, the
        values split over two threads (``fill``; where the room's pages are still to be
        created, ``fill_new_pages``)."""
        sources = [_bytes_view(batch[j][1]) for j, _ in reserved]
        rooms = [room for _, room in reserved]
        hasher, report = None, None
        if hashes is not None:
            hasher, on_value = hashes.hasher, hashes.on_value
            report = lambda i, digest: on_value(first + reserved[i][0], digest)  # noqa: E731
        if not (new_pages and self._fill_new_pages(sources, rooms, hasher, report)):
            choice = _copy_ways.SAVE_COPY_WAY if hasher is None else _copy_ways.SAVE_COPY_HASH_WAY
            timed = choice.chosen is None and self._mapped(rooms)
            fill(sources, rooms, range(len(reserved)), hasher, report, timed, into_store=True)
        key = batch[reserved[0][0]][0]
        if not _lmdb_reserve.confirm(lambda: txn.get(key), sources[0]):
            # Never seen: LMDB's reserved room did not read back as written. Put every value
            # the usual way, over what was reserved, and reserve no more in this process.
            for j, _ in reserved:
                if hashes is not None:
                    hashes.alongside(first + j, batch[j][1])
                txn.put(*batch[j])

    def _mapped(self, rooms: list[memoryview]) -> bool:
        """Whether every room lies in pages this process has mapped in (``populated``), where
        copying into them faults nothing: only such copies time the process's copy ways."""
        offsets = self._file_offsets(rooms)
        return offsets is not None and all(
            at + room.nbytes <= self._env.populated for at, room in zip(offsets, rooms, strict=True)
        )

    def _file_offsets(self, rooms: list[memoryview]) -> list[int] | None:
        """Where each room lies in the store's data file (None where one cannot be found)."""
        return file_offsets(self._env.data_file, [address_of(room) for room in rooms])

    def _fill_new_pages(
        self,
        sources: list[memoryview],
        rooms: list[memoryview],
        hasher: Callable[[], Hasher] | None,
        report: ValueCallback | None,
    ) -> bool:
        """``fill_new_pages`` into rooms whose pages the file does not have yet; False where
        the rooms' places in the file cannot be found (``fill`` then copies as usual)."""
        offsets = self._file_offsets(rooms)
        if offsets is None:
            return False
        fd = os.open(self._env.data_file, os.O_WRONLY | os.O_CLOEXEC)
        try:
            fill_new_pages(sources, rooms, offsets, fd, hasher, report, map_in)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise self._full(sum(s.nbytes for s in sources)) from None
            raise
        finally:
            os.close(fd)
        return True

    def get_many(self, keys: Sequence[str], consume: Consumer) -> None:
        with self._read_txn() as txn:
            for i, key in enumerate(keys):
                # a view of the map: read transactions are begun with buffers=True
                consume(i, txn.get(key.encode()))  # type: ignore[arg-type]

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
    ) -> list[int | None]:
        # One copy out of the map per value, hashed as it is copied, split over two threads.
        sizes: list[int | None] = [None] * len(keys)
        with self._read_txn() as txn:
            views: list[memoryview | None] = [txn.get(k.encode()) for k in keys]  # type: ignore[misc]
            jobs = []
            for i, view in enumerate(views):
                if view is not None:
                    sizes[i] = view.nbytes
                    if view.nbytes == buffers[i].nbytes:
                        jobs.append(i)
            fill(views, buffers, jobs, hasher, on_value)
        return sizes

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


def close_idle_environments(path: str | None = None) -> None:
    """Unmap and close every LMDB environment no engine in this process is using (kvckpt
    keeps a few open so repeated loads and saves find their pages already mapped), or only the
    one at ``path``: before deleting a store's directory, whose memory stays allocated while
    it is mapped, without unmapping the stores still in use (which would make their next save
    or load fault every page in again)."""
    _SharedEnv.close_idle(path)


def _bytes_view(view: memoryview) -> memoryview:
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _rebuild(
    path: str,
    prefix: str,
    options: dict[str, Any],
    part_bytes: int,
    txn_bytes: int,
    create: bool = True,
    read_lease: bool = True,
) -> LMDBEngine:
    return LMDBEngine(
        path,
        prefix=prefix,
        part_bytes=part_bytes,
        txn_bytes=txn_bytes,
        create=create,
        read_lease=read_lease,
        **options,
    )
