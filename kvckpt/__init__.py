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
from .storage import KVStorageReader, KVStorageWriter
from .urls import open_store

__all__ = [
    "CheckpointNotFoundError",
    "DataError",
    "Engine",
    "InvalidCheckpointIdError",
    "InvalidURLError",
    "KVCheckpointError",
    "KVStorageReader",
    "KVStorageWriter",
    "MetadataError",
    "StoreUnavailableError",
    "UnsafeObjectError",
    "UnsupportedFormatVersionError",
    "open_store",
]
__version__ = "0.1.0"
