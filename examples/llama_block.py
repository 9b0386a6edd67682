"""Train a Llama-style block for a few steps on a dp x tp mesh, with torch's styles or commfuse's, under FSDP2.

The block and both plans are in commfuse/models/llama.py: RMSNorm, attention
with RoPE and grouped-query heads, a SwiGLU feed-forward. With
``--plan commfuse`` the Q/K/V projections share one fused all-gather, each
query slice's attention feeds the out-projection's reduce-scatter, and the
SwiGLU's up projections share one gather. Run with torchrun::

    torchrun --nproc-per-node 4 examples/llama_block.py --tp 2 --plan commfuse

``COMMFUSE_LOG=info`` in the environment prints, once per rank, what each
fused site took and why; ``--explain`` lists the sites at the end.
"""

import argparse
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import commfuse
from commfuse.models.llama import Block, commfuse_plan, rope_cache, torch_plan

p = argparse.ArgumentParser(description="train a Llama-style block for a few steps under dp x tp")
p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the rest are data parallel)")
p.add_argument("--plan", choices=("torch", "commfuse"), default="commfuse", help="whose styles to use")
p.add_argument("--steps", type=int, default=5, help="AdamW steps")
p.add_argument("--explain", action="store_true",
               help="list every commfuse site of the block and what it took (rank 0, after the last step)")
args = p.parse_args()
if "WORLD_SIZE" not in os.environ:  # torchrun sets it in every process it starts, one per rank
    print("WORLD_SIZE is not set: start one process per rank with torchrun: torchrun --nproc-per-node 4 "
          "examples/llama_block.py --tp 2", file=sys.stderr)
    sys.exit(2)

device = "cuda" if torch.cuda.is_available() else "cpu"
world = int(os.environ["WORLD_SIZE"])
mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
# clip_grad_norm_'s total norm is a DTensor partial over both axes; reading it whole (full_tensor, below) takes
# one all-reduce per axis unless a flattened dp x tp mesh exists, and torch (2.13) warns so on every rank. With
# it, DTensor reduces over all ranks at once: one all-reduce, no warning.
mesh._flatten("dp_tp")
dp, tp = mesh["dp"], mesh["tp"]
torch.manual_seed(0)
block = Block(dim=32, n_heads=4, n_kv_heads=2, ffn=64).to(device)
parallelize_module(block, tp, torch_plan() if args.plan == "torch" else commfuse_plan(head_dim=8))
commfuse.explain(block)  # names the sites by their paths, for COMMFUSE_LOG's lines
fully_shard(block, mesh=dp)
opt = torch.optim.AdamW(block.parameters(), lr=1e-3)
cache = tuple(t.to(device) for t in rope_cache(8, 16))
for step in range(args.steps):
    torch.manual_seed(100 + step)  # the same batch on every rank; each takes its rows and sequence shard
    x = torch.randn(dp.size() * 2, 16, 32, device=device)
    mine = x.tensor_split(dp.size())[dp.get_local_rank()].tensor_split(args.tp, dim=1)[tp.get_local_rank()]
    loss = block(mine, cache).square().mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # on every rank: it may communicate
    opt.step()
    opt.zero_grad()
    if mesh.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.5f} grad norm {norm.item():.5f}")
if args.explain and mesh.get_rank() == 0:
    print(commfuse.explain(block))
# Every rank leaves together, its groups destroyed: a process that exits with gloo's threads still running
# can abort ("terminate called without an active exception") while its peers are still closing.
torch.distributed.barrier()
commfuse.backends.release()
torch.distributed.destroy_process_group()
