"""kvckpt: PyTorch Distributed Checkpoint (DCP) storage in key-value stores (LMDB, Redis).

``import kvckpt`` does not import torch: the names that need it (the storage writer and
reader, tiers, staging, ``DirectoryReader``) are imported on first access, so listing, inspecting
and deleting checkpoints (``kvckpt ls``, ``latest_checkpoint``) start quickly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .choice import Restore
from .engines.base import Engine
from .errors import (
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    DamagedCopyError,
    DataError,
    IntegrityError,
    InvalidCheckpointIdError,
    InvalidURLError,
    KVCheckpointError,
    MetadataError,
    NotHeldError,
    ReadOnlyStoreError,
    ReplicationError,
    SaveAbandonedError,
    ShapeMismatchError,
    StoreFullError,
    StoreNotFoundError,
    StoreUnavailableError,
    UnsafeObjectError,
    UnsafeStoreError,
    UnsupportedFormatVersionError,
    UnwritablePathError,
    WritePermissionError,
)
from .manage import (
    CheckpointInfo,
    GcReport,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
    remove_items,
)
from .stores import open_store

if TYPE_CHECKING:
    from .dcp_files import DirectoryReader
    from .reader import KVStorageReader
    from .restore import RestoreStats, TieredStorageReader
    from .safetensors_export import export_safetensors
    from .staging import background_stager
    from .tiered import Tiers
    from .tiered_writer import TieredStorageWriter
    from .writer import KVStorageWriter

#: name -> module of the public names that import torch, imported on first access
_LAZY = {
    "RestoreStats": "restore",
    "TieredStorageReader": "restore",
    "KVStorageReader": "reader",
    "background_stager": "staging",
    "export_safetensors": "safetensors_export",
    "TieredStorageWriter": "tiered_writer",
    "Tiers": "tiered",
    "DirectoryReader": "dcp_files",
    "KVStorageWriter": "writer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "DamagedCopyError",
    "DataError",
    "DirectoryReader",
    "Engine",
    "GcReport",
    "IntegrityError",
    "InvalidCheckpointIdError",
    "InvalidURLError",
    "KVCheckpointError",
    "KVStorageReader",
    "KVStorageWriter",
    "MetadataError",
    "NotHeldError",
    "ReadOnlyStoreError",
    "ReplicationError",
    "Restore",
    "RestoreStats",
    "SaveAbandonedError",
    "ShapeMismatchError",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "TieredStorageReader",
    "TieredStorageWriter",
    "Tiers",
    "UnsafeObjectError",
    "UnsafeStoreError",
    "UnsupportedFormatVersionError",
    "UnwritablePathError",
    "WritePermissionError",
    "background_stager",
    "delete_checkpoint",
    "export_safetensors",
    "gc",
    "latest_checkpoint",
    "list_checkpoints",
    "open_store",
    "remove_items",
]
__version__ = "0.2.0"
