"""Copying and hashing on two cores, for an engine whose values are memory (LMDB's map).

A load from LMDB is a memory copy, and checking a checksum on the same thread is a second pass
over the bytes: together they nearly double the load. Both release the GIL (numpy's copy,
xxhash's update), so two threads each hash-and-copy half of the values, and a load that
verifies takes about as long as one copy on one thread. A save into room LMDB reserved in its
map is the same copy the other way (``fill``). Where LMDB copies a value itself, inside its
put (one write transaction, one thread), a second thread hashes each part while LMDB copies
it (``HashesAlongside``): the two read the same bytes at about the same time, and whichever is
behind finds them in the CPU cache.

Threads are started per call rather than pooled: a pool inherited across ``fork`` keeps the
count of a thread the child does not have, and work submitted to it never runs.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from queue import SimpleQueue

import numpy as np

from .base import Hasher, ValueCallback, copy_and_hash, copy_into

#: Below this many bytes a call stays on one thread: starting one costs more than it saves.
_MIN_PARALLEL_BYTES = 4 << 20
#: Unhashed values are split into pieces of this size, so one large value uses both threads.
_COPY_PIECE = 64 << 20
#: Values smaller than this are hashed inline: handing them to a thread costs more.
_INLINE_HASH_BYTES = 1 << 20


def _array(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


def fill(
    sources: Sequence[memoryview | None],
    buffers: Sequence[memoryview],
    jobs: Sequence[int],
    hasher: Callable[[], Hasher] | None,
    on_value: ValueCallback | None,
    timed: bool = True,
    into_store: bool = False,
) -> None:
    """Copy ``sources[i]`` into ``buffers[i]`` for each ``i`` in ``jobs`` (same sizes), on this
    thread and one more, hashing each value as it is copied when there is a ``hasher`` and
    reporting ``on_value(i, digest)`` as each value lands. The largest values go first, so the
    two threads end together. ``timed=False``: the copies' times would not say how fast each
    way copies (buffers whose pages may fault in as they are written), and the process's
    choice of way does not count them. ``into_store``: the buffers are a store's memory (a save),
    whose copy ways the process chooses apart from those of copies out of a store."""
    units: list[tuple[int, int, int]] = []
    for i in sorted(jobs, key=lambda j: -buffers[j].nbytes):
        n = buffers[i].nbytes
        step = max(n, 1) if hasher is not None else _COPY_PIECE
        units.extend((i, a, min(a + step, n)) for a in range(0, max(n, 1), step))
    left = Counter(i for i, _, _ in units)  # pieces of each unhashed value still to copy
    lock = threading.Lock()
    failure: list[BaseException] = []
    queue = iter(units)

    def work() -> None:
        try:
            for i, a, b in queue:  # (next() on a list iterator is atomic under the GIL)
                if failure:
                    return
                source = sources[i]
                assert source is not None  # (jobs name values that exist)
                if hasher is not None:  # (a whole value: a == 0, b == its size)
                    digest: int | None = copy_and_hash(
                        buffers[i], source, hasher(), timed, into_store
                    )
                else:
                    piece = _array(source)[a:b].data
                    copy_into(_array(buffers[i])[a:b].data, piece, timed, into_store)
                    digest = None
                    with lock:
                        left[i] -= 1
                        if left[i]:
                            continue
                if on_value is not None:
                    on_value(i, digest)
        except BaseException as e:
            failure.append(e)

    total = sum(buffers[i].nbytes for i in jobs)
    helper = None
    if total >= _MIN_PARALLEL_BYTES and len(units) > 1:
        helper = threading.Thread(target=work, name="kvckpt-copy", daemon=True)
        helper.start()
    work()
    if helper is not None:
        helper.join()
    if failure:
        raise failure[0]


class HashesAlongside:
    """Hashes each value on a second thread while the engine copies it; small values inline. The
    hash and the copy stream the same bytes at about the same time, so memory is read once and
    the one behind finds them in the CPU cache. Hashing each value before its copy (one value
    ahead) would leave the bytes in the cache longer, for the copy's own stores to evict first:
    where memory's bandwidth binds the copy, a second read of them from memory is what the
    checksum costs (``benchmarks/run.py`` measures what hashing costs a save). ``wait()``
    returns once every value handed over has been reported (``on_value(i, digest)``). One thread
    and a queue per save, not a future per part, whose cost would rival the hashing's."""

    def __init__(self, hasher: Callable[[], Hasher], on_value: ValueCallback) -> None:
        self.hasher = hasher
        self.on_value = on_value
        self._queue: SimpleQueue[tuple[int, memoryview] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: list[BaseException] = []

    def _report(self, i: int, value: memoryview) -> None:
        h = self.hasher()
        h.update(value)
        self.on_value(i, h.intdigest())

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            if not self._failure:
                try:
                    self._report(*job)
                except BaseException as e:
                    self._failure.append(e)

    def alongside(self, i: int, value: memoryview) -> None:
        """Value ``i`` is about to be copied into the store."""
        if value.nbytes < _INLINE_HASH_BYTES:
            self._report(i, value)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="kvckpt-hash", daemon=True)
            self._thread.start()
        self._queue.put((i, value))

    def wait(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._failure:
            raise self._failure[0]


#: ``fill_new_pages`` writes and hashes a value in pieces of this size, so the hash finds each
#: piece in the CPU's cache when ``pwrite`` reads it again.
_WRITE_PIECE = 1 << 20


def fill_new_pages(
    sources: Sequence[memoryview],
    rooms: Sequence[memoryview],
    offsets: Sequence[int],
    fd: int,
    hasher: Callable[[], Hasher] | None,
    on_value: ValueCallback | None,
    map_in: Callable[[memoryview], bool],
) -> None:
    """``fill`` for rooms in a shared file map whose pages are not mapped in yet (a new
    store's first save into a tmpfs), ``rooms[i]`` lying at ``offsets[i]`` of the file open as
    ``fd``.

    A tmpfs page written through the map for the first time costs a fault and zeroing the
    page; ``write()`` into the file copies into the page without either, but takes the file's
    lock, one ``write()`` at a time. So the two threads take the values in turns from one
    queue, each its own way: this thread ``pwrite``s values into the file (hashing each piece
    just before writing it), the other maps a value's pages in (``map_in``) and copies into
    them as ``fill`` does (``benchmarks/run.py`` times the two ways alone and together). A
    value whose pages cannot be mapped (``map_in`` fails: a filesystem without room reports
    EFAULT where a write would raise SIGBUS) is written with ``pwrite``, which reports ENOSPC
    as an ``OSError``."""
    queue = iter(sorted(range(len(rooms)), key=lambda i: -rooms[i].nbytes))
    failure: list[BaseException] = []

    def write(i: int) -> None:
        h = None if hasher is None else hasher()
        source, at = sources[i], offsets[i]
        for a in range(0, source.nbytes, _WRITE_PIECE):
            piece = source[a : a + _WRITE_PIECE]
            if h is not None:
                h.update(piece)
            done = 0
            while done < piece.nbytes:
                done += os.pwrite(fd, piece[done:], at + a + done)
        if on_value is not None:
            on_value(i, None if h is None else h.intdigest())

    def copy(i: int) -> None:
        if not map_in(rooms[i]):
            write(i)
            return
        # (untimed: beside the other thread's write(), this copy's time says little about how
        # the way runs on both threads, which is what the process's choice is for)
        if hasher is not None:
            digest: int | None = copy_and_hash(
                rooms[i], sources[i], hasher(), timed=False, into_store=True
            )
        else:
            copy_into(rooms[i], sources[i], timed=False, into_store=True)
            digest = None
        if on_value is not None:
            on_value(i, digest)

    def work(way: Callable[[int], None]) -> None:
        try:
            for i in queue:  # (next() on a list iterator is atomic under the GIL)
                if failure:
                    return
                way(i)
        except BaseException as e:
            failure.append(e)

    helper = threading.Thread(target=work, args=(copy,), name="kvckpt-copy", daemon=True)
    helper.start()
    work(write)
    helper.join()
    if failure:
        raise failure[0]
