"""Getting memory pages ready before a save writes into them.

On a tmpfs every new page costs the kernel an allocation and zeroing. Writing through a memory
map into pages that do not exist yet costs a page fault each, on the save's path; mapping them
in first with ``MADV_POPULATE_WRITE``, in a few threads, does the same work faster, off that
path where it can (``LMDBEngine.get_ready``), and turns a full filesystem into an error instead
of a ``SIGBUS``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

_MIB = 1 << 20

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_populate_ok = sys.platform == "linux"


def _libc_madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise() if _populate_ok else None
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
    madvise = _madvise
    if not _populate_ok or madvise is None:
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
        n = threads or max(1, min(_POPULATE_THREADS, _cpus(), length // _POPULATE_MIN_PIECE))
        page = mmap.PAGESIZE
        piece = -(-length // n // page) * page
        errnos: list[int] = []

        def populate(at: int, size: int) -> None:
            if size > 0 and madvise(start + at, size, _MADV_POPULATE_WRITE) != 0:
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


def mount_of(path: str) -> tuple[str, str, list[str]]:
    """The innermost mount holding ``path``: (mount point, filesystem type, its options), or
    ("", "", []) where ``/proc/self/mounts`` cannot be read."""
    real = os.path.realpath(path)
    best: tuple[str, str, list[str]] = ("", "", [])
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 4:
                    continue
                mnt = fields[1].replace("\\040", " ")
                under = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if under and len(mnt) >= len(best[0]):
                    best = (mnt, fields[2], fields[3].split(","))
    except OSError:
        pass
    return best


def _on_tmpfs(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs (where every new page costs a host allocation, and a
    page first written through a memory map a fault and zeroing it besides)."""
    return mount_of(path)[1] == "tmpfs"


def file_offsets(data_file: str, addresses: Sequence[int]) -> list[int] | None:
    """Where in ``data_file`` each address of this process's writable shared map of it lies
    (from ``/proc/self/maps``: each mapping's start and file offset), or None where one is not
    in such a map."""
    real = os.path.realpath(data_file)
    ranges: list[tuple[int, int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "rw-s" and line.rstrip().endswith(real):
                    start_s, end_s = fields[0].split("-")
                    ranges.append((int(start_s, 16), int(end_s, 16), int(fields[2], 16)))
    except (OSError, ValueError, IndexError):
        return None
    offsets = []
    for address in addresses:
        for start, end, offset in ranges:
            if start <= address < end:
                offsets.append(address - start + offset)
                break
        else:
            return None
    return offsets


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def map_in(view: memoryview) -> bool:
    """Allocate and map the pages under ``view`` (part of a writable shared map) with
    ``MADV_POPULATE_WRITE``: True once they are; False where that failed (no room left on the
    filesystem: EFAULT, not the SIGBUS a write into them would raise; or no such madvise)."""
    if _madvise is None or not _populate_ok or view.nbytes == 0:
        return False
    address = address_of(view)
    start = address - address % mmap.PAGESIZE
    return bool(_madvise(start, address + view.nbytes - start, _MADV_POPULATE_WRITE) == 0)
