"""Staging for ``dcp.async_save``: the copy of the state dict that the training loop waits for.

Two ways to take that copy off the training loop's path:

- ``background_stager()``: DCP's own ``AsyncSaveResponse`` flow, set up so that it also runs on a
  host without an accelerator. The copy goes into one staging copy reused across saves, on a
  background thread, while the next forward and backward run; the loop waits for
  ``staging_completion`` only before the next ``optimizer.step()``.
- ``huge_pages`` (below), for the blocking copy into fresh memory that DCP makes by default.

The copy goes into freshly allocated host memory, and on Linux the cost of that is mostly the
kernel faulting in and zeroing 4 KiB pages, one trap per page: a copy into fresh memory runs
several times slower than one into memory already in use (``benchmarks/run.py`` measures
both). Asking for
transparent huge pages on the staging buffers (``madvise(MADV_HUGEPAGE)``, which is what a
kernel in THP "madvise" mode, the common default, waits for) makes that one fault per 2 MiB.
That is opt-in (``KVStorageWriter(huge_pages=True)``): the median save blocks less, but the
kernel now and then stalls a fault to compact memory into free 2 MiB blocks (most with an LMDB
store filling /dev/shm), so the total blocking time can come out above DCP's (docs/PERFORMANCE.md
has the figures). Nodes with free huge pages gain; fragmented ones can lose. The
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
from torch.distributed.checkpoint.staging import AsyncStager
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


def background_stager(*, share_memory: bool = False) -> AsyncStager:
    """A stager that takes ``dcp.async_save``'s copy on a background thread, into one staging
    copy reused across saves.

    Pass it as ``async_stager``; ``dcp.async_save`` then returns an ``AsyncSaveResponse``::

        stager = kvckpt.background_stager()         # one for the whole run
        ...
        loss.backward()
        if saving is not None:
            saving.staging_completion.result()      # the copy is taken: the state may change
        optimizer.step()
        if step % every == 0:
            if saving is not None:
                saving.upload_completion.result()   # one save in flight: the copy is reused
            saving = dcp.async_save(state_dict, storage_writer=..., checkpoint_id=...,
                                    async_stager=stager)
        ...
        stager.close()

    Why: DCP's default ``async_save`` copies the state dict into fresh host memory before it
    returns, which on Linux mostly costs page faults. Here the copy goes into memory already
    in use and overlaps the next forward and backward, so training waits only for what the
    copy has not finished by the next ``optimizer.step()``. The checkpoint holds the state at
    the step it names, bit-exact.

    It is DCP's ``DefaultStager`` with the options the host supports: pinned memory,
    non-blocking copies and a side stream where an accelerator is; plain memory and copies on a
    CPU-only host, where DCP's default ``StagingOptions`` refuse to run. The staging copy is
    reused, so a save must finish (``upload_completion``) before the next one starts, as with
    every cached stager; it costs one copy of the state dict in host memory for the whole run.
    """

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as e:  # an older torch
        raise ImportError(
            f"background_stager() needs DCP's DefaultStager, which this torch "
            f"{torch.__version__} lacks. KVStorageWriter(cache_staged_state_dict=True) reuses a "
            "staging copy on older versions, but copies while the loop waits."
        ) from e
    accelerator = accelerator_available()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=accelerator,
            use_shared_memory=share_memory,
            use_async_staging=True,
            use_non_blocking_copy=accelerator,
        )
    )
    _keep_the_staging_copy(stager)
    return stager


def _keep_the_staging_copy(stager: Any) -> None:
    """Keep the stager's copy (and its deep-copy rules) from one save to the next until the
    stager is closed. torch 2.11's ``DefaultStager`` closes its ``StateDictStager`` after
    every save: that frees the staging copy, so each save pays for fresh memory again, and
    clears its deep-copy rules, so the next save fails (``KeyError: <class 'type'>``). Later
    releases keep both; there this changes nothing."""
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is None:
        return
    release = inner.close
    inner.close = lambda: None  # what DefaultStager calls after each save
    close = stager.close

    def close_both() -> None:
        try:
            close()
        finally:
            release()

    stager.close = close_both


def accelerator_available() -> bool:
    """Whether pinned host memory has a device to serve (pinning fails without one)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()
