"""A mixture-of-experts layer under expert parallelism: ``torchrun --nproc-per-node 2 examples/moe.py``.

Every rank holds experts/world of the experts; each step's tokens are routed top-2, dispatched to their
experts' ranks fused with the experts' first GEMM, and combined fused with the second.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from commfuse.nn import MoE

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh(device, (int(os.environ["WORLD_SIZE"]),), mesh_dim_names=("ep",))
torch.manual_seed(0)  # the same router on every rank (the experts differ: each rank holds its own)
moe = MoE(256, 512, experts=4, topk=2, group=mesh["ep"], algorithm="ring", device=device)
opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
rank = dist.get_rank()
for step in range(3):
    x = torch.randn(2, 64, 256, device=device, generator=torch.Generator(device).manual_seed(step * 100 + rank))
    y = moe(x)  # the same shape as x
    loss = y.pow(2).mean()
    loss.backward()
    # the router is replicated and saw only this rank's tokens: average its gradient over the ranks, as a
    # data-parallel wrapper (DDP, FSDP) over the same ranks would
    dist.all_reduce(moe.router.grad)
    moe.router.grad /= dist.get_world_size()
    opt.step()
    opt.zero_grad()
    print(f"rank {rank}: step {step} y {tuple(y.shape)} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
