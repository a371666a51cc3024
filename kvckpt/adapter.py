"""What the DCP adapter's writer (``kvckpt.writer``) and reader (``kvckpt.reader``) share:
checkpoint ids, save ids, and the base class that holds the engine."""

from __future__ import annotations

import os
import uuid

from .engines.base import Engine
from .errors import InvalidCheckpointIdError
from .urls import validate_name


def new_save_id() -> str:
    """A save id (docs/FORMAT.md): chosen afresh by every save, so a re-saved checkpoint id
    never mixes old and new data keys. Loads and copies take one too, as their lease token."""
    return uuid.uuid4().hex


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
