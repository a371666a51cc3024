"""kvckpt: PyTorch Distributed Checkpoint (DCP) storage in key-value stores (LMDB, Redis)."""

from .engines.base import Engine
from .errors import (
    CheckpointNotFoundError,
    DataError,
    InvalidCheckpointIdError,
    InvalidURLError,
    KVCheckpointError,
    MetadataError,
    StoreUnavailableError,
    UnsafeObjectError,
    UnsupportedFormatVersionError,
)
from .manage import (
    CheckpointInfo,
    GcReport,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
)
from .storage import KVStorageReader, KVStorageWriter
from .urls import open_store

__all__ = [
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "DataError",
    "Engine",
    "GcReport",
    "InvalidCheckpointIdError",
    "InvalidURLError",
    "KVCheckpointError",
    "KVStorageReader",
    "KVStorageWriter",
    "MetadataError",
    "StoreUnavailableError",
    "UnsafeObjectError",
    "UnsupportedFormatVersionError",
    "delete_checkpoint",
    "gc",
    "latest_checkpoint",
    "list_checkpoints",
    "open_store",
]
__version__ = "0.1.0"
