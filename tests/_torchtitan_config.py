"""A torchtitan config registry module for tests/test_torchtitan.py: how a user's own config
function selects kvckpt's checkpoint manager (``--module tests._torchtitan_config --config
kv_debugmodel``)."""

from __future__ import annotations

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from kvckpt.torchtitan import KVCheckpointManager


def kv_debugmodel() -> Trainer.Config:
    config = llama3_debugmodel()
    config.checkpoint = KVCheckpointManager.Config(
        enable=True,
        store_url="lmdb:///tmp/kvckpt-torchtitan-debug",
        interval=10,
        keep_latest_k=3,
        last_save_model_only=False,
    )
    return config
