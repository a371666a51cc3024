"""The baselines ``benchmarks/run.py`` measures kvckpt against, with no kvckpt around them:
the smallest pipelined Redis client, LMDB's own put, glibc's memcpy of the same parts, the
checksum's speed from the CPU's cache, and the two ways of writing the parts into new memory
(``NewFileWrites``)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import shutil
import socket
import threading
from pathlib import Path

import lmdb
import torch
from timing import timed
from workload import KIB, MIB, nbytes, tensor_parts, zeros_like

from kvckpt.engines._pages import _populate_write, map_in
from kvckpt.engines._parallel import fill_new_pages
from kvckpt.format import new_checksum


class RawRedis:
    """The smallest pipelined RESP client: SET from the caller's memory, GET into a buffer."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray(64 * KIB)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        n = self.sock.recv_into(self.view[self.end :])
        if n == 0:
            raise ConnectionError("redis closed the connection")
        self.end += n

    def _line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            if self.start:
                self.buf[: self.end - self.start] = self.buf[self.start : self.end]
                self.end -= self.start
                self.start = 0
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        have = min(self.end - self.start, len(dest))
        dest[:have] = self.view[self.start : self.start + have]
        self.start += have
        pos = have
        while pos < len(dest):
            pos += self.sock.recv_into(dest[pos:])

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        for key, value in items:
            self.sock.sendall(
                b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
            )
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        for _ in items:
            if self._line() != b"+OK":
                raise RuntimeError("SET failed")

    def get_into(self, items: list[tuple[bytes, memoryview]], read_ahead: int = 16 * MIB) -> None:
        """Pipelined GETs, at most ``read_ahead`` bytes of replies outstanding (at least one).

        Sending every GET at once makes redis-server build all the replies in its output
        buffer before the socket drains it, which more than halves throughput
        (benchmarks/redis_ceiling.py); the best raw client keeps a window, as kvckpt does.
        """
        crlf = memoryview(bytearray(2))
        sent = outstanding = 0
        for i, (_, dest) in enumerate(items):
            group = []
            while sent < len(items) and (
                sent <= i or outstanding + len(items[sent][1]) <= read_ahead
            ):
                group.append(items[sent][0])
                outstanding += len(items[sent][1])
                sent += 1
            if group:
                self.sock.sendall(
                    b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in group)
                )
            header = self._line()
            if int(header[1:]) != len(dest):
                raise RuntimeError(f"unexpected reply {header[:20]!r}")
            self._read_into(dest)
            self._read_into(crlf)
            outstanding -= len(dest)


def raw_lmdb_put_steady(
    sd: dict[str, torch.Tensor], path: Path, part: int, repeats: int
) -> list[float]:
    """Seconds of LMDB's own put of ``sd`` in ``part``-byte values, in one write transaction,
    into a store that holds the two previous copies (their pages freed one save later)."""
    size = nbytes(sd)
    env = lmdb.open(str(path), map_size=8 * size + 64 * MIB, writemap=True, sync=False)
    saves: list[list[bytes]] = []
    generations = itertools.count()

    def put() -> None:
        if len(saves) >= 3:
            with env.begin(write=True) as txn:
                for k in saves.pop(0):
                    txn.delete(k)
        keys, generation = [], next(generations)
        with env.begin(write=True) as txn:
            for k, v in tensor_parts(sd, part):
                key = b"%d/" % generation + k
                txn.put(key, v)
                keys.append(key)
        saves.append(keys)

    for _ in range(3):
        put()
    times = timed(put, repeats)
    env.close()
    shutil.rmtree(path)
    return times


def memcpy_times(sd: dict[str, torch.Tensor], part: int, repeats: int) -> list[float]:
    """Seconds of glibc's memcpy (``memmove``, through ctypes) of ``sd``'s bytes in
    ``part``-byte pieces, one thread, into a destination already in use: the copy LMDB's put
    makes, with nothing around it. glibc reads its non-temporal threshold
    (``GLIBC_TUNABLES``) when the process starts."""
    dest = zeros_like(sd)
    pieces = []
    for name, t in sd.items():
        src, dst, size = t.data_ptr(), dest[name].data_ptr(), t.nbytes
        pieces += [(dst + o, src + o, min(part, size - o)) for o in range(0, size, part)]

    def copy() -> None:
        for to, frm, n in pieces:
            ctypes.memmove(to, frm, n)

    copy()  # the destination's pages are in use, as a store's reused pages are
    times = timed(copy, repeats)
    for name, t in sd.items():
        if not torch.equal(t, dest[name]):
            raise AssertionError(f"memcpy differs at {name}")
    return times


def _hash_times(pieces: list[memoryview], repeats: int) -> tuple[int, list[float]]:
    """Bytes hashed and seconds of each of ``repeats`` runs of the checkpoint format's checksum
    (``kvckpt.format.new_checksum``, xxh3) fed ``pieces`` in turn, one thread."""

    def hash_all() -> None:
        h = new_checksum()
        for piece in pieces:
            h.update(piece)
        h.intdigest()

    hash_all()
    return sum(p.nbytes for p in pieces), timed(hash_all, repeats)


