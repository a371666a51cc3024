"""CUDA state dicts through kvckpt, on real LMDB and Redis.

Skipped where torch sees no GPU (CI has none); run on a GPU machine with
``python -m pytest -q tests/test_gpu.py``. Training state lives on the GPU, so these are the
paths users hit most: saving CUDA tensors (copied to host, as DCP's own writers do), loading
into CUDA tensors (host staging, then one copy to the device), ``dcp.async_save`` staging a
CUDA state dict, and moving a checkpoint between devices.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageReader, KVStorageWriter
from tests.test_dcp import assert_bit_equal, mixed_state_dict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def to_device(sd, device: str):
    if isinstance(sd, torch.Tensor):
        return sd.to(device)
    if isinstance(sd, dict):
        return {k: to_device(v, device) for k, v in sd.items()}
    if isinstance(sd, list):
        return [to_device(v, device) for v in sd]
    return sd


def zeros_on(sd, device: str):
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype, device=device)
    if isinstance(sd, dict):
        return {k: zeros_on(v, device) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_on(v, device) for v in sd]
    return sd


def on_cpu(sd):
    return to_device(sd, "cpu")


def gpu_state_dict() -> dict:
    sd = to_device(mixed_state_dict(), "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    # 24 MiB: several parts under ``?part_bytes=1048576``
    sd["big"] = torch.randn(6 * 1024 * 1024, device="cuda", generator=g)
    sd["cuda_view"] = sd["big"][1000:5000]
    sd["cuda_strided"] = sd["big"][: 64 * 64].view(64, 64).t()
    return sd


@pytest.mark.parametrize("part_bytes", [None, 1 << 20])
def test_cuda_state_dict_round_trip(store_url: str, part_bytes: int | None) -> None:
    sd = gpu_state_dict()
    if part_bytes is not None:
        store_url += ("&" if "?" in store_url else "?") + f"part_bytes={part_bytes}"
    dcp.save(sd, storage_writer=KVStorageWriter(store_url), checkpoint_id="gpu")
    dest = zeros_on(sd, "cuda")
    dcp.load(dest, storage_reader=KVStorageReader(store_url), checkpoint_id="gpu")
    for k in ("big", "f32", "bf16"):
        assert dest[k].device.type == "cuda", k
    assert_bit_equal(on_cpu(sd), on_cpu(dest))


def test_saved_on_gpu_loads_on_cpu_and_back(store_url: str) -> None:
    sd = gpu_state_dict()
    dcp.save(sd, storage_writer=KVStorageWriter(store_url), checkpoint_id="from-gpu")
    cpu_dest = zeros_on(sd, "cpu")
    dcp.load(cpu_dest, storage_reader=KVStorageReader(store_url), checkpoint_id="from-gpu")
    assert_bit_equal(on_cpu(sd), cpu_dest)

    dcp.save(cpu_dest, storage_writer=KVStorageWriter(store_url), checkpoint_id="from-cpu")
    gpu_dest = zeros_on(sd, "cuda")
    dcp.load(gpu_dest, storage_reader=KVStorageReader(store_url), checkpoint_id="from-cpu")
    assert_bit_equal(cpu_dest, on_cpu(gpu_dest))


def test_async_save_of_a_cuda_state_dict_is_a_snapshot(store_url: str) -> None:
    """The state dict may change on the GPU as soon as async_save returns (the next step runs);
    the checkpoint must hold the values at the call."""
    sd = gpu_state_dict()
    expected = on_cpu(sd)
    future = dcp.async_save(sd, storage_writer=KVStorageWriter(store_url), checkpoint_id="a")
    for v in sd.values():
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.bfloat16):
            v.add_(1)  # the next optimizer step, racing the background write
    future.result()
    dest = zeros_on(expected, "cuda")
    dcp.load(dest, storage_reader=KVStorageReader(store_url), checkpoint_id="a")
    assert_bit_equal(expected, on_cpu(dest))


def test_resharded_load_into_cuda(store_url: str) -> None:
    """A load whose destination is a slice of the stored chunk takes the staged path, which must
    narrow on the host and copy only the slice to the device."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    full = torch.randn(1024, 256, device="cuda")
    dcp.save({"w": full}, storage_writer=KVStorageWriter(store_url), checkpoint_id="r")
    dest = {"w": torch.zeros(1024, 256, device="cuda", dtype=torch.bfloat16)}
    # a dtype change forces the staged path (no direct read into device memory is possible)
    dcp.load(
        dest,
        storage_reader=KVStorageReader(store_url),
        checkpoint_id="r",
        planner=DefaultLoadPlanner(),
    )
    assert torch.equal(dest["w"].cpu(), full.cpu().to(torch.bfloat16))


def test_background_stager_stages_cuda_state_pinned_and_bit_exact(store_url: str) -> None:
    """kvckpt.background_stager() on a GPU host: the staging copy is pinned host memory filled
    by non-blocking copies on a side stream, reused across saves; each checkpoint holds the
    state at staging even though the CUDA tensors change right after ``staging_completion``."""
    import kvckpt

    stager = kvckpt.background_stager()
    live = gpu_state_dict()
    try:
        staged = stager.stage(live).result()
        assert staged["big"].device.type == "cpu" and staged["big"].is_pinned()
        for step in (1, 2):
            expected = on_cpu(live)
            response = dcp.async_save(
                live,
                storage_writer=KVStorageWriter(store_url),
                checkpoint_id=f"step-{step}",
                async_stager=stager,
            )
            response.staging_completion.result()
            live["big"].add_(1.0)  # what the optimizer step does next
            response.upload_completion.result()
            out = zeros_on(expected, "cpu")
            dcp.load(out, storage_reader=KVStorageReader(store_url, checkpoint_id=f"step-{step}"))
            assert_bit_equal(out, expected)
        again = stager.stage(live).result()
        assert again["big"].data_ptr() == staged["big"].data_ptr()  # one staging copy
    finally:
        stager.close()
