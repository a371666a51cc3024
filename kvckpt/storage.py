"""The DCP adapter under one name: ``from kvckpt.storage import ...`` gives both halves. The
writer lives in ``kvckpt.writer``, the reader in ``kvckpt.reader``."""

from .reader import KVStorageReader, fetch_parts
from .safe_load import SAFE_OBJECT_TYPES, check_weights_only, plain_types_allowed, refusal
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