def checksum_from_cache_times(
    repeats: int, piece: int = MIB, total: int = 1 << 30
) -> tuple[int, list[float]]:
    """The checksum fed ``total`` bytes from one ``piece``-byte buffer that stays in the CPU's
    cache (``_hash_times``): the hash's own speed, the part of a verified copy that copying
    cannot hide (a load hashes a piece, then copies it from the cache)."""
    buf = torch.randint(0, 256, (piece,), dtype=torch.uint8).numpy().data
    return _hash_times([buf] * (total // piece), repeats)


def checksum_from_memory_times(
    repeats: int, piece: int = MIB, total: int = 1 << 30
) -> tuple[int, list[float]]:
    """The checksum fed ``total`` bytes in ``piece``-byte pieces of one buffer far larger than
    the CPU's cache (``_hash_times``): what hashing costs a copy that leaves nothing of what it
    read in the cache (a copy with ``rep movsb`` on some x86 CPUs), so that hashing a piece
    first reads it from memory."""
    data = torch.randint(0, 256, (total,), dtype=torch.uint8).numpy().data
    return _hash_times([data[a : a + piece] for a in range(0, total, piece)], repeats)


class NewFileWrites:
    """The two ways of writing a state dict's bytes into memory the kernel has to allocate, with
    no checkpointing library around them, each into a new file on a tmpfs (the previous one
    deleted just before, as the first saves' cases do):

    - ``write_t2``: two threads, each ``pwrite``-ing half of the parts into a file of its own
      (DCP's ``FileSystemWriter`` with two threads, less its serialization and planning): the
      kernel allocates each page inside ``write`` and copies into it.
    - ``write_map_t2``: one file, its pages allocated (``fallocate``) and memory-mapped, the
      parts taken in turns by two threads: one ``pwrite``s them into the file (the kernel
      copies into each page), the other maps each part's pages in with
      ``MADV_POPULATE_WRITE`` (the kernel zeroes and maps each page) and copies into them (an
      LMDB store's first save, less LMDB: ``_parallel.fill_new_pages``, unhashed).

    And three that split the difference between them into its parts:

    - ``map_copy_t2``: one file, memory-mapped, its pages mapped in on two threads with
      ``MADV_POPULATE_WRITE`` (the kernel allocates, zeroes and maps each page), then the parts
      copied in on one thread (an LMDB store's first save where LMDB's put copies the values).

    - ``write_one_file_t2``: ``write_t2`` into one file, each thread writing its half at its
      offset (what a store kept in one file could do with ``write()``: a file takes one
      ``write()`` at a time).
    - ``map_copy_t2`` after ``next_allocated_files``, into a file whose pages are already
      allocated (``fallocate``, untimed): what mapping each page in costs, without allocating
      it.
    """

    def __init__(self, sd: dict[str, torch.Tensor], directory: Path, part: int) -> None:
        self.parts = [v for _, v in tensor_parts(sd, part)]
        self.size = sum(p.nbytes for p in self.parts)
        self.directory = directory
        self.files: list[Path] = []
        self.turn = itertools.count()
        directory.mkdir(parents=True, exist_ok=True)

    def next_files(self) -> None:
        for old in self.files:
            old.unlink(missing_ok=True)
        n = next(self.turn)
        self.files = [self.directory / f"f{n}.{i}" for i in range(2)]

    def drop(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.files = []

    def _halves(self) -> tuple[list[memoryview], list[memoryview], int]:
        """The parts in two lists: the first half of the bytes, then the rest; and the first
        half's size."""
        half, total = [], 0
        for p in self.parts:
            if total >= self.size // 2:
                break
            half.append(p)
            total += p.nbytes
        return half, self.parts[len(half) :], total

    @staticmethod
    def _pwrite(fd: int, parts: list[memoryview], offset: int) -> None:
        for p in parts:
            done = 0
            while done < p.nbytes:
                done += os.pwrite(fd, p[done:], offset + done)
            offset += p.nbytes

    def write_t2(self) -> None:
        half, rest, _ = self._halves()

        def write(path: Path, parts: list[memoryview]) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                self._pwrite(fd, parts, 0)
            finally:
                os.close(fd)

        other = threading.Thread(target=write, args=(self.files[1], rest))
        other.start()
        write(self.files[0], half)
        other.join()

    def write_one_file_t2(self) -> None:
        half, rest, at = self._halves()
        fd = os.open(self.files[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            other = threading.Thread(target=self._pwrite, args=(fd, rest, at))
            other.start()
            self._pwrite(fd, half, 0)
            other.join()
        finally:
            os.close(fd)

    def next_allocated_files(self) -> None:
        """``next_files``, with the first file's pages allocated (``map_copy_t2`` then maps
        them in without allocating them)."""
        self.next_files()
        with open(self.files[0], "w+b") as f:
            os.posix_fallocate(f.fileno(), 0, self.size)

    def write_map_t2(self) -> None:
        path = self.files[0]
        offsets = list(itertools.accumulate((p.nbytes for p in self.parts), initial=0))[:-1]
        with open(path, "w+b") as f:
            os.posix_fallocate(f.fileno(), 0, self.size)
            with mmap.mmap(f.fileno(), self.size) as mm:
                view = memoryview(mm)
                rooms = [view[a : a + p.nbytes] for a, p in zip(offsets, self.parts, strict=True)]
                try:
                    # the routine an LMDB store's first save writes its new pages with
                    fill_new_pages(self.parts, rooms, offsets, f.fileno(), None, None, map_in)
                finally:
                    for room in rooms:
                        room.release()
                    view.release()

    def map_copy_t2(self) -> None:
        path = self.files[0]
        with open(path, "r+b" if path.exists() else "w+b") as f:
            if os.fstat(f.fileno()).st_size != self.size:
                f.truncate(self.size)
            with mmap.mmap(f.fileno(), self.size) as mm:
                # the routine an LMDB store's first save maps its new pages in with
                if not _populate_write(str(path), 0, self.size, threads=2):
                    raise OSError("MADV_POPULATE_WRITE failed (Linux >= 5.14 needed)")
                with memoryview(mm) as view:
                    at = 0
                    for p in self.parts:
                        view[at : at + p.nbytes] = p.cast("B")
                        at += p.nbytes
