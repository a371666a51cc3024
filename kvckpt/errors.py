"""Exceptions kvckpt raises.

Every error names what went wrong and how to fix it: which checkpoint, which key, which URL (with
any password masked). They share one base class so a training script can catch them together.
"""

from __future__ import annotations


class KVCheckpointError(Exception):
    """Base class of every kvckpt error."""


class InvalidURLError(KVCheckpointError, ValueError):
    """A store URL that kvckpt cannot parse or has no engine for."""


class InvalidCheckpointIdError(KVCheckpointError, ValueError):
    """A checkpoint id (or prefix) that would break the key schema."""


class StoreUnavailableError(KVCheckpointError, ConnectionError):
    """The store could not be reached or opened."""


class ReadOnlyStoreError(StoreUnavailableError):
    """The store takes no writes (a Redis replica, an LMDB directory this user cannot write):
    save, delete and gc go to its primary, or run as a user who can write. Loads, ``verify``,
    copies from it and exports still work (without a read lease)."""


class WritePermissionError(ReadOnlyStoreError):
    """The store's user may read but not write (a Redis ACL user limited to ``+@read``)."""


class CheckpointNotFoundError(KVCheckpointError, LookupError, FileNotFoundError):
    """No committed checkpoint has the requested id.

    Also a ``FileNotFoundError``, the error that training frameworks' checkpoint loaders
    (torchtitan's, Lightning's) catch for a step that was never saved."""


class StoreNotFoundError(CheckpointNotFoundError):
    """The store does not exist (an LMDB directory that is not there). Only a save creates a
    store: listing, inspecting or loading never does, so a mistyped path fails instead of
    creating an empty store that has no checkpoints."""


class MetadataError(KVCheckpointError, ValueError):
    """Stored metadata is corrupt, malformed or not kvckpt's."""


class UnsupportedFormatVersionError(MetadataError):
    """Stored metadata was written by a newer kvckpt."""


class ShapeMismatchError(KVCheckpointError, ValueError):
    """A checkpoint's tensors have other shapes than the state dict it is loaded into: it was
    saved from another model, or by another job that uses the same store namespace."""


class DataError(KVCheckpointError):
    """A data value is missing or has the wrong size: the checkpoint is damaged."""


class UnsafeObjectError(KVCheckpointError):
    """A stored object would need unrestricted unpickling to load."""


class IntegrityError(DataError):
    """A value's checksum does not match the one recorded when it was saved."""


class NotHeldError(DataError):
    """No store a restore reads could serve some items of the checkpoint whole: every copy of
    them is damaged or gone (``Tiers.restore`` then restores the newest save held whole)."""


class StoreFullError(KVCheckpointError):
    """The store has no room for the checkpoint (Redis maxmemory, a full filesystem)."""


class UnsafeStoreError(KVCheckpointError):
    """The store is configured in a way that can silently lose checkpoint data."""


class CheckpointLockedError(KVCheckpointError):
    """Another writer holds the write lease of this checkpoint id."""


class SaveAbandonedError(KVCheckpointError):
    """A save's pending entry was gone when it came to commit (``gc`` took it for a crashed
    writer's save and deleted its data, or the store lost its memory): committing it would
    publish missing data."""


class DamagedCopyError(KVCheckpointError):
    """A restore found that a node's store could not serve items it holds (a damaged or
    vanished copy). The reader no longer counts them as held there: loading again reads them
    from their next holder."""


class ReplicationError(KVCheckpointError):
    """A checkpoint committed in the fast tier could not be copied to a slower one."""


class CheckpointExistsError(KVCheckpointError, FileExistsError):
    """The destination already holds a checkpoint of that id, and replacing it was not asked
    for (``overwrite=True``, ``kvckpt copy --force``)."""


class UnwritablePathError(KVCheckpointError, OSError):
    """A file or directory an export or ``torch-save`` writes cannot be created there."""
