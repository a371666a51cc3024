"""Staging for ``dcp.async_save``: the copy of the state dict that the training loop waits for.

The copy goes into freshly allocated host memory, and on Linux the cost of that is mostly the
kernel faulting in and zeroing 4 KiB pages, one trap per page: a 1 GiB copy ran at 1.1 GB/s on
the development VM, against 12 GB/s for a copy into memory already in use. Asking for
transparent huge pages on the staging buffers (``madvise(MADV_HUGEPAGE)``, which is what a
kernel in THP "madvise" mode, the common default, waits for) makes that one fault per 2 MiB.
That is opt-in (``KVStorageWriter(huge_pages=True)``) because of how it measured there (7 saves
of 1 GiB, benchmarks/run.py): the median save blocked 2.5x less, but the kernel now and then
stalls a fault to compact memory into free 2 MiB blocks (saves of 0.8-2.2 s against DCP's
0.4-0.5 s, most with an LMDB store filling /dev/shm), so the total blocking time came out
anywhere from 0.9x to 1.7x DCP's. Nodes with free huge pages gain; fragmented ones can lose. The
buffers, their layout and their lifetime are DCP's own; this only adds the hint, and does
nothing where the kernel does not support it (THP "always" mode already gives DCP's buffers
huge pages; "never" gives none).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_madvise: Any = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def local_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors whose memory a (nested) state dict holds in this process."""
    if isinstance(obj, DTensor):
        yield obj._local_tensor
    elif isinstance(obj, ShardedTensor):
        for shard in obj.local_shards():
            yield shard.tensor
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from local_tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from local_tensors(value)


def advise_huge_pages(state_dict: Any) -> int:
    """Ask for huge pages on every whole 2 MiB page of the state dict's CPU tensors that are not
    yet touched. Returns the bytes advised (0 where unsupported)."""
    if _madvise is None:
        return 0
    advised = 0
    for t in local_tensors(state_dict):
        if t.device.type != "cpu" or t.nbytes < 2 * _HUGE_PAGE:
            continue
        start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (t.data_ptr() + t.nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start and _madvise(start, end - start, _MADV_HUGEPAGE) == 0:
            advised += end - start
    return advised


def accelerator_available() -> bool:
    """Whether pinned host memory has a device to serve (pinning fails without one)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()
