"""PyTorch Lightning: checkpoints in a key-value store (``pip install 'kvckpt[lightning]'``).

Three pieces, usable together or apart:

- ``KVCheckpointIO(url)``: a ``CheckpointIO`` plugin. ``Trainer(plugins=[KVCheckpointIO(url)])``
  sends ``trainer.save_checkpoint``, ``ModelCheckpoint`` (top-k, ``save_last``, removal) and
  ``trainer.fit(ckpt_path=...)`` to the store.
- ``KVCheckpoint(url, every_n_train_steps=N)``: a callback that saves frequent checkpoints
  (``step-000000123``) into a store or ``kvckpt.Tiers`` beside the user's own checkpoints,
  keeping the newest ``keep_last``, optionally in the background.
- ``auto_resume(sources, ckpt_dir=...)``: the newest complete checkpoint in any of them, as a
  path for ``trainer.fit(ckpt_path=...)`` when a job restarts.

How a Lightning checkpoint is stored. Lightning hands over one nested dict (``state_dict``,
``optimizer_states``, ``loops``, ``callbacks``, ...). Every tensor in it becomes a DCP tensor item
(``lightning/tensor/<n>``, numbered in traversal order) stored as raw bytes like any kvckpt
checkpoint. What remains, the *skeleton* (the dict with each tensor replaced by a meta-device
placeholder of its shape and dtype), is ``torch.save``-d into one uint8 tensor item,
``lightning/skeleton``, and loaded back with ``torch.load(weights_only=True)`` (plus
``kvckpt.safe_load.SAFE_OBJECT_TYPES``), so a store others can write to cannot run code in the job.
Keeping the structure out of DCP matters: DCP's flattening turns the int keys of an optimizer's
``state`` into strings, which ``Optimizer.load_state_dict`` silently ignores.

Lightning saves and removes on global rank 0 only, and loads on every rank, so every DCP call
here runs with ``no_dist=True``: no collective, and the checkpoint records a world size of 1
(it is complete as soon as rank 0 commits it).

Checkpoint ids and pointer files. Lightning names checkpoints by path. The id of a path is its
file name without ``.ckpt``, cleaned to kvckpt's id alphabet, plus a hash of its directory:
``/runs/a/checkpoints/epoch=1-step=40.ckpt`` -> ``epoch=1-step=40.<8 hex digits>``, so two runs
that share a store but not a directory never collide (``checkpoint_id_for``). After each save a
small JSON *pointer file* is written at the path itself (store URL with any password masked, id,
commit time). It keeps what Lightning does with local files working: ``ModelCheckpoint``'s
existence checks and version suffixes, ``ckpt_path="last"``, and ``auto_resume``. The store is
the truth: a load of a path with no pointer file (a replaced node whose local disk is gone) finds
the id from the path alone.
"""

from __future__ import annotations

try:
    import lightning.pytorch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "kvckpt.lightning needs the `lightning` package (2.6.x): pip install 'kvckpt[lightning]'"
    ) from e

from .callback import KVCheckpoint
from .checkpoint_io import KVCheckpointIO
from .pointers import checkpoint_id_for, read_pointer, write_pointer
from .resume import auto_resume
from .skeleton import SKELETON_FQN, TENSOR_FQN, split_checkpoint
from .store import Saved, load_checkpoint, save_checkpoint

__all__ = [
    "SKELETON_FQN",
    "TENSOR_FQN",
    "KVCheckpoint",
    "KVCheckpointIO",
    "Saved",
    "auto_resume",
    "checkpoint_id_for",
    "load_checkpoint",
    "read_pointer",
    "save_checkpoint",
    "split_checkpoint",
    "write_pointer",
]
