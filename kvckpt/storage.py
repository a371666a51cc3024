"""The DCP adapter, by its former single module's name: ``from kvckpt.storage import ...``
keeps working. The writer lives in ``kvckpt.writer``, the reader in ``kvckpt.reader``."""

from .reader import (
    SAFE_OBJECT_TYPES,
    KVStorageReader,
    check_weights_only,
    fetch_parts,
    plain_types_allowed,
    refusal,
)
from .writer import KVStorageWriter, tensor_bytes

__all__ = [
    "SAFE_OBJECT_TYPES",
    "KVStorageReader",
    "KVStorageWriter",
    "check_weights_only",
    "fetch_parts",
    "plain_types_allowed",
    "refusal",
    "tensor_bytes",
]
