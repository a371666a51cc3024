"""What the DCP adapter's writer (``kvckpt.writer``) and reader (``kvckpt.reader``) share:
checkpoint ids, save ids, a tensor's bytes and a tensor over bytes an engine lends, and the base
class that holds the engine."""

from __future__ import annotations

import ctypes
import os
import uuid

import numpy as np
import torch

from .engines.base import Engine
from .errors import InvalidCheckpointIdError
from .urls import validate_name


def new_save_id() -> str:
    """A save id (docs/FORMAT.md): chosen afresh by every save, so a re-saved checkpoint id
    never mixes old and new data keys. Loads and copies take one too, as their lease token."""
    return uuid.uuid4().hex


#: dtypes whose tensors ``Tensor.numpy()`` takes as they are; any other (bfloat16, float8) is
#: first viewed as the signed int of its size, which numpy has. Neither copies.
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def byte_view(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor with no conj or neg bit, as a flat memoryview of
    bytes (format ``B``), writable as the tensor is: what a save writes from and a load reads
    straight into, without a copy. Through numpy, which keeps the tensor alive for as long as
    the view exists: about three times as fast as torch's own ``view(torch.uint8)``, and this
    runs once per tensor, 10,000s of times per save or load."""
    if t.numel() == 0:
        return memoryview(bytearray())
    if t.dtype not in _NUMPY_DTYPES:
        as_int = _INT_OF_SIZE.get(t.element_size())
        if as_int is None:
            return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
        t = t.view(as_int)
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def byte_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over ``view``'s memory (not empty), without a copy and without a warning.

    Engines hand out read-only views (LMDB's memory map), and torch warns on wrapping
    read-only memory ("The given buffer is not writable"), having no read-only tensors. kvckpt
    only ever reads from these tensors, so a read-only view is wrapped through a writable
    alias of the same memory instead. (``warnings.catch_warnings`` would change process-wide
    state that ``Tiers``' background copies, in another thread, share.) The tensor keeps
    ``view`` referenced, and is valid as long as the view is.
    """
    if not view.readonly:
        return torch.frombuffer(view, dtype=torch.uint8)
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    alias = (ctypes.c_ubyte * view.nbytes).from_address(address)
    alias.source = view  # type: ignore[attr-defined]  # kept alive with the tensor
    return torch.frombuffer(alias, dtype=torch.uint8)


def valid_checkpoint_id(value: str | os.PathLike | None) -> str | None:
    """``value`` as a checkpoint id, or None; raises ``InvalidCheckpointIdError`` for a name
    the key schema cannot hold."""
    if value is None:
        return None
    return validate_name(os.fspath(value))


class KVStorageBase:
    """The engine and checkpoint id a writer or reader works on."""

    engine: Engine
    checkpoint_id: str | None

    def _require_id(self) -> str:
        if self.checkpoint_id is None:
            raise InvalidCheckpointIdError(
                f"no checkpoint id for {self.engine.url}: pass checkpoint_id=... to dcp.save / "
                f"dcp.load or to {type(self).__name__}(...)"
            )
        return self.checkpoint_id

    def close(self) -> None:
        """Release the store's connections (it reopens on next use)."""
        self.engine.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            valid_checkpoint_id(checkpoint_id)
        except InvalidCheckpointIdError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.url!r}, checkpoint_id={self.checkpoint_id!r})"
