"""One rank of a 2-rank job that saves a checkpoint, run as its own process so a test can
SIGKILL one rank mid-save.   python -m tests._rank_writer RANK WORLD PORT URL CHECKPOINT_ID"""

import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageWriter

warnings.filterwarnings("ignore")

if __name__ == "__main__":
    rank, world, port, url, cid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:6]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # Distinct names per rank: every rank writes its own share of the data.
    sd = {f"r{rank}.t{i}": torch.full((8 << 18,), float(i)) for i in range(48)}
    dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id=cid)
    print("saved", flush=True)
