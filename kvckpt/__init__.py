"""kvckpt: PyTorch Distributed Checkpoint (DCP) storage in key-value stores (LMDB, Redis)."""

from .engines.base import Engine
from .errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    DataError,
    IntegrityError,
    InvalidCheckpointIdError,
    InvalidURLError,
    KVCheckpointError,
    MetadataError,
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
)
from .manage import (
    CheckpointInfo,
    GcReport,
    delete_checkpoint,
    gc,
    latest_checkpoint,
    list_checkpoints,
)
from .reader import KVStorageReader
from .staging import background_stager
from .stores import open_store
from .tiered import Restore, TieredStorageWriter, Tiers
from .transfer import DirectoryReader
from .writer import KVStorageWriter

__all__ = [
    "CheckpointInfo",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
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
    "ReadOnlyStoreError",
    "ReplicationError",
    "Restore",
    "SaveAbandonedError",
    "ShapeMismatchError",
    "StoreFullError",
    "StoreNotFoundError",
    "StoreUnavailableError",
    "TieredStorageWriter",
    "Tiers",
    "UnsafeObjectError",
    "UnsafeStoreError",
    "UnsupportedFormatVersionError",
    "background_stager",
    "delete_checkpoint",
    "gc",
    "latest_checkpoint",
    "list_checkpoints",
    "open_store",
]
__version__ = "0.2.0"
