"""Rank-side body of the Llama-block test: commfuse.models.llama's block parallelized twice over a dp x tp
mesh (torch's styles and commfuse's, FSDP2 on dp both times), trained side by side, then checkpointed."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from commfuse.models import llama as llama_block

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _close, _Counted, _full  # noqa: E402  (the shared checks of the DTensor tests)


def train_and_checkpoint(rank, n, checkpoint_dir, tp=2, steps=20):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module


    results = {}
    mesh = init_device_mesh("cpu", (n // tp, tp), mesh_dim_names=("dp", "tp"))
    dp, tpm = mesh["dp"], mesh["tp"]
    seq, batch = 8, 2
    cache = llama_block.rope_cache(8, seq)

    def shard(x):
        mine = x.tensor_split(dp.size())[dp.get_local_rank()]
        return mine.tensor_split(tp, dim=1)[tpm.get_local_rank()].clone()

    def train():
        models = []
        for plan in (llama_block.torch_plan(), llama_block.commfuse_plan(algorithm="ring")):
            torch.manual_seed(0)
            block = llama_block.Block()
            parallelize_module(block, tpm, plan)
            fully_shard(block, mesh=dp)
            models.append((block, torch.optim.AdamW(block.parameters(), lr=1e-2)))
        (theirs, opt_t), (ours, opt_o) = models
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.randn(batch * dp.size(), seq, 32, generator=g)
            target = torch.randn(batch * dp.size(), seq, 32, generator=g)
            lt = (theirs(shard(x), cache) - shard(target)).square().mean()
            with _Counted() as calls:
                lo = (ours(shard(x), cache) - shard(target)).square().mean()
            # Q/K/V and the two up projections: a gather each; the down projection and the attention slices:
            # a reduce-scatter each
            fused = {"all_gather_matmul": 2, "matmul_reduce_scatter": 1, "attention_reduce_scatter": 1}
            if calls != fused:
                raise AssertionError(f"step {step}: the forward took the fused ops {calls}, not {fused}")
            _close(lo, lt, f"step {step} loss")
            lt.backward()
            lo.backward()
            nt = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
            no = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.5)
            _close(no, nt, f"step {step} clip_grad_norm_")
            norms = [torch.zeros(()) for _ in range(n)]
            dist.all_gather(norms, _full(no).detach().reshape(()).clone())
            if len({float(v) for v in norms}) != 1:
                raise AssertionError(f"step {step}: clip_grad_norm_ differs between ranks: {[float(v) for v in norms]}")
            opt_t.step(), opt_o.step()
            opt_t.zero_grad(), opt_o.zero_grad()
        for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
            if not isinstance(po, DTensor):
                raise AssertionError(f"{name} is a {type(po).__name__}, not a DTensor")
            _close(po, pt, f"{name} after {steps} AdamW steps")
        return ours

    def checkpoint(ours):
        import torch.distributed.checkpoint as dcp

        dcp.save(ours.state_dict(), checkpoint_id=checkpoint_dir)
        # the same block unsharded (tp = 1, no dp): every rank loads the whole checkpoint into plain tensors
        plain = llama_block.Block()
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=checkpoint_dir)
        plain.load_state_dict(state)
        g = torch.Generator().manual_seed(77)
        x = torch.randn(batch * dp.size(), seq, 32, generator=g)
        target = torch.randn(batch * dp.size(), seq, 32, generator=g)
        with torch.no_grad():
            whole = (plain(x, cache) - target).square().mean()
            mine = (ours(shard(x), cache) - shard(target)).square().mean()
        # every rank holds an equal share of the batch and sequence: the mean over ranks is the whole's mean
        total = _full(mine).detach().clone()
        dist.all_reduce(total)
        _close(total / n, whole, "loss of the tp=1 block loaded from the tp=2 checkpoint")

    try:
        ours = train()
        results["train"] = None
    except Exception as e:
        results["train"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        results["checkpoint"] = "not run: training failed"
        return results
    try:
        checkpoint(ours)
        results["checkpoint"] = None
    except Exception as e:
        results["checkpoint"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    return results
