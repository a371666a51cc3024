"""A small end-to-end demo on LMDB (no server needed): save a model and its optimizer with
``dcp.save``, load them into a fresh model with ``dcp.load``, and check every byte came back.

    python examples/demo.py [STORE_URL]

STORE_URL defaults to an LMDB store in a temporary directory (on /dev/shm when it exists).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import kvckpt

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def main() -> None:
    workdir = "/dev/shm" if sys.platform == "linux" else None
    tmp = None if len(sys.argv) > 1 else tempfile.mkdtemp(dir=workdir, prefix="kvckpt-demo-")
    url = sys.argv[1] if tmp is None else f"lmdb://{tmp}"
    try:
        run(url)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run(url: str) -> None:
    torch.manual_seed(0)
    model, opt = make_model()
    for _ in range(3):  # a few steps so the optimizer has state
        loss = model(torch.randn(32, 256)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=kvckpt.KVStorageWriter(url), checkpoint_id="step-3")
    t1 = time.perf_counter()

    fresh_model, fresh_opt = make_model()
    restored = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict(), "step": 0}
    dcp.load(restored, storage_reader=kvckpt.KVStorageReader(url), checkpoint_id="step-3")
    t2 = time.perf_counter()
    fresh_model.load_state_dict(restored["model"])

    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh_model.state_dict()[name]), name
    assert restored["step"] == 3
    record = kvckpt.KVStorageReader(url, checkpoint_id="step-3").read_record()
    print(f"store:    {kvckpt.open_store(url).url}")
    print(
        f"saved:    {len(record.locations)} items, {record.total_bytes / 2**20:.2f} MiB "
        f"in {1e3 * (t1 - t0):.1f} ms"
    )
    print(f"loaded:   in {1e3 * (t2 - t1):.1f} ms, model and optimizer identical: OK")


if __name__ == "__main__":
    main()
