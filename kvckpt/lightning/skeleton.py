"""A Lightning checkpoint as DCP items: every tensor an item of its own, and the rest (the
*skeleton*) one ``torch.save``-d item that loads under ``weights_only`` rules."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch

from ..safe_load import load_object

SKELETON_FQN = "lightning/skeleton"
TENSOR_FQN = "lightning/tensor/{}"


def _placeholder(tensor: torch.Tensor, where: str) -> torch.Tensor:
    if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(
            f"kvckpt.lightning stores plain dense tensors; {where} is a {type(tensor).__name__} "
            f"with layout {tensor.layout}. Convert it (e.g. .to_dense() or .full_tensor()) in "
            "on_save_checkpoint, or checkpoint it with Lightning's default CheckpointIO."
        )
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors of a Lightning checkpoint dict, keyed by DCP fqn, and its pickled skeleton.

    Dicts (``OrderedDict`` included, with its ``_metadata``), lists and tuples are walked; each
    tensor is replaced by a meta placeholder, in the order ``_fill`` walks them back. The
    caller's dict is not changed."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            placeholder = _placeholder(obj, where)
            tensors[TENSOR_FQN.format(len(tensors))] = obj.detach()
            return placeholder
        if isinstance(obj, dict):
            out = {} if type(obj) is dict else copy.copy(obj)
            for k, v in obj.items():
                out[k] = strip(v, f"{where}[{k!r}]")
            return out
        if isinstance(obj, list):
            items = [strip(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            if type(obj) is list:
                return items
            same = copy.copy(obj)  # a list subclass keeps its class
            same[:] = items
            return same
        if isinstance(obj, tuple):
            items = [strip(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return tuple(items) if type(obj) is tuple else type(obj)(*items)
        return obj

    skeleton = strip(checkpoint, "checkpoint")
    buffer = io.BytesIO()
    torch.save({"format": 1, "tensors": len(tensors), "checkpoint": skeleton}, buffer)
    return tensors, buffer.getvalue()


def _fill(obj: Any, tensors: list[torch.Tensor], used: list[int]) -> Any:
    """Put the loaded tensors back in place of the skeleton's meta placeholders, in order."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            return obj
        i = used[0]
        used[0] += 1
        if i >= len(tensors):
            return obj  # reported by the caller: more placeholders than tensors
        return tensors[i]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _fill(v, tensors, used)
        return obj
    if isinstance(obj, list):
        obj[:] = [_fill(v, tensors, used) for v in obj]
        return obj
    if isinstance(obj, tuple):
        items = [_fill(v, tensors, used) for v in obj]
        return tuple(items) if type(obj) is tuple else type(obj)(*items)
    return obj


def _unpickle_skeleton(data: bytes, weights_only: bool, where: str) -> dict[str, Any]:
    return load_object(
        data,
        weights_only=weights_only,
        what=f"the Lightning checkpoint {where}",
        opt_out="trainer.fit(..., weights_only=False) or KVCheckpointIO(..., weights_only=False)",
    )
