"""A training job's save, run as its own process so tests can SIGKILL it mid-write.

python -m tests._writer URL CHECKPOINT_ID N_TENSORS TENSOR_MIB
"""

import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

from kvckpt import KVStorageWriter

warnings.filterwarnings("ignore")

if __name__ == "__main__":
    url, cid, count, mib = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sd = {f"t{i}": torch.full((mib << 18,), float(i)) for i in range(count)}
    print("saving", flush=True)
    dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id=cid)
    print("saved", flush=True)
