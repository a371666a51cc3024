"""Room for a value in LMDB's map, for kvckpt to write the value itself (``MDB_RESERVE``).

``txn.put`` copies each value into the map with LMDB's own ``memcpy``, on one thread, and a
checksummed save reads the value a second time to hash it. With ``MDB_RESERVE`` LMDB allocates
the value's pages and hands back where they are; kvckpt then copies and hashes each value in
one pass (``base.copy_and_hash``: the compiled loop, non-temporal stores where they pay), the
values split over two threads (``_parallel.fill``). ``benchmarks/run.py`` times the two ways
against each other.

py-lmdb has no reserving put. Its extension exports the functions of the two LMDBs it
bundles (0.9 as ``mdb09_*``, 1.0 as ``mdb10_*``, whose structures differ; each environment is
bound to one, ``Environment.lib_version``), and its ``Transaction`` object holds the
``MDB_txn`` pointer they take, at the end of the object (``txn``, ``flags``, ``db``,
``mutations``: 32 bytes on 64-bit builds). This module reads that pointer and uses it only
when the environment's own LMDB confirms it (its ``txn_id`` of the pointer equals
``txn.id()``), and only for an environment opened with ``writemap``, where the pages LMDB
reserves are the map's own and stay put until the transaction ends. A process's first
reserved value is read back through py-lmdb and compared with what was written before any
more is trusted (``confirm``). Anything else (a py-lmdb without these functions, another
platform, ``KVCKPT_LMDB_RESERVE=0``) and the engine puts as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

import lmdb

_MDB_RESERVE = 0x10000
#: LMDB's main database (``MAIN_DBI``), the one kvckpt's stores use.
_MAIN_DBI = 1
#: The fields of py-lmdb's TransObject after ``MDB_txn *txn``: int flags (padded), a pointer
#: and int mutations (padded).
_AFTER_TXN = 24


class _Val(ctypes.Structure):
    _fields_ = [("mv_size", ctypes.c_size_t), ("mv_data", ctypes.c_void_p)]


def _load() -> dict[int, Any]:
    """Each bundled LMDB's functions, by its major version (py-lmdb bundles LMDB 0.9, symbols
    ``mdb09_*``, and 1.0, ``mdb10_*``, and binds each environment to one of them)."""
    if os.environ.get("KVCKPT_LMDB_RESERVE", "1").lower() in ("0", "false", "no", "off"):
        return {}
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return {}
    try:
        from lmdb import cpython  # type: ignore[attr-defined]

        lib = ctypes.CDLL(cpython.__file__)
    except (ImportError, OSError, AttributeError):
        return {}
    engines: dict[int, Any] = {}
    for major, prefix in ((0, "mdb09"), (1, "mdb10")):
        try:
            put = getattr(lib, f"{prefix}_put")
            txn_id = getattr(lib, f"{prefix}_txn_id")
        except AttributeError:
            continue
        put.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint,
            ctypes.POINTER(_Val),
            ctypes.POINTER(_Val),
            ctypes.c_uint,
        ]
        put.restype = ctypes.c_int
        txn_id.argtypes = [ctypes.c_void_p]
        txn_id.restype = ctypes.c_size_t
        engines[major] = (put, txn_id)
    return engines


_engines = _load()
#: None until a process's first reserved value has been read back; then whether it matched.
_confirmed: bool | None = None


def usable() -> bool:
    return bool(_engines) and _confirmed is not False


class Reserver:
    """Reserves room for values in one write transaction."""

    def __init__(self, put: Any, pointer: int) -> None:
        self._put = put
        self._pointer = pointer

    def room(self, key: bytes, nbytes: int) -> memoryview:
        """Allocate ``nbytes`` for ``key`` in the transaction and return them, writable. The
        caller fills them before the transaction commits."""
        k = _Val(len(key), ctypes.cast(ctypes.c_char_p(key), ctypes.c_void_p))
        v = _Val(nbytes, None)
        rc = self._put(self._pointer, _MAIN_DBI, ctypes.byref(k), ctypes.byref(v), _MDB_RESERVE)
        if rc != 0:
            raise _error(rc)
        return memoryview((ctypes.c_char * nbytes).from_address(v.mv_data)).cast("B")


def reserver(env: lmdb.Environment, txn: lmdb.Transaction) -> Reserver | None:
    """A ``Reserver`` for a py-lmdb write transaction of ``env``, or None where the transaction's
    ``MDB_txn *`` cannot be confirmed by the LMDB that ``env`` is bound to."""
    if type(txn) is not lmdb.Transaction:
        return None
    functions = _engines.get(env.lib_version()[0])
    if functions is None:
        return None
    put, txn_id = functions
    offset = type(txn).__basicsize__ - _AFTER_TXN - 8
    pointer = ctypes.c_void_p.from_address(id(txn) + offset).value
    if not pointer or pointer % 8 or txn_id(pointer) != txn.id():
        return None
    return Reserver(put, int(pointer))


def confirm(read: Callable[[], bytes | memoryview | None], written: memoryview) -> bool:
    """Compare the first value a process reserved, read back through py-lmdb (``read()``, called
    only then), with what it wrote; from then on reserving is used (equal) or not (anything
    else)."""
    global _confirmed
    if _confirmed is None:
        stored = read()
        _confirmed = stored is not None and stored == written
    return _confirmed


#: LMDB's return codes, as py-lmdb's put raises them (``LMDBEngine._write`` handles the first
#: two by growing the map).
_ERRORS: dict[int, type[lmdb.Error]] = {
    -30792: lmdb.MapFullError,  # MDB_MAP_FULL
    -30785: lmdb.MapResizedError,  # MDB_MAP_RESIZED
    -30788: lmdb.TxnFullError,  # MDB_TXN_FULL
    -30781: lmdb.BadValsizeError,  # MDB_BAD_VALSIZE
}


def _error(rc: int) -> lmdb.Error:
    kind = _ERRORS.get(rc, lmdb.Error)
    return kind(f"mdb_put (reserve) failed: {os.strerror(rc) if rc > 0 else rc}")
