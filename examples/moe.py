"""A mixture-of-experts layer under expert parallelism: ``torchrun --nproc-per-node 2 examples/moe.py``.

Every rank holds experts/world of the experts; each step's tokens are routed top-2, dispatched to their
experts' ranks fused with the experts' first GEMM, and combined fused with the second.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commfuse.nn import MoE

if "WORLD_SIZE" not in os.environ:  # torchrun sets it in every process it starts, one per rank
    print("WORLD_SIZE is not set: start one process per rank with torchrun: torchrun --nproc-per-node 2 "
          "examples/moe.py", file=sys.stderr)
    sys.exit(2)

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("ep",))
# Seed every rank alike: the router is replicated, so it must start the same everywhere. The experts still
# differ from rank to rank: each is drawn from its own generator, seeded by its global index.
torch.manual_seed(0)
moe = MoE(256, 512, experts=4, topk=2, group=mesh["ep"], algorithm="ring", device=device)
# the parameters are DTensors: w13 and w2 sharded over the ranks by expert (Shard(0)), the router replicated
start, stop = moe.expert_range
opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
rank = dist.get_rank()
for step in range(3):
    x = torch.randn(2, 64, 256, device=device, generator=torch.Generator(device).manual_seed(step * 100 + rank))
    y = moe(x)  # the same shape as x
    loss = y.pow(2).mean()  # this rank's own tokens' loss
    # The backward gives the gradients of the mean of the ranks' losses, as DDP would for a replicated model:
    # the layer averages the router's gradient over the ranks and divides each expert's (summed over every
    # rank's tokens routed to it) by their number (loss="per_rank", the default). Nothing to add here; in a
    # model with dense layers on a dp x ep mesh, commfuse.ep.fully_shard or commfuse.ep.ddp reduce the dense
    # parameters over dp x ep and the layer's over dp, and commfuse.ep.clip_grad_norm_ clips them all.
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"rank {rank}: step {step} y {tuple(y.shape)} loss {loss.item():.4f}", flush=True)
# each rank's experts are its own; w13's shape is the whole layer's, as state_dict and torch.distributed.checkpoint
# see it (a checkpoint holds every rank's experts)
print(f"rank {rank}: experts {start}..{stop - 1} of w13 {tuple(moe.w13.shape)}", flush=True)
dist.destroy_process_group()
