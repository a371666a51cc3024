"""The engine interface: the few byte-level operations kvckpt needs from a key-value store.

An engine knows nothing of torch or DCP. Keys are ``str``; values are bytes-like. A new backend
is one module with one ``Engine`` subclass, registered under a URL scheme (see ``kvckpt.stores``).
Engines must be picklable (``dcp.async_save`` with a process executor sends the writer to another
process) and must open connections lazily so a pickled engine reconnects on first use.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from . import _copy_ways
from ._copy_ways import NATIVE, NATIVE_WAYS, STREAM, STREAM_MIN_BYTES

#: Anything with the buffer protocol that kvckpt hands to an engine as a value.
BytesLike = bytes | bytearray | memoryview

#: Called with (position in the requested keys, value or None if the key is missing). The view
#: is only valid during the call: engines may hand out zero-copy views into their own memory.
Consumer = Callable[[int, memoryview | None], None]

#: Given the current values of the watched keys, returns the writes to apply atomically:
#: key -> new value, or None to delete the key.
Update = Callable[[list[bytes | None]], Mapping[str, bytes | None]]


class Hasher(Protocol):
    """A streaming hash (``xxhash.xxh3_64()``): the same digest however the bytes are split."""

    def update(self, data: memoryview, /) -> None: ...

    def intdigest(self) -> int: ...


#: ``get_into``'s report that value ``i`` is in its buffer, or ``put_many``'s that it was sent,
#: with its digest (None unhashed).
ValueCallback = Callable[[int, int | None], None]

#: The largest value a built-in engine stores by default (URL option ``part_bytes``), 64 bytes
#: under 4 MiB: a part and its header fill whole units of each engine's memory. redis-server
#: keeps a value with its string header in one allocation, which jemalloc rounds up to its next
#: size class (a 4 MiB value takes 5 MiB, this one 4 MiB); LMDB keeps it in overflow pages
#: after a 16-byte page header (a 4 MiB value takes 1025 pages of 4 KiB, this one 1024). One
#: size everywhere lets ``kvckpt copy`` move parts between engines as they are, checksums and
#: all. Parts that fit the CPU cache let a save hash each one just before it is copied.
DEFAULT_PART_BYTES = 4 * 1024 * 1024 - 64

#: Pieces hashed just after a socket took them, from the CPU cache the kernel's copy left
#: them in. A piece fits in a core's L2 (1 MiB and more on current x86 server cores), and the
#: socket takes it in one ``sendall``: on loopback a send costs the kernel about as much per
#: call as per byte, so smaller pieces slow the save down more than the cache saves
#: (``benchmarks/run.py`` measures the Redis save's checksum cost).
_HASH_PIECE = 1024 * 1024


def copy_and_hash(
    dest: memoryview, src: memoryview, hasher: Hasher, timed: bool = True, into_store: bool = False
) -> int:
    """Copy ``src`` into ``dest`` and return the digest of its bytes, fed to ``hasher``, in one
    pass over memory instead of two. A fresh xxh3 hasher (the format's checksum) may be replaced
    by the compiled loop (``_copy_ways.NATIVE_WAYS``: with ordinary or non-temporal stores,
    prefetching the source ahead or not), which fuses the copy and the hash stripe by stripe
    and leaves ``hasher`` untouched; otherwise each cache-sized piece of the source is hashed
    just before it is copied: the hash streams the piece from memory into the CPU's cache,
    where the copy then reads it (``benchmarks/run.py`` measures the cost; a save to LMDB
    hashes each value on a second thread while LMDB copies it, ``_parallel.HashesAlongside``).
    The way and the piece size are the process's ``COPY_HASH_WAY``, chosen by timing its first
    verified values (``timed=False``: a copy that is not one of two alike running at once,
    whose time would mislead the choice, uses the way without timing it); a copy into a store
    (``into_store``, a save) uses ``SAVE_COPY_HASH_WAY``, chosen apart. Every way releases the
    GIL (the native loop, numpy's copy, xxhash), so several threads can run it at once."""
    choice = _copy_ways.SAVE_COPY_HASH_WAY if into_store else _copy_ways.COPY_HASH_WAY
    native = _copy_ways.NATIVE_COPY_HASH
    usable = native is not None and _fresh_xxh3(hasher)
    # Values the native loop cannot copy are not timed where it is a candidate: its turns
    # would go unrecorded and the choice would never be made.
    timable = timed and (usable or NATIVE not in choice.candidates)
    trying = choice.trial(src.nbytes) if timable else None
    way = trying or choice.way()
    if way in NATIVE_WAYS and not usable:
        way = _copy_ways.DEFAULT
    started = time.perf_counter()
    if way in NATIVE_WAYS and native is not None:  # (usable: it is not None)
        stream, prefetch = NATIVE_WAYS[str(way)]
        digest = native(dest, src, stream and src.nbytes >= STREAM_MIN_BYTES, prefetch)
    else:
        out, into = np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8)
        size = int(way)
        for start in range(0, into.size, size):
            piece = into[start : start + size]
            hasher.update(piece.data)
            np.copyto(out[start : start + size], piece)
        digest = hasher.intdigest()
    if trying is not None:
        choice.record(trying, src.nbytes, time.perf_counter() - started)
    return digest


def copy_into(
    dest: memoryview, src: memoryview, timed: bool = True, into_store: bool = False
) -> None:
    """Copy ``src`` into ``dest`` (the same number of bytes), unverified: with numpy's copy or,
    for a value of ``STREAM_MIN_BYTES`` or more, the compiled copy with non-temporal stores,
    whichever the process's ``COPY_WAY`` (``SAVE_COPY_WAY`` with ``into_store``) chose by
    timing its first values (not this one's, with ``timed=False``). Releases the GIL."""
    choice = _copy_ways.SAVE_COPY_WAY if into_store else _copy_ways.COPY_WAY
    stream = _copy_ways.NATIVE_STREAM_COPY
    trying = choice.trial(src.nbytes) if timed else None
    way = trying or choice.way()
    started = time.perf_counter()
    if way == STREAM and stream is not None and src.nbytes >= STREAM_MIN_BYTES:
        stream(dest, src)
    else:
        np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    if trying is not None:
        choice.record(trying, src.nbytes, time.perf_counter() - started)


#: The digest of no bytes: a hasher that gives it is fresh (nothing fed, seed 0).
_XXH3_EMPTY = xxhash.xxh3_64_intdigest(b"")


def _fresh_xxh3(hasher: Hasher) -> bool:
    """Whether ``hasher`` is a new XXH3-64 with seed 0, whose digest the native loop gives."""
    return type(hasher) is xxhash.xxh3_64 and hasher.intdigest() == _XXH3_EMPTY


def hashed_pieces(view: memoryview, hasher: Hasher) -> Iterator[memoryview]:
    """``view`` in cache-sized pieces, each hashed once it has been handed on (to a socket),
    from the cache the kernel's copy read it into: no second pass over memory, and no worker
    thread taking a core from a Redis server on the same node. Hashing after the send, not
    before, leaves the read from memory to the kernel's copy and lets the hash run from the
    cache (``benchmarks/run.py`` measures what hashing costs a save). The digest is complete once
    the last piece has been handed on and the iterator asked for the next."""
    for start in range(0, view.nbytes, _HASH_PIECE):
        piece = view[start : start + _HASH_PIECE]
        yield piece
        hasher.update(piece)


@dataclass(frozen=True)
class StoreUsage:
    """A store's memory (``Engine.usage``)."""

    #: Bytes the store holds now (LMDB: its pages in use; Redis: ``used_memory``)
    used_bytes: int | None
    #: The most it can hold (LMDB: its file plus the filesystem's free space; Redis:
    #: ``maxmemory``), or None where nothing but the host's memory limits it
    limit_bytes: int | None
    #: Where the limit comes from, in words
    limit_from: str = ""


class Engine(ABC):
    """A key-value store as kvckpt uses it.

    Capability attributes (class or instance):

    - ``max_value_bytes``: the largest value one key holds. Larger items are split into parts of
      this size by the format layer, so every engine gets values it can store.
    - ``shared``: whether other nodes see the same data (Redis) or only this node (LMDB).
    - ``supports_ttl``: whether ``expire_at`` works (keys that expire by themselves).
    - ``checksums_by_default``: whether saves record, and loads verify, a checksum per value
      unless the user says otherwise (on where it costs little next to the transfer).
    - ``zero_copy_reads``: whether ``get_many`` hands out views of the store's own memory. A
      value bound for a GPU is then copied there straight from the store; without it, it is
      read into a host buffer through ``get_into`` (a socket's fast path) and copied from there.
    - ``reuses_values``: whether ``retire_values`` keeps retired values under spare names,
      ``make_spares`` makes spares ahead of a save, and ``put_many`` takes ``spare_of`` and
      writes into a spare's memory in place (Redis: fresh server memory is what makes a save
      slow).
    - ``read_leases``: whether reads take a read lease (the default; URL option
      ``read_lease=0`` turns it off), which holds off retention while they run.
    - ``hashes_while_writing``: whether ``put_many`` takes ``on_value`` and ``hasher`` and hashes
      each value as it sends it. Saves that record checksums then leave the hashing to the
      engine; without it they hash on a worker thread, which costs a second pass over memory
      and a core that a Redis server on the same node may need.
    - ``hashes_inline``: whether that hashing runs on the thread that sends (Redis), so that it
      adds to the save's time. A save then measures it, and where it took more than a tenth of
      the write and a core is free, the later saves to the store hash on a worker thread
      (``kvckpt.writer``). LMDB hashes one value ahead on a thread of its own instead.
    - ``server_on_node``: whether the store's server runs on this node (a Redis on loopback or
      a Unix socket), where it takes a core of its own while a save writes: that core is not
      free to hash on.
    """

    max_value_bytes: int = 1 << 30
    shared: bool = False
    supports_ttl: bool = False
    checksums_by_default: bool = False
    zero_copy_reads: bool = False
    reuses_values: bool = False
    hashes_while_writing: bool = False
    hashes_inline: bool = False
    server_on_node: bool = False
    read_leases: bool = True

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL this engine was opened from, with any password masked: safe to log."""

    @property
    @abstractmethod
    def prefix(self) -> str:
        """The namespace prefix under which kvckpt keeps every key of this store."""

    @abstractmethod
    def put_many(
        self,
        items: Iterable[tuple[str, BytesLike]],
        *,
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
        spare_of: Callable[[str], str] | None = None,
    ) -> None:
        """Store many values, batched or pipelined. Values must not be copied more than once.

        The keyword arguments serve optional capabilities; an engine without the capability
        ignores them, and its callers do the plain thing instead:

        - ``hashes_while_writing``: with a ``hasher`` (a factory of streaming hashes), call
          ``on_value(i, digest)`` for each value ``i`` (its position in ``items``) with the hash
          of its bytes, fed piece by piece as they are sent (again if a dropped connection
          made it send them again), as ``get_into`` does. Without it, the caller hashes.
        - ``reuses_values``: ``spare_of(key)`` names the spare (``retire_values``) whose memory
          the value at ``key`` may be written into in place. Without it, values are new.
        """

    @abstractmethod
    def get_many(self, keys: Sequence[str], consume: Consumer) -> None:
        """Fetch many values in as few round trips as the engine allows, handing each to
        ``consume`` (zero-copy where the engine can)."""

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        on_value: ValueCallback | None = None,
        hasher: Callable[[], Hasher] | None = None,
    ) -> list[int | None]:
        """Read each value into the caller's writable buffer of the expected size.

        Returns each value's actual size (None if the key is missing); where it differs from
        the buffer's length the buffer's content is undefined. ``on_value(i, digest)`` is
        called once value ``i`` is in its buffer, only for values of the buffer's size (again
        for the same ``i`` if a dropped connection made the engine read it again: the last
        call counts). With a ``hasher`` (a factory of streaming hashes, the format's checksum),
        ``digest`` is the hash of the value's bytes, fed piece by piece as they arrive: hashing
        a piece while it is still in the CPU cache costs a fraction of a second pass over the
        whole buffer, which on a loaded machine has no spare core to hide on. Engines that can
        read from the network straight into the buffer override this; the default copies once
        from ``get_many``'s view.
        """
        sizes: list[int | None] = [None] * len(keys)

        def consume(i: int, view: memoryview | None) -> None:
            if view is None:
                return
            sizes[i] = view.nbytes
            if view.nbytes != buffers[i].nbytes:
                return
            if hasher is None:
                copy_into(buffers[i], view)
                digest = None
            else:
                digest = copy_and_hash(buffers[i], view, hasher())
            if on_value is not None:
                on_value(i, digest)

        self.get_many(keys, consume)
        return sizes

    @contextmanager
    def borrow(self, keys: Sequence[str]) -> Iterator[list[memoryview | None]]:
        """The values of ``keys`` (None for a missing key), valid until the block ends.

        A copy to another store sends from these views. Engines with ``zero_copy_reads`` lend
        their own memory, so the copy reads each byte once, straight into the destination; the
        default reads copies (``get_many``). Keep the block short: a store may hold back other
        work while memory is lent (LMDB keeps the pages of a read transaction from reuse)."""
        out: list[memoryview | None] = [None] * len(keys)

        def consume(i: int, view: memoryview | None) -> None:
            out[i] = None if view is None else memoryview(bytes(view))

        self.get_many(keys, consume)
        yield out

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """One small value (metadata), or None if the key does not exist."""

    @abstractmethod
    def scan(self, prefix: str) -> Iterator[str]:
        """Every key starting with ``prefix``, in no particular order."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> int:
        """Delete keys in bounded batches; returns how many existed."""

    @abstractmethod
    def transact(self, watch: Sequence[str], update: Update) -> None:
        """Atomic read-modify-write of a few small keys: reads ``watch``, calls ``update`` with
        their values and applies the returned writes as one atomic operation. If a watched key
        changes in between, the engine retries ``update`` with the new values."""

    def expire_at(self, keys: Iterable[str], when: float) -> None:
        """Make keys expire at Unix time ``when`` (engines with ``supports_ttl``)."""
        raise NotImplementedError(f"{type(self).__name__} does not expire keys")

    def session_id(self) -> str | None:
        """An id that changes when the store loses its memory (a Redis restart); None when the
        store is durable. A save fails rather than commit across a change."""
        return None

    def sync_replicas(self) -> None:  # noqa: B027 - optional hook
        """Block until everything written so far meets the store's replication setting (Redis:
        ``WAIT`` for ``wait_replicas``); raise if it cannot. A save calls it after its data and
        again after its commit."""

    def preflight(self, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Before a save writes ``nbytes``: raise if the store cannot take them safely."""

    def refuse_unsafe(self) -> None:  # noqa: B027 - optional hook
        """Before anything is written (a save's ``preflight`` includes it; a copy, an import,
        ``Tiers``' copies and prefetches call it): raise ``UnsafeStoreError`` where the store
        may lose data silently (a Redis that evicts keys)."""

    def usage(self) -> StoreUsage:
        """The store's memory: what is in use and the most it can use (``kvckpt stats``).
        Read-only; None where the engine cannot tell."""
        return StoreUsage(None, None)

    def reserve(self, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Before ``nbytes`` arrive in many small ``put_many`` calls (a copy between stores,
        batch by batch): make room for all of them now, in one step, so that no batch pays on
        its own (LMDB: sizes its map once and allocates the pages on several threads, where
        each batch would otherwise grow the map and allocate its pages alone). Returns when
        done; the batches' own checks still run."""

    def get_ready(  # noqa: B027 - optional hook
        self, nbytes: int, copies: int | None, node_ranks: int | None = None
    ) -> None:
        """Make room for saves of about ``nbytes`` (this rank's share): called before each save
        writes and after it, so that the next save does not pay for its room while training
        runs. The store will hold ``copies`` such saves at once (``keep_last + 1``), or keeps
        every save (None). ``node_ranks`` processes of this node save shares like it into the
        store (None: every rank of the node, torchrun's ``LOCAL_WORLD_SIZE``; a node-local store
        holds all their shares). Returns at once; an engine does the work on a background thread
        (LMDB: sizes its map once for all the saves it will hold, before the first save writes,
        since growing it after would drop the pages just written from the process's page
        tables; then faults in the pages the next saves will write)."""

    def value_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each value's size in bytes (None if missing), without transferring values where the
        engine can."""
        sizes: list[int | None] = [None] * len(keys)

        def consume(i: int, view: memoryview | None) -> None:
            sizes[i] = None if view is None else view.nbytes

        self.get_many(keys, consume)
        return sizes

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with ``prefix``."""
        return self.delete(self.scan(prefix))

    def retire_values(self, keys: Sequence[tuple[str, str]]) -> int:
        """Remove values that no checkpoint refers to any more (retention's deletes), given as
        (key, spare name) pairs. An engine that ``reuses_values`` keeps each under its spare
        name for a while instead, for the next save to overwrite in place; the others delete
        them. Returns the number of keys removed."""
        return self.delete(key for key, _ in keys)

    def make_spares(  # noqa: B027 - optional hook
        self, values: Sequence[tuple[str, int]], after: str | None = None
    ) -> None:
        """Make spares (named as ``retire_values`` names them) of these (name, bytes) for the
        next save to write over, on a background thread once key ``after`` (the save's commit
        record) exists; returns at once. A writer asks for them after the saves that
        retention will not follow with spares of its own (a job's first ``keep_last`` saves).
        Only engines that ``reuses_values`` make any."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or file handles. The engine may be reopened by using it again."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
