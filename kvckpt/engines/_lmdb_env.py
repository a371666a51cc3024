"""LMDB environments shared per (process, path).

LMDB forbids opening one environment twice in a process, so every ``LMDBEngine`` on a path
shares one, reference-counted, and a few stay open after their last engine lets go, so that the
next save or load finds its pages already mapped. Each open checks that the directory still
holds the data file the shared environment maps, so a wiped directory is never read from the
old mapping.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lmdb

from ..errors import StoreNotFoundError, StoreUnavailableError

#: Environments kept open (mapped, pages warm) after the last engine using them let go.
_KEEP_IDLE = 8


def _refused_write(error: BaseException) -> bool:
    """Whether opening an environment failed for want of write access (EACCES, EROFS)."""
    if isinstance(error, lmdb.ReadonlyError | PermissionError):
        return True
    text = str(error).lower()
    return "permission denied" in text or "read-only file system" in text


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
    #: References that garbage-collected engines dropped while another caller held the lock
    #: (``release_from_finalizer``); the lock's next holder releases them.
    _dropped: list[tuple[str, _SharedEnv]] = []

    def __init__(
        self, path: str, map_size: int, sync: bool, writemap: bool, readonly: bool = False
    ) -> None:
        self.writemap = writemap and not readonly
        self.data_file = os.path.join(path, "data.mdb")
        #: Why the environment is open read-only (this process cannot write the directory), or
        #: None: it is open for writing.
        self.readonly: str | None = None
        if readonly:
            # Without write access there is no lock file to register in; a writer with access
            # may still change the store under this reader, which the reads' size and
            # checksum checks catch.
            self.env = lmdb.open(
                path, subdir=True, readonly=True, lock=False, readahead=False, max_readers=1024
            )
            self.readonly = "this process cannot write its directory"
        else:
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
        #: Remaps waiting for the readers to finish. While one waits, no new read transaction
        #: begins (except on a thread that already holds one), so a reader that takes one
        #: short transaction after another (a background copy, batch by batch) cannot keep a
        #: save's remap waiting for the whole copy.
        self._remaps = 0
        self._depth = threading.local()  # this thread's read transactions held
        #: The first ``populated`` bytes of the file are mapped in this process's page tables
        #: (``MADV_POPULATE_WRITE``): writes there fault nothing. A remap resets it to 0.
        self.populated = 0
        #: Bumped by every remap and by close: a background fault-in started before it stops.
        self.generation = 0
        self.populator: threading.Thread | None = None

    @contextmanager
    def reading(self) -> Iterator[None]:
        depth = getattr(self._depth, "n", 0)
        with self._cond:
            if not depth:
                self._cond.wait_for(lambda: not self._remaps)
            self._readers += 1
        self._depth.n = depth + 1
        try:
            yield
        finally:
            self._depth.n = depth
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
            self._remaps += 1  # and no new reader begins meanwhile
            try:
                self._cond.wait_for(lambda: self._readers == 0 and self._populating == 0)
                self.env.set_mapsize(self._not_below_the_file(size))
            finally:
                self._remaps -= 1
                self._cond.notify_all()
            # A remap is a new mapping: none of its pages are in the page tables yet.
            self.populated = 0

    def stop_populating(self) -> None:
        """Stop a background fault-in (``get_ready``) after its current piece, and wait for
        it. A save that needs pages the fault-in has not reached yet maps them in itself, with
        every thread; two fault-ins of the same pages at once take several times longer than
        one, as they contend for the same file's pages in the kernel."""
        with self._cond:
            if self._populating == 0 and (self.populator is None or not self.populator.is_alive()):
                return
            self.generation += 1
            self._cond.wait_for(lambda: self._populating == 0)

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
                shared = cls._envs[key] = cls._open(path, create, **kwargs)
            cls._idle.pop(key, None)
            shared.refs += 1
            cls._release_dropped()
            return shared

    @classmethod
    def _open(cls, path: str, create: bool, **kwargs: Any) -> _SharedEnv:
        """Open for writing; a caller that creates nothing (a load, ``ls``, ``verify``) gets a
        read-only environment where the directory cannot be written (permissions, a read-only
        mount), since reading needs no write access."""
        try:
            shared = cls(path, **kwargs)
        except (OSError, lmdb.Error) as e:
            if create or not _refused_write(e):
                raise
            shared = cls(path, readonly=True, **kwargs)
        else:
            shared.env.reader_check()  # clear slots of readers that died (SIGKILL)
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
        with cls._lock:
            cls._release_locked(path, shared)
            cls._release_dropped()

    @classmethod
    def release_from_finalizer(cls, path: str, shared: _SharedEnv) -> None:
        """``release`` for an engine's ``__del__``. A garbage collection can run it on a thread
        that holds the lock already (inside ``acquire``), where waiting for the lock would
        never end: the reference is left for the lock's next holder to release instead."""
        cls._dropped.append((path, shared))
        if cls._lock.acquire(blocking=False):
            try:
                cls._release_dropped()
            finally:
                cls._lock.release()

    @classmethod
    def _release_dropped(cls) -> None:
        while cls._dropped:
            cls._release_locked(*cls._dropped.pop())

    @classmethod
    def _release_locked(cls, path: str, shared: _SharedEnv) -> None:
        key = (os.getpid(), os.path.realpath(path))
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
            cls._release_dropped()
            for key in list(cls._idle):
                if real is None or key[1] == real:
                    del cls._idle[key]
                    cls._envs.pop(key).close()


def _reset_lock_after_fork() -> None:
    # Another thread of the parent may have held it at fork; the child has only this thread.
    _SharedEnv._lock = threading.Lock()
    _SharedEnv._dropped = []  # the parent's references: the parent releases them


os.register_at_fork(after_in_child=_reset_lock_after_fork)
