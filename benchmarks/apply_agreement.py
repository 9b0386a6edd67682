"""What the ranks' agreement costs when commfuse.tp's styles are applied: parallelizing a Llama-style model.

Tier: benchmark (prints figures, asserts nothing). Two gloo ranks (one thread each) build a model of
``--layers`` Llama blocks (``commfuse.models.llama.Block``) and time ``parallelize_module`` over it, two plans
and two ways, interleaved repeat by repeat:

- plans: ``blocks``, ``commfuse_plan`` (AttentionParallel, SwiGLUParallel: two styles a layer); ``linears``,
  torchtitan's plan with commfuse's ColwiseParallel and RowwiseParallel in place of torch's (seven a layer);
- ways: ``agreed``, as shipped (each style's verdict and decisions exchanged once before anything is
  distributed); ``alone``, the exchange taken out (each rank decides and distributes on its own, as before
  the agreement existed).

Per plan and way, rank 0's median seconds for the whole model, and the added time per style applied. Building
the model is not timed; a barrier starts each timing.

    python benchmarks/apply_agreement.py [--layers 4] [--dim 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _linear_plan(layer: str) -> dict:
    """torchtitan's layouts for one block, with commfuse's per-linear styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    from commfuse import tp

    return {
        f"{layer}.attention_norm": SequenceParallel(),
        f"{layer}.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        **{f"{layer}.attention.{w}": tp.ColwiseParallel() for w in ("wq", "wk", "wv")},
        f"{layer}.attention.wo": tp.RowwiseParallel(output_layouts=Shard(1)),
        f"{layer}.ffn_norm": SequenceParallel(),
        f"{layer}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"{layer}.feed_forward.{w}": tp.ColwiseParallel() for w in ("w1", "w3")},
        f"{layer}.feed_forward.w2": tp.RowwiseParallel(output_layouts=Shard(1)),
    }


def _rank(rank: int, n: int, layers: int, dim: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import commfuse.tp
    from commfuse.models import llama

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    heads = 8
    agreed = commfuse.tp.agree

    def alone(group, what, decide, described, *, label, device=None):
        return decide()

    def plan(which: str) -> dict:
        if which == "blocks":
            return {f"layers.{i}.{k}": v for i in range(layers)
                    for k, v in llama.commfuse_plan(head_dim=dim // heads).items()}
        return {k: v for i in range(layers) for k, v in _linear_plan(f"layers.{i}").items()}

    styles = {which: sum(isinstance(s, commfuse.tp._Style) for s in plan(which).values())
              for which in ("blocks", "linears")}
    seconds: dict = {(which, way): [] for which in styles for way in ("agreed", "alone")}
    for repeat in range(repeats + 1):  # the first round makes the group's first calls: not counted
        for which, way in seconds:
            torch.manual_seed(0)
            model = nn.Module()
            model.layers = nn.ModuleList(llama.Block(dim=dim, n_heads=heads, n_kv_heads=heads // 2, ffn=4 * dim)
                                         for _ in range(layers))
            commfuse.tp.agree = agreed if way == "agreed" else alone
            try:
                dist.barrier()
                start = time.perf_counter()
                parallelize_module(model, mesh, plan(which))
                took = time.perf_counter() - start
            finally:
                commfuse.tp.agree = agreed
            if repeat:
                seconds[which, way].append(took)
    return {"styles": styles, "seconds": {k: statistics.median(v) for k, v in seconds.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    from commfuse.launch import launch

    got = launch(_rank, 2, args.layers, args.dim, args.repeats, timeout=1800)[0]
    print(f"parallelize_module of {args.layers} Llama blocks, dim {args.dim}, 2 gloo ranks (rank 0), median of "
          f"{args.repeats} interleaved repeats")
    print(f"  {'plan':<8} {'styles':>6} {'agreed ms':>10} {'alone ms':>9} {'added ms':>9} {'per style ms':>13}")
    for which, count in got["styles"].items():
        a, b = got["seconds"][which, "agreed"] * 1e3, got["seconds"][which, "alone"] * 1e3
        print(f"  {which:<8} {count:>6} {a:>10.1f} {b:>9.1f} {a - b:>9.1f} {(a - b) / count:>13.2f}")


if __name__ == "__main__":
    main()
