"""A two-layer MLP with tensor and sequence parallelism through commfuse.tp.

Start one process per rank with torchrun, on CPUs (gloo) or one GPU per rank (NCCL):

    torchrun --nproc-per-node 4 examples/tp_mlp.py

Every rank holds a shard of the sequence. w1 gathers the sequence while it
multiplies and w2 reduce-scatters its product the same way: each collective is
cut into ring hops, and each hop hides behind one shard of the GEMM.
algorithm="auto" picks how, once per call signature; set the "commfuse" logger
to DEBUG to see what it took and why.
"""

import os
import sys
from collections import OrderedDict

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import parallelize_module

from commfuse.tp import ColwiseParallel, RowwiseParallel

if "WORLD_SIZE" not in os.environ:  # torchrun sets it in every process it starts, one per rank
    print("WORLD_SIZE is not set: start one process per rank with torchrun: torchrun --nproc-per-node 4 "
          "examples/tp_mlp.py", file=sys.stderr)
    sys.exit(2)

device = "cuda" if torch.cuda.is_available() else "cpu"
mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("tp",))
mlp = nn.Sequential(OrderedDict(w1=nn.Linear(1024, 4096), act=nn.GELU(), w2=nn.Linear(4096, 1024))).to(device)
mlp = parallelize_module(mlp, mesh["tp"], {
    "w1": ColwiseParallel(input_layouts=Shard(1), algorithm="auto"),   # all-gather(sequence) fused with x @ w1
    "w2": RowwiseParallel(output_layouts=Shard(1), algorithm="auto"),  # h @ w2 fused with reduce-scatter(sequence)
})
x = torch.randn(4, 256, 1024, device=device)  # this rank's shard: (batch, sequence / world size, hidden)
y = mlp(x)                                    # the same shape and layout as x
y.sum().backward()
print(f"rank {mesh.get_rank()}: y {tuple(y.shape)}")
torch.distributed.barrier()  # leave together: a rank that exits while gloo's threads still run can abort
torch.distributed.destroy_process_group()
