"""A small end-to-end demo: save a model and its AdamW state with ``dcp.save``, load them into a
fresh model and optimizer with ``dcp.load``, and check that every tensor came back bit-exact.

    python examples/demo.py [STORE_URL]

STORE_URL defaults to an LMDB store in a temporary directory (on /dev/shm when it exists), e.g.
``redis://localhost:6379/0``. Unless the URL names a namespace (``?prefix=...``), the demo keeps
its keys under ``prefix=kvckpt-demo``, so that it never meets another job's checkpoints in a
shared Redis.

The model and optimizer state go through DCP's ``get_state_dict`` / ``set_state_dict``: they key
the optimizer's state by parameter name, which is what lets ``dcp.load`` fill a fresh optimizer
(``optimizer.state_dict()`` keys it by position and has no state at all before the first step).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import warnings
from urllib.parse import parse_qs, urlsplit

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import kvckpt

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

NAMESPACE = "kvckpt-demo"


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def with_namespace(url: str) -> str:
    """``url`` with ``prefix=kvckpt-demo`` added, unless it names a prefix already."""
    query = urlsplit(url).query
    if "prefix" in parse_qs(query):
        return url
    return f"{url}{'&' if query else '?'}prefix={NAMESPACE}"


def main() -> None:
    workdir = "/dev/shm" if sys.platform == "linux" else None
    tmp = None if len(sys.argv) > 1 else tempfile.mkdtemp(dir=workdir, prefix="kvckpt-demo-")
    url = with_namespace(sys.argv[1] if tmp is None else f"lmdb://{tmp}")
    try:
        run(url)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run(url: str) -> None:
    torch.manual_seed(0)
    model, opt = make_model()
    for _ in range(3):  # a few steps, so the optimizer has state
        loss = model(torch.randn(32, 256)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": 3}
    t0 = time.perf_counter()
    dcp.save(state, storage_writer=kvckpt.KVStorageWriter(url), checkpoint_id="step-3")
    t1 = time.perf_counter()

    fresh_model, fresh_opt = make_model()  # other weights, no optimizer state yet
    assert not torch.equal(fresh_model[0].weight, model[0].weight)
    model_sd, optim_sd = get_state_dict(fresh_model, fresh_opt)
    restored = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(restored, storage_reader=kvckpt.KVStorageReader(url), checkpoint_id="step-3")
    set_state_dict(
        fresh_model,
        fresh_opt,
        model_state_dict=restored["model"],
        optim_state_dict=restored["optim"],
    )
    t2 = time.perf_counter()

    checked = check_identical(model, opt, fresh_model, fresh_opt)
    assert restored["step"] == 3, restored["step"]
    record = kvckpt.KVStorageReader(url, checkpoint_id="step-3").read_record()
    print(f"store:    {kvckpt.open_store(url).url}")
    print(
        f"saved:    {len(record.locations)} items, {record.total_bytes / 2**20:.2f} MiB "
        f"in {1e3 * (t1 - t0):.1f} ms"
    )
    print(f"loaded:   in {1e3 * (t2 - t1):.1f} ms")
    print(f"checked:  {checked} and the step: bit-exact, OK")


def check_identical(
    model: nn.Module, opt: torch.optim.Optimizer, other: nn.Module, other_opt: torch.optim.Optimizer
) -> str:
    """Assert that the two models and the two optimizers hold the same state, bit for bit;
    returns what was compared."""
    params = model.state_dict()
    for name, tensor in params.items():
        assert torch.equal(tensor, other.state_dict()[name]), name
    mine, theirs = opt.state_dict(), other_opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"], "the optimizer has no state to compare: step it first"
    assert mine["state"].keys() == theirs["state"].keys(), (
        f"optimizer state for parameters {sorted(mine['state'])} against "
        f"{sorted(theirs['state'])}: the optimizer state was not restored"
    )
    tensors = 0
    for index, values in mine["state"].items():
        assert values.keys() == theirs["state"][index].keys(), index
        for key, value in values.items():
            assert torch.equal(value, theirs["state"][index][key]), (index, key)
            tensors += 1
    kinds = ", ".join(sorted(next(iter(mine["state"].values()))))
    return (
        f"model ({len(params)} tensors), {type(opt).__name__} state ({tensors} tensors: {kinds} "
        f"of {len(mine['state'])} parameters), its hyperparameters"
    )


if __name__ == "__main__":
    main()
