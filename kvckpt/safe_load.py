"""Loading pickled objects read from a store, under ``torch.load(weights_only=True)`` rules.

A store others can write to must not be able to run code in the job that loads from it, so
every object kvckpt unpickles (DCP object items, Lightning's skeleton, Megatron's common state,
an imported directory's objects) goes through ``load_object`` or ``check_weights_only``. The
user opts out per API (``weights_only=False``) for a store they trust, and each error names
that way out.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import re
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .errors import UnsafeObjectError

#: Plain types that torch's ``weights_only`` rules refuse although rebuilding one runs no code
#: (each is made from bytes, numbers or other already-checked values), and that DCP users keep
#: in state dicts: ``io.BytesIO`` holds opaque blobs in PyTorch's own DCP tests and torchtitan's
#: older ``TrainState``; ``frozenset`` and ``datetime`` values turn up in training state. Not
#: ``collections.deque`` (the restricted unpickler cannot rebuild it) nor ``defaultdict`` (it
#: keeps a callable that later runs on a missing key).
SAFE_OBJECT_TYPES: tuple[type, ...] = (
    io.BytesIO,
    frozenset,
    datetime.date,
    datetime.datetime,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
)
_safe_types_lock = threading.Lock()


@contextlib.contextmanager
def plain_types_allowed() -> Iterator[None]:
    """torch's ``weights_only`` allowlist plus ``SAFE_OBJECT_TYPES`` while the block runs.

    torch's allowlist is process-wide, so the block holds a lock, and adds (and afterwards
    removes) only the types the user has not registered with ``add_safe_globals`` already."""
    with _safe_types_lock:
        present = set(torch.serialization.get_safe_globals())
        with torch.serialization.safe_globals([t for t in SAFE_OBJECT_TYPES if t not in present]):
            yield


def refusal(e: Exception) -> str:
    """The sentence of torch's long ``weights_only`` error that names what was refused (the
    type or function), in full; any other error's whole message, on one line."""
    text = str(e)
    found = re.search(r"WeightsUnpickler error: (.*?)(?:\. Please|$)", text, re.M) or re.search(
        r"^\s*(Trying to load unsupported .*?)\.?\s*$", text, re.M
    )
    return found.group(1).strip() if found else f"{type(e).__name__}: {' '.join(text.split())}"


def load_object(
    data: bytes | bytearray,
    *,
    weights_only: bool,
    what: str,
    opt_out: str,
    map_location: Any = None,
) -> Any:
    """``torch.load`` of ``data``: under ``weights_only`` rules (``SAFE_OBJECT_TYPES`` allowed)
    unless ``weights_only`` is False, which the caller takes from a user who trusts the store.
    A refusal raises ``UnsafeObjectError`` naming ``what`` was refused, the refused type, and
    ``opt_out``, the way out that fits the API in use."""
    if not weights_only:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    try:
        with plain_types_allowed():
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        raise UnsafeObjectError(_refused(what, e, opt_out)) from None


def check_weights_only(data: bytes, what: str, opt_out: str) -> None:
    """Refuse an object value that ``torch.load(weights_only=True)`` would not load (with
    ``SAFE_OBJECT_TYPES`` allowed): DCP's planners unpickle object items without restriction,
    so this check comes first."""
    load_object(data, weights_only=True, what=what, opt_out=opt_out)


def _refused(what: str, e: Exception, opt_out: str) -> str:
    return (
        f"{what} cannot be loaded under torch.load(weights_only=True) rules: {refusal(e)}. "
        "Allow the types you expect with torch.serialization.add_safe_globals([...]), or, "
        f"if you trust everyone who can write there, pass {opt_out}."
    )
